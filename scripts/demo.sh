#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build bufbroker and show it working: start bufbrokerd on a private
# socket, let bb-producer fill a buffer and hand it over as a token, let
# bb-consumer (another process) adopt and verify it, look at the daemon
# with the bufbroker CLI, and stop the daemon cleanly.
#
# Usage: ./scripts/demo.sh    (as any user: as root it installs missing
#        packages itself, as another user through sudo, asked only then)
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT"

bb_ensure_packages
bb_build "$BB_BUILD_DIR" RelWithDebInfo

bin="$BB_ROOT/$BB_BUILD_DIR"
for exe in bufbrokerd bufbroker bb-producer bb-consumer; do
	if [ ! -x "$bin/$exe" ]; then
		echo "demo: $bin/$exe was not built" >&2
		exit 1
	fi
done

tmp="$(mktemp -d "${TMPDIR:-/tmp}/bufbroker-demo.XXXXXX")"
sock="$tmp/bufbroker.sock"
daemon_pid=""

cleanup()
{
	local rc=$?
	if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
		kill -TERM "$daemon_pid" 2>/dev/null || true
		wait "$daemon_pid" 2>/dev/null || true
	fi
	if [ "$rc" -ne 0 ] && [ -s "$tmp/daemon.log" ]; then
		echo "--- daemon log ---" >&2
		cat "$tmp/daemon.log" >&2
	fi
	rm -rf "$tmp"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step()
{
	printf '\n==> step %s\n' "$*"
}

fail()
{
	printf 'demo: FAILED: %s\n' "$*" >&2
	exit 1
}

# 1. The daemon, in the background, logging to a file.
step "1: start bufbrokerd on $sock"
"$bin/bufbrokerd" --socket "$sock" --log-level info 2>"$tmp/daemon.log" &
daemon_pid=$!
for _ in $(seq 100); do
	[ -S "$sock" ] && break
	kill -0 "$daemon_pid" 2>/dev/null || fail "bufbrokerd exited during startup"
	sleep 0.1
done
[ -S "$sock" ] || fail "bufbrokerd did not create $sock within 10 s"
echo "bufbrokerd is running (pid $daemon_pid)"

# 2. The producer allocates a 1 MiB host buffer, fills it, takes a token
#    for it and exits; the token keeps the buffer alive meanwhile.
step "2: bb-producer allocates and fills a buffer, prints a token"
"$bin/bb-producer" --socket "$sock" >"$tmp/producer.out" || fail "bb-producer failed"
token="$(grep -E -m1 '^[0-9a-f]{32}$' "$tmp/producer.out" || true)"
[ -n "$token" ] || fail "bb-producer printed no token (32 hex digits)"
echo "token: $token"

step "3: no process holds the buffer now; the token does (refs 1, tokens 1)"
"$bin/bufbroker" --socket "$sock" stat example || fail "bufbroker stat failed"

# 4. Another process adopts the token, waits for READY and checks every byte.
step "4: bb-consumer (another process) adopts the token and verifies the bytes"
"$bin/bb-consumer" --socket "$sock" "$token" || fail "bb-consumer failed"

step "5: the consumer released the last reference: the buffer is gone"
"$bin/bufbroker" --socket "$sock" status || fail "bufbroker status failed"
echo
"$bin/bufbroker" --socket "$sock" ls || fail "bufbroker ls failed"
# The consumer's last release travels without a reply; give the daemon a
# moment to act on it before calling the buffer leaked.
for _ in $(seq 20); do
	json="$("$bin/bufbroker" --socket "$sock" --json ls)" || fail "bufbroker --json ls failed"
	case "$json" in *'"buffers":[]'*) break ;; esac
	sleep 0.1
done
case "$json" in
*'"buffers":[]'*) echo "no buffers left: $json" ;;
*) fail "buffers left behind: $json" ;;
esac

step "6: stop bufbrokerd with SIGTERM"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[ "$rc" -eq 0 ] || fail "bufbrokerd exited with status $rc"
echo "bufbrokerd exited with status 0"

echo
echo "--- daemon log ---"
cat "$tmp/daemon.log"
echo
echo "demo: OK: a buffer went from one process to another through bufbrokerd, and nothing was left behind"
