#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Check the systemd units in systemd/: `systemd-analyze verify` has nothing
# to say about bufbrokerd.socket and bufbrokerd.service, and `systemd-analyze
# security --offline=true` rates the service 2.0 or lower (its exposure
# level, 0.0 to 10.0; --threshold=20 is 2.0 on that scale).
#
# Usage: scripts/check-units.sh DAEMON
#   DAEMON: a built bufbrokerd. verify insists that ExecStart= names an
#   executable, so the units are checked as copies whose ExecStart= names
#   DAEMON (its arguments kept).
# Exits 0 when both pass, 1 when not, 77 (after a SKIP line) when
# systemd-analyze is not installed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
daemon="${1:?usage: scripts/check-units.sh DAEMON}"
[ -x "$daemon" ] || {
	echo "check-units: $daemon is not an executable" >&2
	exit 1
}
daemon="$(readlink -f "$daemon")"
if ! command -v systemd-analyze >/dev/null 2>&1; then
	echo "SKIP: systemd-analyze is not installed (apt-get install systemd)"
	exit 77
fi

tmp="$(mktemp -d /tmp/bb-units.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
cp "$root/systemd/bufbrokerd.service" "$root/systemd/bufbrokerd.socket" "$tmp/"
sed -i -E "s|^ExecStart=[^ ]*bufbrokerd|ExecStart=$daemon|" "$tmp/bufbrokerd.service"
if ! grep -q "^ExecStart=$daemon" "$tmp/bufbrokerd.service"; then
	echo "check-units: bufbrokerd.service has no ExecStart= naming bufbrokerd" >&2
	exit 1
fi

rc=0
out=$(cd "$tmp" && systemd-analyze verify --man=no "$tmp/bufbrokerd.socket" \
	"$tmp/bufbrokerd.service" 2>&1) || rc=$?
# Unknown keys and bad values are only warnings (exit 0): any line about
# our units is a failure too.
if [ "$rc" -ne 0 ] || grep -E 'bufbrokerd\.(service|socket)' <<<"$out" >&2; then
	echo "check-units: systemd-analyze verify (exit $rc): $out" >&2
	exit 1
fi
echo "check-units: systemd-analyze verify: no complaint about bufbrokerd.socket and bufbrokerd.service"

rc=0
out=$(systemd-analyze security --offline=true --threshold=20 "$tmp/bufbrokerd.service" 2>&1) || rc=$?
score=$(sed -n 's/.*Overall exposure level for bufbrokerd\.service: \([0-9.]*\).*/\1/p' <<<"$out")
if [ -z "$score" ]; then
	echo "check-units: systemd-analyze security printed no exposure level (exit $rc): $out" >&2
	exit 1
fi
if [ "$rc" -ne 0 ]; then
	grep '✗' <<<"$out" >&2 || true
	echo "check-units: bufbrokerd.service rates $score, above 2.0" >&2
	exit 1
fi
echo "check-units: systemd-analyze security rates bufbrokerd.service $score (at most 2.0)"
