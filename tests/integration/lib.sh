# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Shared by the shell integration tests (tests/integration/*.sh): their
# directory and traps, how they fail, the checks of what ctest gives them, and
# starting, waiting for and stopping a bufbrokerd. Source it from bash after
# `set -euo pipefail`:
#
#	source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# It defines functions only; init_test sets the variables. Not a test itself:
# CMakeLists.txt leaves it out of the shell.* tests.
#
# The ERR trap does not reach into functions (bash passes it on only under
# set -E): a command in one of these that can fail calls fail itself.

# init_test NAME: the state every test has, and its traps. DIR: a new
# directory /tmp/bbt-NAME-XXXXXX, removed at exit; SOCK ($DIR/bb.sock) and
# LOG ($DIR/daemon.log, shown by fail), which a script may point elsewhere;
# DPID: the daemon's pid, none yet; STEP: what the test is doing ("setup"),
# named by fail. cleanup runs at exit, and fail on any command that fails.
init_test() {
	DIR=$(mktemp -d "/tmp/bbt-$1-XXXXXX")
	SOCK=$DIR/bb.sock
	LOG=$DIR/daemon.log
	DPID=
	STEP="setup"
	trap cleanup EXIT
	trap 'fail "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR
}

# cleanup: (the EXIT trap) SIGKILL to the daemon $DPID if it still runs; then
# remove $DIR.
cleanup() {
	if [[ -n $DPID ]] && kill -0 "$DPID" 2>/dev/null; then
		kill -KILL "$DPID" 2>/dev/null || true
		wait "$DPID" 2>/dev/null || true
	fi
	rm -rf "$DIR"
}

# fail MESSAGE...: "FAIL ($STEP): MESSAGE" and the last 40 lines of the
# daemon's log $LOG (when LOG names a file) on stderr; exit 1. A script may
# define its own after sourcing this file (systemd.sh does); the ERR trap and
# the functions here call whichever is defined.
fail() {
	echo "FAIL ($STEP): $*" >&2
	if [[ -n $LOG && -f $LOG ]]; then
		echo "---- daemon log (tail) ----" >&2
		tail -n 40 "$LOG" >&2
		echo "---- end of daemon log ----" >&2
	fi
	exit 1
}

# ci: true under continuous integration (CI=true, 1 or yes, as
# scripts/lib.sh's bb_ci reads it), where no test may skip.
ci() {
	case "${CI:-}" in
	[Tt][Rr][Uu][Ee] | 1 | [Yy][Ee][Ss]) return 0 ;;
	*) return 1 ;;
	esac
}

# skip REASON...: this test cannot run here. "SKIP: REASON" and exit 77,
# which ctest reports as Skipped (SKIP_RETURN_CODE in CMakeLists.txt), never
# as Passed; under CI, fail instead.
skip() {
	ci && fail "it would skip ($*), and CI=$CI allows no skip"
	echo "SKIP: $*"
	exit 77
}

# skip_part REASON...: one part of this test cannot run here: say so
# ("SKIP (part): REASON") and carry on; finish then exits 77. Under CI,
# fail instead.
SKIPPED_PARTS=()
skip_part() {
	ci && fail "it would skip a part ($*), and CI=$CI allows no skip"
	echo "SKIP (part): $*"
	SKIPPED_PARTS+=("$*")
}

# finish NAME: the test's last words. "NAME: all checks passed", or, when
# skip_part skipped something, each such part on a "SKIP:" line and exit 77.
finish() {
	local part
	if [[ ${#SKIPPED_PARTS[@]} -eq 0 ]]; then
		echo "$1: all checks passed"
		return 0
	fi
	for part in "${SKIPPED_PARTS[@]}"; do
		echo "SKIP: $part"
	done
	echo "$1: the other checks passed, but ${#SKIPPED_PARTS[@]} part(s) did not run"
	exit 77
}

# need_vars TEST WHAT VAR...: each VAR is set and its value passes
# `test TEST` (-x, -e, -d ...), else fail "$VAR must name WHAT (ctest sets it)".
need_vars() {
	local t=$1 what=$2 v
	shift 2
	for v in "$@"; do
		if [[ -z ${!v:-} ]] || ! test "$t" "${!v}"; then
			fail "\$$v must name $what (ctest sets it)"
		fi
	done
}

# find_python PURPOSE: PY, Debian's /usr/bin/python3, else the python3 on
# PATH; fail "python3 is needed to PURPOSE" when there is neither.
find_python() {
	PY=/usr/bin/python3
	[[ -x $PY ]] || PY=$(command -v python3) || fail "python3 is needed to $1"
}

# cli ARGS...: the bufbroker CLI ($BUFBROKER_CLI) on $SOCK, for at most 10 s.
cli() { timeout 10 "$BUFBROKER_CLI" --socket "$SOCK" "$@"; }

# wait_socket [WHAT [PATTERN]]: until $SOCK is a socket and, given PATTERN,
# the log $LOG has a line matching it (grep's basic regex), for at most 5 s.
# Fails "WHAT exited during start-up" (WHAT: bufbrokerd unless given) as
# soon as the process $DPID ends, and "no socket at $SOCK after 5 s" if the
# socket never came (a PATTERN that never matched is the caller's to check).
wait_socket() {
	local what=${1:-bufbrokerd} pattern=${2:-}
	for _ in $(seq 500); do
		[[ -S $SOCK ]] && { [[ -z $pattern ]] || grep -q -- "$pattern" "$LOG"; } && break
		kill -0 "$DPID" 2>/dev/null || fail "$what exited during start-up"
		sleep 0.01
	done
	[[ -S $SOCK ]] || fail "no socket at $SOCK after 5 s"
}

# produce_activated NAME SIZE PATTERN: bb-producer ($BB_PRODUCER) on $SOCK
# makes a host buffer NAME of SIZE bytes filled with PATTERN and prints its
# token, which goes in TOK; being the first connection, it makes the
# socket-activating process $DPID exec bufbrokerd, which is checked.
produce_activated() {
	TOK=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name "$1" --size "$2" --pattern "$3") ||
		fail "bb-producer exited $?"
	[[ $TOK =~ ^[0-9a-f]{32}$ ]] || fail "bb-producer printed '$TOK', not a token"
	local exe
	exe=$(readlink "/proc/$DPID/exe" || true)
	[[ $exe == "$(readlink -f "$BUFBROKERD")" ]] ||
		fail "pid $DPID runs '$exe', not bufbrokerd, after the first connection"
}

# start_bufbrokerd ARGS...: "$BUFBROKERD" ARGS... in the background, its
# output in $LOG; sets DPID and waits for $SOCK (wait_socket).
start_bufbrokerd() {
	"$BUFBROKERD" "$@" >"$LOG" 2>&1 &
	DPID=$!
	wait_socket bufbrokerd
}

# sigterm_daemon: SIGTERM to the daemon $DPID and wait for it to end; fail if
# it still runs 10 s later. Sets DAEMON_RC to its exit status (the caller
# says what it should be) and DPID to none.
# shellcheck disable=SC2034 # DAEMON_RC is the caller's
sigterm_daemon() {
	kill -TERM "$DPID" || fail "could not send SIGTERM to pid $DPID (kill exited $?)"
	for _ in $(seq 1000); do
		kill -0 "$DPID" 2>/dev/null || break
		sleep 0.01
	done
	kill -0 "$DPID" 2>/dev/null && fail "bufbrokerd still runs 10 s after SIGTERM"
	DAEMON_RC=0
	wait "$DPID" || DAEMON_RC=$?
	DPID=
}
