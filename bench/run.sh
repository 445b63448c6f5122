#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bufbroker benchmark: build an optimised tree, start bufbrokerd, the raw
# SOCK_SEQPACKET echo server and redis-server (on a Unix socket) in a
# temporary directory, run every scenario of bufbroker-bench against them,
# print one table and write JSON (and, with --plot, PNGs).
#
# Usage: bench/run.sh [--quick] [--plot] [--journal] [--build-dir DIR] [--out DIR]
#                     [-- BUFBROKER-BENCH-OPTIONS...]
#
#   --quick          about a minute; proves the benchmark works (CI). Its
#                    numbers are not meant to be read, and nothing asserts them.
#   --plot           draw throughput.png and latency.png (gnuplot) into the
#                    output directory.
#   --build-dir DIR  use the binaries of an existing build tree as they are
#                    (no package installation, no build). Default: configure
#                    and build ROOT/build-bench, installing missing Debian
#                    packages first (scripts/lib.sh). Its build type is
#                    RelWithDebInfo (-O2 -g -DNDEBUG: the optimisation Debian
#                    packages are built with, and the tree the tests prove);
#                    BUFBROKER_BENCH_BUILD_TYPE=Release measures -O3 instead.
#   --out DIR        where bench.json, bench.txt, the plot data and PNGs go
#                    (default: BUILD/bench-results).
#   --no-pin         pin nothing, ever (to see what scheduler placement does).
#   --shmem-thp MODE set the kernel's shmem transparent huge page mode
#                    (/sys/kernel/mm/transparent_hugepage/shmem_enabled: never,
#                    advise, within_size, always) for the run and put the old
#                    one back at the end; root only. It changes what every
#                    process on the machine gets meanwhile. By default the
#                    machine's mode is left as it is and recorded.
#   --journal        run the (first) daemon with --restart: its state journal
#                    on (docs/RESTART.md; experimental), so that every row
#                    measures it (the command line recorded with the results
#                    says which). Without it the journal's cost is measured
#                    anyway: a fourth daemon with --restart serves the
#                    "journal" round-trip rows (1 and 16 clients) and the
#                    restart scenario, which fills it with 100 000 buffers
#                    and re-executes it; a fifth, its twin started the same
#                    way but without --restart, serves the "no-journal" rows
#                    the journal rows are paired with.
#   -- ARGS...       passed to bufbroker-bench run, e.g. --only roundtrip,local
#                    or --reps 9 (see bufbroker-bench --help).
#
# Placement: with two or more CPUs, single-client and single-process
# figures run with the servers (bufbrokerd, echo, redis) pinned to CPU 0 and
# the client on another CPU; runs with several clients pin nothing (pinned,
# the clients' CPUs would be the bottleneck for every system alike).
# bufbroker-bench moves the servers between the two (--server-pids).
# Latency figures are medians over repetitions. The daemon's open-file limit
# is raised (root with CAP_SYS_RESOURCE only) so that the scale scenario can
# hold a million memfds; where it cannot be, the host scale levels stop at
# what the limit allows, and the table says so. The scale scenario's second
# series holds the same levels as 256 B CUDA buffers (no fd each), so it
# reaches a million wherever there is a CUDA driver, the fake one included.
#
# CUDA: $BUFBROKER_CUDA_LIBRARY when set; else the real driver when
# libcuda.so.1 is installed; else the build's libfakecuda.so (the figures
# then describe the fake, not a GPU); else the CUDA rows are skipped.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

QUICK=0
PLOT=0
NOPIN=0
declare -a JOURNAL=()
SHMEM_THP=
BUILD=
OUT=
declare -a EXTRA=()
CMDLINE="bench/run.sh${*:+ $*}"

