#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The systemd units verify, and bufbrokerd serves a socket passed by socket
# activation (LISTEN_FDS): the producer/consumer examples and the CLI work
# through it, and SIGTERM ends it with 0.
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER, BB_CONSUMER and
# BB_SOURCE_DIR. Skips (lib.sh's skip: exit 77, a failure under CI) only
# when systemd-analyze or systemd-socket-activate is not installed.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test systemd
# DPID is systemd-socket-activate's pid, which becomes bufbrokerd's when it
# execs the daemon; its log holds what both print.
LOG=$DIR/activate.log

# fail MESSAGE...: lib.sh's, but the log it shows is named for both programs,
# and only when something was written to it.
fail() {
	echo "FAIL ($STEP): $*" >&2
	if [[ -s $LOG ]]; then
		echo "---- systemd-socket-activate / bufbrokerd log (tail) ----" >&2
		tail -n 40 "$LOG" >&2
		echo "---- end of log ----" >&2
	fi
	exit 1
}

for tool in systemd-analyze systemd-socket-activate; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		skip "$tool is not installed"
	fi
done
need_vars -x "an executable" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_CONSUMER
[[ -n ${BB_SOURCE_DIR:-} && -d $BB_SOURCE_DIR/systemd ]] ||
	fail "\$BB_SOURCE_DIR/systemd is not a directory (ctest sets BB_SOURCE_DIR)"

# ---- (a) the units verify ----------------------------------------------------
STEP="systemd-analyze verify"
UNITS=$DIR/units
mkdir "$UNITS"
for u in bufbrokerd.service bufbrokerd.socket; do
	[[ -f $BB_SOURCE_DIR/systemd/$u ]] || fail "missing unit $BB_SOURCE_DIR/systemd/$u"
	cp "$BB_SOURCE_DIR/systemd/$u" "$UNITS/"
done
grep -q '^ExecStart=' "$UNITS/bufbrokerd.service" || fail "bufbrokerd.service has no ExecStart="
# Point ExecStart at the built daemon so the path exists; keep its arguments.
sed -i -E "s|^ExecStart=[^ ]*bufbrokerd|ExecStart=$BUFBROKERD|" "$UNITS/bufbrokerd.service"
grep -q "^ExecStart=$BUFBROKERD" "$UNITS/bufbrokerd.service" ||
	fail "could not rewrite ExecStart: $(grep '^ExecStart=' "$UNITS/bufbrokerd.service")"
rc=0
out=$(cd "$UNITS" && systemd-analyze verify --man=no "$UNITS/bufbrokerd.socket" \
	"$UNITS/bufbrokerd.service" 2>&1) || rc=$?
[[ $rc -eq 0 ]] || fail "systemd-analyze verify exited $rc: $out"
# Unknown keys and bad values are only warnings (exit 0): any line about our
# units is a failure.
if grep -E 'bufbrokerd\.(service|socket)' <<<"$out"; then
	fail "systemd-analyze verify complained about the units: $out"
fi

# ---- (b) socket activation ----------------------------------------------------
STEP="systemd-socket-activate"
systemd-socket-activate --seqpacket -l "$SOCK" "$BUFBROKERD" >"$LOG" 2>&1 &
DPID=$!
wait_socket systemd-socket-activate

STEP="producer through the activated socket"
# The first connection makes systemd-socket-activate exec bufbrokerd with
# the listening socket as fd 3 (LISTEN_FDS=1).
tok=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-activated --size 65536 --pattern 5) ||
	fail "bb-producer exited $?"
[[ $tok =~ ^[0-9a-f]{32}$ ]] || fail "bb-producer printed '$tok', not a token"
exe=$(readlink "/proc/$DPID/exe" || true)
[[ $exe == "$(readlink -f "$BUFBROKERD")" ]] ||
	fail "pid $DPID runs '$exe', not bufbrokerd, after the first connection"

STEP="consumer through the activated socket"
out=$(timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size 65536 --pattern 5 "$tok") ||
	fail "bb-consumer exited $?"
grep -q "verified 65536 bytes" <<<"$out" || fail "bb-consumer: $out"

STEP="CLI status through the activated socket"
out=$(timeout 10 "$BUFBROKER_CLI" --socket "$SOCK" status) || fail "bufbroker status exited $?"
grep -Eq "^pid +$DPID\$" <<<"$out" || fail "status does not show the daemon's pid $DPID: $out"
json=$(timeout 10 "$BUFBROKER_CLI" --socket "$SOCK" --json status) || fail "bufbroker --json status exited $?"
grep -q "\"pid\":${DPID}[,}]" <<<"$json" || fail "status --json does not show pid $DPID: $json"
grep -q '"host":{"buffers":0,' <<<"$json" || fail "the consumed buffer was not freed: $json"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "socket-activated bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"
echo "systemd.sh: all checks passed"
