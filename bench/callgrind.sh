#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Instructions per operation, counted by valgrind's callgrind: the figures
# of the fast-path changes in docs/PERFORMANCE.md that timing on a shared
# machine cannot settle. For each operation, two runs of bench/cgloop.c
# with N and N + DELTA iterations; the difference in instructions over
# DELTA is the cost of one, free of start-up and shutdown.
#
# Usage: bench/callgrind.sh [--build-dir DIR] [--delta N] [--journal]
#   --build-dir DIR  the build tree whose bufbrokerd and libbufbroker are
#                    counted (default: ROOT/build-bench, as bench/run.sh
#                    builds it; a sanitizer build counts the sanitizer)
#   --delta N        iterations the two runs differ by (default 20000)
#   --journal        run the daemon with --restart (its state journal on):
#                    the difference from a run without is the journal's cost
#
# Prints, per retain or release request (the round trip's two halves) and
# per host alloc (1 MiB) + map + unref: the daemon's instructions and the
# client process's. Then, counted by strace (-f -c) on the daemon with 8
# threads of one client sharing its connection (pipelined requests), the
# daemon's reading and waiting system calls per request: what batching
# saves. strace slows the daemon, so requests queue more than they would
# without it; compare builds with each other, not with a real run.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh"

BUILD="$BB_ROOT/build-bench"
DELTA=20000
declare -a JOURNAL=()
while [[ $# -gt 0 ]]; do
	case $1 in
	--build-dir) BUILD=$(cd "$2" && pwd); shift 2 ;;
	--delta) DELTA=$2; shift 2 ;;
	--journal) JOURNAL=(--restart); shift ;;
	-h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "callgrind.sh: unknown argument $1" >&2; exit 2 ;;
	esac
done
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is not installed" >&2; exit 1; }
# bench/run.sh builds only bufbroker-bench and bufbrokerd (the bench links the
# library statically); the shared library this counts comes from the same tree.
if [[ -f $BUILD/CMakeCache.txt && ! -e $BUILD/libbufbroker.so ]]; then
	bb_log "building libbufbroker.so and bufbrokerd in $BUILD"
	cmake --build "$BUILD" -j "$(nproc)" --target bufbroker bufbrokerd >/dev/null
fi
[[ -x $BUILD/bufbrokerd && -e $BUILD/libbufbroker.so ]] ||
	{ echo "callgrind.sh: no bufbrokerd/libbufbroker.so in $BUILD (build it first)" >&2; exit 1; }

DIR=$(mktemp -d /tmp/bbcg-XXXXXX)
DPID=
cleanup() {
	[[ -z $DPID ]] || { kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null || true; }
	rm -rf "$DIR"
}
trap cleanup EXIT
cc -O2 -I"$BB_ROOT/include" "$BB_ROOT/bench/cgloop.c" -o "$DIR/cgloop" \
	-L"$BUILD" -lbufbroker -Wl,-rpath,"$BUILD" -pthread
export BUFBROKERD_CONFIG=/dev/null BUFBROKER_SOCKET="$DIR/bb.sock"

total() { # total CALLGRIND-OUT: the run's instructions
	callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'
}
start_daemon() { # start_daemon [WRAPPER...]: bufbrokerd on $DIR/bb.sock
	rm -f "$DIR/bb.sock"
	"$@" "$BUILD/bufbrokerd" --socket "$DIR/bb.sock" --no-cuda ${JOURNAL[@]+"${JOURNAL[@]}"} \
		>>"$DIR/daemon.log" 2>&1 &
	DPID=$!
	for _ in $(seq 300); do
		[[ -S $DIR/bb.sock ]] && return 0
		sleep 0.1
	done
	cat "$DIR/daemon.log" >&2
	return 1
}
stop_daemon() {
	kill -TERM "$DPID"
	wait "$DPID" || true
	DPID=
}

daemon_ir() { # daemon_ir OP N: the daemon's instructions serving cgloop OP N
	start_daemon valgrind --tool=callgrind --callgrind-out-file="$DIR/d.$1.$2"
	"$DIR/cgloop" "$1" "$2"
	stop_daemon
	total "$DIR/d.$1.$2"
}
client_ir() { # client_ir OP N: cgloop's own instructions
	valgrind --tool=callgrind --callgrind-out-file="$DIR/c.$1.$2" "$DIR/cgloop" "$1" "$2" \
		>/dev/null 2>&1
	total "$DIR/c.$1.$2"
}

N0=2000
N1=$((N0 + DELTA))
bb_log "counting with callgrind ($BUILD, $N0 and $N1 iterations)"
rt_d=$((($(daemon_ir rt $N1) - $(daemon_ir rt $N0)) / (2 * DELTA)))
al_d=$((($(daemon_ir alloc $N1) - $(daemon_ir alloc $N0)) / DELTA))
start_daemon
rt_c=$((($(client_ir rt $N1) - $(client_ir rt $N0)) / (2 * DELTA)))
al_c=$((($(client_ir alloc $N1) - $(client_ir alloc $N0)) / DELTA))
stop_daemon

syscalls() { # syscalls N: strace -c of the daemon serving cgloop mt N, into $DIR/s.N
	start_daemon
	strace -f -c -o "$DIR/s.$1" -p "$DPID" 2>/dev/null &
	local spid=$!
	sleep 1 # strace attached
	"$DIR/cgloop" mt "$1"
	kill -INT "$spid"
	wait "$spid" || true
	stop_daemon
}
count() { # count STRACE-C-OUTPUT SYSCALL: its calls, 0 if absent
	awk -v s="$2" '$NF == s { print $4; found = 1 } END { if (!found) print 0 }' "$1"
}
MT_N=2000
syscalls $MT_N
reqs=$((2 * 8 * MT_N))

printf '%-44s %12s %12s\n' "instructions per operation" "daemon" "client"
printf '%-44s %12d %12d\n' "retain or release (one request and answer)" "$rt_d" "$rt_c"
printf '%-44s %12d %12d\n' "host alloc 1 MiB + map + unref" "$al_d" "$al_c"
echo
echo "daemon system calls, 8 threads sharing one connection, $reqs requests (strace -c)"
for sc in recvmsg recvmmsg epoll_wait sendmsg; do
	n=$(count "$DIR/s.$MT_N" "$sc")
	awk -v s="$sc" -v n="$n" -v r="$reqs" 'BEGIN { printf "  %-12s %8d calls %8.3f per request\n", s, n, n / r }'
done