while [[ $# -gt 0 ]]; do
	case $1 in
	--quick) QUICK=1 ;;
	--plot) PLOT=1 ;;
	--no-pin) NOPIN=1 ;;
	--journal) JOURNAL=(--restart) ;;
	--shmem-thp)
		[[ $# -ge 2 && $2 =~ ^(never|advise|within_size|always)$ ]] ||
			{ echo "run.sh: --shmem-thp needs never, advise, within_size or always" >&2; exit 2; }
		SHMEM_THP=$2
		shift
		;;
	--build-dir)
		[[ $# -ge 2 ]] || { echo "run.sh: --build-dir needs a directory" >&2; exit 2; }
		BUILD=$(cd "$2" && pwd)
		shift
		;;
	--out)
		[[ $# -ge 2 ]] || { echo "run.sh: --out needs a directory" >&2; exit 2; }
		OUT=$2
		shift
		;;
	--)
		shift
		EXTRA=("$@")
		break
		;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "run.sh: unknown argument '$1' (try --help)" >&2
		exit 2
		;;
	esac
	shift
done

# ---- build ---------------------------------------------------------------------
if [[ -z $BUILD ]]; then
	bb_ensure_packages
	BUILD="$ROOT/${BUFBROKER_BENCH_BUILD_DIR:-build-bench}"
	TYPE="${BUFBROKER_BENCH_BUILD_TYPE:-RelWithDebInfo}"
	bb_log "configuring $BUILD ($TYPE)"
	cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE="$TYPE" >/dev/null
	bb_log "building bufbroker-bench and bufbrokerd"
	cmake --build "$BUILD" -j "$(nproc)" --target bufbroker-bench bufbrokerd
	# The fake CUDA driver is a test target; without tests it is not there.
	cmake --build "$BUILD" -j "$(nproc)" --target fakecuda >/dev/null 2>&1 || true
fi
BENCH="$BUILD/bufbroker-bench"
DAEMON="${BUFBROKERD:-$BUILD/bufbrokerd}"
for exe in "$BENCH" "$DAEMON"; do
	[[ -x $exe ]] || { echo "run.sh: $exe is missing; build it first" >&2; exit 1; }
done
OUT="${OUT:-$BUILD/bench-results}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# ---- servers -------------------------------------------------------------------
THP_FILE=/sys/kernel/mm/transparent_hugepage/shmem_enabled
thp_mode() { sed -n 's/.*\[\(.*\)\].*/\1/p' "$THP_FILE" 2>/dev/null || true; }
THP_OLD=
DIR=$(mktemp -d /tmp/bbbench-XXXXXX)
DPID=
CPID=
VPID=
EPID=
RPID=
JPID=
NPID=

stop() { # stop PID SECONDS: SIGTERM, then SIGKILL after SECONDS
	local pid=$1 secs=$2 i
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < secs * 20; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.05
	done
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}
cleanup() {
	stop "$EPID" 5
	stop "$RPID" 5
	stop "$DPID" 60
	stop "$CPID" 60
	stop "$VPID" 60
	stop "$JPID" 60
	stop "$NPID" 60
	# A sanitizer build's report at the daemon's exit must reach the caller.
	for log in "$DIR/daemon.log" "$DIR/daemon-cuda.log" "$DIR/daemon-vmm.log" "$DIR/daemon-journal.log" \
		"$DIR/daemon-journal-off.log"; do
		if grep -qE "Sanitizer|runtime error:" "$log" 2>/dev/null; then
			echo "---- bufbrokerd log (sanitizer report): $log ----" >&2
			cat "$log" >&2
		fi
	done
	rm -rf "$DIR"
	if [[ -n $THP_OLD ]]; then
		echo "$THP_OLD" >"$THP_FILE" || echo "run.sh: could not put $THP_FILE back to $THP_OLD" >&2
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ -n $SHMEM_THP ]]; then
	was=$(thp_mode)
	[[ -n $was ]] || { echo "run.sh: $THP_FILE is not readable: no shmem THP here" >&2; exit 1; }
	echo "$SHMEM_THP" 2>/dev/null >"$THP_FILE" ||
		{ echo "run.sh: cannot write $THP_FILE (--shmem-thp needs root)" >&2; exit 1; }
	THP_OLD=$was # cleanup puts it back
	bb_log "shmem transparent huge pages: $SHMEM_THP for this run (was $THP_OLD)"
fi

# Servers on CPU 0, clients on the others, when there are others.
declare -a PIN=()
SERVER_CPU=-1
if [[ $NOPIN -eq 0 && $(nproc) -ge 2 ]] && command -v taskset >/dev/null && taskset -c 0 true 2>/dev/null; then
	PIN=(taskset -c 0)
	SERVER_CPU=0
fi

# CUDA for the daemon and the benchmark alike.
CUDA_ARG=()
CUDA_DESC="none"
if [[ -n ${BUFBROKER_CUDA_LIBRARY:-} ]]; then
	CUDA_ARG=(--cuda)
	CUDA_DESC="$BUFBROKER_CUDA_LIBRARY"
elif [[ $(/sbin/ldconfig -p 2>/dev/null) == *'libcuda.so.1 '* ]]; then
	CUDA_ARG=(--cuda)
	CUDA_DESC="libcuda.so.1 (the real driver)"
else
	for f in "${BB_FAKECUDA:-}" "$BUILD/libfakecuda.so"; do
		if [[ -n $f && -f $f ]]; then
			export BUFBROKER_CUDA_LIBRARY=$f
			# A namespace of its own, away from tests running meanwhile.
			export FAKECUDA_NAMESPACE="bbbench$$"
			CUDA_ARG=(--cuda)
			CUDA_DESC="libfakecuda.so (the fake driver, not a GPU)"
			break
		fi
	done
fi

# The scale scenario keeps up to a million host buffers, one memfd each: raise
# the daemon's open-file limit (root may raise the hard limit up to fs.nr_open).
# Its CUDA series keeps as many 256 B CUDA buffers, in a second daemon (below):
# 256 MiB of 64 MiB slabs, within the default per-device limit (90% of the
# device; the fake driver's is FAKECUDA_MEMORY, 1 GiB by default, shared by
# both daemons) and the per-uid one given here.
MAX_LEVEL=1000000
[[ $QUICK -eq 1 ]] && MAX_LEVEL=100000
WANT_FILES=$((MAX_LEVEL + 4096))
NR_OPEN=$(cat /proc/sys/fs/nr_open 2>/dev/null || echo 1048576)
[[ $WANT_FILES -gt $NR_OPEN ]] && WANT_FILES=$NR_OPEN

wait_socket() { # wait_socket PATH PID WHAT
	local i
	for ((i = 0; i < 500; i++)); do
		[[ -S $1 ]] && return 0
		kill -0 "$2" 2>/dev/null || { echo "run.sh: $3 exited during start-up" >&2; return 1; }
		sleep 0.01
	done
	echo "run.sh: no socket from $3 after 5 s" >&2
	return 1
}

# --max-connections: the most client processes bufbroker-bench starts (1000)
# and the scale fillers, and no more: each connection counts 9 fds against
# the daemon's open-file budget (docs/OPERATIONS.md, "Open files"), and the
# host buffers of the scale series get what the budget leaves: the bench
# caps their levels at the open-file limit less what the daemon keeps
# (--daemon-fds-kept: 9 per connection, 256 spare, the 64 pooled memfds,
# what it has open at start, with room to spare, and when it serves CUDA
# the 1024 VMM allocations --max-cuda-vmm-allocations reserves).
MAX_CONN=1100
bb_log "starting bufbrokerd (a second and a third one with CUDA), the echo server and redis-server in $DIR"
(
	ulimit -n "$WANT_FILES" 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
	exec "${PIN[@]}" "$DAEMON" --socket "$DIR/bb.sock" --log-level warn \
		--uid-buffers $((MAX_LEVEL + 100000)) --uid-host-bytes 1T --uid-cuda-bytes 1T \
		--max-connections "$MAX_CONN" ${JOURNAL[@]+"${JOURNAL[@]}"}
) >"$DIR/daemon.log" 2>&1 &
DPID=$!
wait_socket "$DIR/bb.sock" "$DPID" bufbrokerd || { cat "$DIR/daemon.log" >&2; exit 1; }

# A second daemon, idle until the CUDA scale series runs on it: the first
# one's heap keeps what the host series freed, and CUDA buffers reusing it
# would read as costing nothing.
SCALE_CUDA_ARG=()
if [[ ${#CUDA_ARG[@]} -gt 0 ]]; then
	"${PIN[@]}" "$DAEMON" --socket "$DIR/bb-cuda.sock" --log-level warn \
		--uid-buffers $((MAX_LEVEL + 100000)) --uid-cuda-bytes 1T \
		--max-connections "$MAX_CONN" >"$DIR/daemon-cuda.log" 2>&1 &
	CPID=$!
	wait_socket "$DIR/bb-cuda.sock" "$CPID" "the second bufbrokerd" ||
		{ cat "$DIR/daemon-cuda.log" >&2; exit 1; }
	SCALE_CUDA_ARG=(--scale-cuda-socket "$DIR/bb-cuda.sock" --scale-cuda-pid "$CPID")
	# A third, whose buffers are VMM CUDA buffers by default: the VMM
	# series compares its memory per buffer with the second's.
	"${PIN[@]}" "$DAEMON" --socket "$DIR/bb-vmm.sock" --log-level warn \
		--uid-buffers $((MAX_LEVEL + 100000)) --uid-cuda-bytes 1T \
		--max-connections "$MAX_CONN" --cuda-handle vmm >"$DIR/daemon-vmm.log" 2>&1 &
	VPID=$!
	wait_socket "$DIR/bb-vmm.sock" "$VPID" "the third bufbrokerd" ||
		{ cat "$DIR/daemon-vmm.log" >&2; exit 1; }
	SCALE_CUDA_ARG+=(--scale-vmm-socket "$DIR/bb-vmm.sock" --scale-vmm-pid "$VPID")
fi

# A fourth, with its state journal on (docs/RESTART.md): the round trip
# with the journal on at 1 and 16 clients, paired with the first daemon's,
# and the restart scenario, which fills it (host buffers up to its open-file
# limit, then 256 B CUDA buffers, VMM by default, when there is CUDA) and
# has it re-execute itself. Few connections, so that the open-file budget
# leaves the host buffers as much as it can.
#
# Its journal-off twin, started the same way but without --restart (the
# same limits, open-file limit, pinning, log level and CUDA handle, right
# after it), is what its round trip rows are paired with: the first daemon
# differs from it in more than the journal.
journal_daemon() { # journal_daemon NAME [--restart]: start bb-NAME.sock, log daemon-NAME.log
	local name=$1
	shift
	(
		ulimit -n "$WANT_FILES" 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
		exec "${PIN[@]}" "$DAEMON" --socket "$DIR/bb-$name.sock" --log-level info "$@" \
			--uid-buffers $((MAX_LEVEL + 100000)) --uid-host-bytes 1T --uid-cuda-bytes 1T \
			--max-connections 200 ${CUDA_ARG[@]+--cuda-handle vmm}
	) >"$DIR/daemon-$name.log" 2>&1 &
}
journal_daemon journal --restart
JPID=$!
journal_daemon journal-off
NPID=$!
wait_socket "$DIR/bb-journal.sock" "$JPID" "the journal-on bufbrokerd" ||
	{ cat "$DIR/daemon-journal.log" >&2; exit 1; }
wait_socket "$DIR/bb-journal-off.sock" "$NPID" "the journal-off twin bufbrokerd" ||
	{ cat "$DIR/daemon-journal-off.log" >&2; exit 1; }

"${PIN[@]}" "$BENCH" echo-server --socket "$DIR/echo.sock" >"$DIR/echo.log" 2>&1 &
EPID=$!
wait_socket "$DIR/echo.sock" "$EPID" "the echo server" || { cat "$DIR/echo.log" >&2; exit 1; }

REDIS_ARG=()
if command -v redis-server >/dev/null; then
	"${PIN[@]}" redis-server --port 0 --unixsocket "$DIR/redis.sock" --unixsocketperm 700 \
		--save "" --appendonly no --dir "$DIR" --daemonize no --maxclients 4096 \
		>"$DIR/redis.log" 2>&1 &
	RPID=$!
	wait_socket "$DIR/redis.sock" "$RPID" redis-server || { cat "$DIR/redis.log" >&2; exit 1; }
	REDIS_ARG=(--redis-socket "$DIR/redis.sock")
else
	bb_warn "redis-server not found: the Redis rows will be skipped (apt-get install redis-server)"
fi

# ---- run -----------------------------------------------------------------------
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
	COMMIT="$COMMIT (with uncommitted changes)"
fi
CONDITIONS="$(nproc) CPUs; load average at start $(cut -d' ' -f1-3 /proc/loadavg);"
CONDITIONS+=" daemon open-file limit $(awk '/Max open files/ {print $4}' "/proc/$DPID/limits");"
CONDITIONS+=" shmem THP: $(thp_mode)${SHMEM_THP:+ (set by --shmem-thp, was $THP_OLD)};"
CONDITIONS+=" CUDA: $CUDA_DESC"

SERVER_PIDS="$DPID,$EPID,$JPID,$NPID${RPID:+,$RPID}${CPID:+,$CPID}${VPID:+,$VPID}"
QUICK_ARG=()
[[ $QUICK -eq 1 ]] && QUICK_ARG=(--quick)
bb_log "running bufbroker-bench${QUICK_ARG:+ --quick} (CUDA: $CUDA_DESC)"
rc=0
"$BENCH" run --bb-socket "$DIR/bb.sock" --echo-socket "$DIR/echo.sock" "${REDIS_ARG[@]}" \
	--journal-socket "$DIR/bb-journal.sock" --journal-pid "$JPID" \
	--journal-off-socket "$DIR/bb-journal-off.sock" --journal-off-pid "$NPID" \
	--daemon-pid "$DPID" --daemon-fds-kept $((9 * MAX_CONN + 1024 + 1024)) "${SCALE_CUDA_ARG[@]}" --server-cpu "$SERVER_CPU" --server-pids "$SERVER_PIDS" \
	"${QUICK_ARG[@]}" "${CUDA_ARG[@]}" \
	--json "$OUT/bench.json" --plot-data "$OUT" \
	--commit "$COMMIT" --command "$CMDLINE" --conditions "$CONDITIONS" \
	"${EXTRA[@]}" | tee "$OUT/bench.txt" || rc=$?
kill -0 "$DPID" 2>/dev/null || { echo "run.sh: bufbrokerd died during the run" >&2; rc=1; }
[[ -z $CPID ]] || kill -0 "$CPID" 2>/dev/null ||
	{ echo "run.sh: the second bufbrokerd (CUDA scale) died during the run" >&2; rc=1; }
[[ -z $VPID ]] || kill -0 "$VPID" 2>/dev/null ||
	{ echo "run.sh: the third bufbrokerd (VMM scale) died during the run" >&2; rc=1; }
# The restart scenario re-executes it in place: the same pid.
kill -0 "$JPID" 2>/dev/null ||
	{ echo "run.sh: the journal-on bufbrokerd died during the run" >&2; rc=1; }
kill -0 "$NPID" 2>/dev/null ||
	{ echo "run.sh: the journal-off twin bufbrokerd died during the run" >&2; rc=1; }
for log in "$DIR/daemon.log" "$DIR/daemon-cuda.log" "$DIR/daemon-vmm.log" "$DIR/daemon-journal.log" \
	"$DIR/daemon-journal-off.log"; do
	if [[ -s $log ]]; then
		echo "---- bufbrokerd log: ${log##*/} ----"
		tail -n 20 "$log"
	fi
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/bench.txt"
[[ $rc -eq 0 ]] || exit "$rc"

# ---- plots ---------------------------------------------------------------------
if [[ $PLOT -eq 1 ]]; then
	command -v gnuplot >/dev/null || { echo "run.sh: --plot needs gnuplot (gnuplot-nox)" >&2; exit 1; }
	gnuplot <<EOF
set terminal pngcairo size 900,560 noenhanced font ",11"
set datafile missing "nan"
set key top left
set grid
set logscale x 2
set xlabel "client processes"
set xtics (1, 2, 4, 8, 16, 32, 64, 128)
set offsets graph 0.03, graph 0.03, 0, 0
set output "$OUT/throughput.png"
set title "Round trips per second (one op = one request and its answer), $COMMIT"
set ylabel "ops/s"
set yrange [0:*]
plot "$OUT/roundtrip.dat" using 1:2 with linespoints lw 2 title "bufbroker (retain/release)", \
     "" using 1:5 with linespoints lw 2 title "raw SOCK_SEQPACKET echo", \
     "" using 1:8 with linespoints lw 2 title "Redis INCR/DECR"
set output "$OUT/latency.png"
set title "Round-trip latency, p50 (solid) and p99 (dashed)"
set ylabel "microseconds"
set logscale y
set yrange [*:*]
plot "$OUT/roundtrip.dat" using 1:3 with linespoints lw 2 lc 1 title "bufbroker p50", \
     "" using 1:4 with linespoints lw 2 lc 1 dt 2 title "bufbroker p99", \
     "" using 1:6 with linespoints lw 2 lc 2 title "echo p50", \
     "" using 1:7 with linespoints lw 2 lc 2 dt 2 title "echo p99", \
     "" using 1:9 with linespoints lw 2 lc 3 title "redis p50", \
     "" using 1:10 with linespoints lw 2 lc 3 dt 2 title "redis p99"
EOF
	bb_log "plots: $OUT/throughput.png $OUT/latency.png"
fi
bb_log "results: $OUT/bench.json and $OUT/bench.txt"
