#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The systemd units verify and the service's sandbox rates 2.0 or lower
# (scripts/check-units.sh), and bufbrokerd serves a socket passed by socket
# activation (LISTEN_FDS): the producer/consumer examples and the CLI work
# through it, and SIGTERM ends it with 0. With $NOTIFY_SOCKET it speaks the
# sd_notify protocol as systemd's Type=notify expects: READY=1 once it
# serves; on SIGHUP, RELOADING=1 with MONOTONIC_USEC (its CLOCK_MONOTONIC
# time) before it reads the file and READY=1 after, whether the reload was
# applied or not; STOPPING=1 on SIGTERM.
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

# ---- (a) the units verify, and the service rates 2.0 or lower --------------------
STEP="scripts/check-units.sh"
rc=0
out=$("$BB_SOURCE_DIR/scripts/check-units.sh" "$BUFBROKERD" 2>&1) || rc=$?
[[ $rc -eq 0 ]] || fail "scripts/check-units.sh exited $rc: $out"

# ---- (b) sd_notify: start, reload, stop ----------------------------------------
# A stand-in for systemd's notify socket: a datagram socket whose messages
# go to $NLOG, each followed by a line "--". It ends at STOPPING=1, or after
# its deadline.
find_python "listen on a notify socket"
NSOCK=$DIR/notify.sock NLOG=$DIR/notify.log NPID=
SLOW=${BBT_SLOW:-1}
cleanup_notify() {
	if [[ -n $NPID ]] && kill -0 "$NPID" 2>/dev/null; then
		kill -TERM "$NPID" 2>/dev/null || true
		wait "$NPID" 2>/dev/null || true
	fi
	cleanup
}
trap cleanup_notify EXIT
"$PY" -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(60 * int(sys.argv[3]))
with open(sys.argv[2], "w") as log:
    while True:
        m = s.recv(4096).decode()
        log.write(m.rstrip("\n") + "\n--\n")
        log.flush()
        if "STOPPING=1" in m.split("\n"):
            break
' "$NSOCK" "$NLOG" "$SLOW" &
NPID=$!
for _ in $(seq $((500 * SLOW))); do
	[[ -S $NSOCK ]] && break
	sleep 0.01
done
[[ -S $NSOCK ]] || fail "the notify listener made no socket"

# nmsgs: how many messages $NLOG holds. wait_nmsgs N: until it holds N.
nmsgs() { grep -c '^--$' "$NLOG" || true; }
wait_nmsgs() {
	for _ in $(seq $((500 * SLOW))); do
		[[ $(nmsgs) -ge $1 ]] && return 0
		sleep 0.01
	done
	fail "the daemon sent $(nmsgs) notify messages, want $1: $(cat "$NLOG")"
}
# msg N: the Nth message (from 1), one field a line.
msg() { awk -v n="$1" '/^--$/ { i++; next } i == n - 1' "$NLOG"; }
monotonic_usec() { "$PY" -c 'import time; print(time.monotonic_ns() // 1000)'; }

# reload FILE FIRST STATUS: write FILE (printf's format) to $CONF and send
# SIGHUP; messages FIRST and FIRST+1 must be that reload: RELOADING=1 with
# a MONOTONIC_USEC taken between the SIGHUP and the READY=1, then READY=1
# with STATUS.
reload() {
	local r first=$2 status=$3 usec t0 t1
	# shellcheck disable=SC2059 # the file's text is the format
	printf "$1" >"$CONF"
	t0=$(monotonic_usec)
	kill -HUP "$DPID"
	wait_nmsgs $((first + 1))
	t1=$(monotonic_usec)
	r=$(msg "$first")
	grep -qx 'RELOADING=1' <<<"$r" || fail "message $first is not RELOADING=1: $r"
	usec=$(sed -n 's/^MONOTONIC_USEC=\([0-9][0-9]*\)$/\1/p' <<<"$r")
	[[ -n $usec ]] || fail "RELOADING=1 came without MONOTONIC_USEC=<decimal>: $r"
	[[ $usec -ge $t0 && $usec -le $t1 ]] ||
		fail "MONOTONIC_USEC=$usec is not the CLOCK_MONOTONIC time of the reload ($t0..$t1 µs)"
	r=$(msg $((first + 1)))
	grep -qx 'READY=1' <<<"$r" || fail "message $((first + 1)) is not READY=1: $r"
	grep -qx "STATUS=$status" <<<"$r" || fail "READY=1 after the reload does not say STATUS=$status: $r"
}

STEP="sd_notify: READY=1 at start"
LOG=$DIR/notify-daemon.log
CONF=$DIR/bufbrokerd.conf
printf '[limits]\nconn_waits = 100\n' >"$CONF"
NOTIFY_SOCKET=$NSOCK start_bufbrokerd --socket "$SOCK" --config "$CONF" --no-cuda
wait_nmsgs 1
grep -qx 'READY=1' <<<"$(msg 1)" || fail "the first message is not READY=1: $(msg 1)"

STEP="sd_notify: SIGHUP with a good file"
reload '[limits]\nconn_waits = 200\n' 2 serving
grep -q 'event=config_reloaded' "$LOG" || fail "the daemon did not log the reload"

STEP="sd_notify: SIGHUP with a bad file"
reload '[limits]\nconn_waits = lots\n' 4 "serving; the last reload failed, see the log"

STEP="sd_notify: STOPPING=1 at SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"
wait_nmsgs 6
grep -qx 'STOPPING=1' <<<"$(msg 6)" || fail "the last message is not STOPPING=1: $(msg 6)"
wait "$NPID" || fail "the notify listener exited $?"
NPID=
[[ $(nmsgs) -eq 6 ]] || fail "unexpected notify messages: $(cat "$NLOG")"
LOG=$DIR/activate.log

# ---- (c) socket activation ----------------------------------------------------
STEP="systemd-socket-activate"
systemd-socket-activate --seqpacket -l "$SOCK" "$BUFBROKERD" >"$LOG" 2>&1 &
DPID=$!
wait_socket systemd-socket-activate

STEP="producer through the activated socket"
# The first connection makes systemd-socket-activate exec bufbrokerd with
# the listening socket as fd 3 (LISTEN_FDS=1).
produce_activated bbt-activated 65536 5
tok=$TOK

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
