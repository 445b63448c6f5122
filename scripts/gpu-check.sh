#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check: everything about CUDA buffers that only a real GPU can
# show, in one command, in under 5 minutes on one GPU. Against the real
# driver (libcuda.so.1, never tests/fakecuda) it runs
#   1. the CUDA integration tests with legacy IPC buffers
#      (tests/integration/test_cuda.c, BB_REAL_CUDA=1),
#   2. the same tests with VMM buffers (the daemon's default handle VMM),
#   3. the PID-namespace test: a consumer in its own PID namespace maps a
#      VMM buffer through the socket alone (root only; skipped otherwise),
#   4. a short benchmark (bufbroker-bench --only cuda): p50 of the first map
#      of a VMM slab, of a map in an already mapped slab (VMM and legacy),
#      legacy cuIpcOpenMemHandle + cuIpcCloseMemHandle, and the driver's VMM
#      import + map + unmap,
# and prints one table. Exit status 0 when every suite passed.
#
# Usage: scripts/gpu-check.sh [--build-dir DIR] [--libs DIR] [--out DIR]
#   --build-dir DIR  use the binaries already built in DIR (for a machine
#                    without the build dependencies: build here, carry DIR).
#                    Default: configure and build ROOT/build-gpu.
#   --libs DIR       prepend DIR to LD_LIBRARY_PATH (libuv, protobuf-c and
#                    Criterion unpacked from their .debs, for a machine that
#                    lacks them: dpkg -x PKG.deb DIR, then DIR/usr/lib/...).
#                    Every lib directory under DIR is added.
#   --out DIR        where the logs and the benchmark's JSON go
#                    (default: BUILD/gpu-check).
#   --fake LIB       try this script where there is no GPU: everything runs
#                    against tests/fakecuda's LIB (libfakecuda.so) instead of
#                    the driver. What it prints then describes the fake.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD=
LIBS=
OUT=
FAKE=
while [[ $# -gt 0 ]]; do
	case $1 in
	--build-dir) BUILD=$(cd "$2" && pwd) || exit 2; shift ;;
	--libs) LIBS=$(cd "$2" && pwd) || exit 2; shift ;;
	--out) OUT=$2; shift ;;
	--fake) FAKE=$(realpath "$2") || exit 2; shift ;;
	-h | --help)
		sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) echo "gpu-check: unknown argument '$1' (try --help)" >&2; exit 2 ;;
	esac
	shift
done

T0=$(date +%s)
log() { printf 'gpu-check [%3ds]: %s\n' "$(($(date +%s) - T0))" "$*" >&2; }

if [[ -n $LIBS ]]; then
	while IFS= read -r d; do
		LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	done < <(find "$LIBS" -name '*.so*' -printf '%h\n' | sort -u)
	export LD_LIBRARY_PATH
fi

if [[ -z $BUILD ]]; then
	BUILD="$ROOT/build-gpu"
	log "building $BUILD"
	cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
		cmake --build "$BUILD" -j "$(nproc)" --target bufbrokerd bufbroker_cli bb-producer \
			bb-consumer integ_test_cuda bufbroker-bench >/dev/null ||
		{ echo "gpu-check: the build failed" >&2; exit 1; }
fi
OUT=${OUT:-$BUILD/gpu-check}
mkdir -p "$OUT"

# The real driver, never the fake (unless --fake).
unset BUFBROKER_CUDA_LIBRARY BB_FAKECUDA FAKECUDA_NAMESPACE FAKECUDA_DEVICES FAKECUDA_MEMORY BBT_CUDA_HANDLE
if [[ -n $FAKE ]]; then
	export BB_FAKECUDA="$FAKE" BUFBROKER_CUDA_LIBRARY="$FAKE" FAKECUDA_NAMESPACE="gpucheck$$"
	unset BB_REAL_CUDA
else
	export BB_REAL_CUDA=1
fi
export BUFBROKERD="$BUILD/bufbrokerd" BUFBROKER_CLI="$BUILD/bufbroker"
export BB_PRODUCER="$BUILD/bb-producer" BB_CONSUMER="$BUILD/bb-consumer" BUFBROKERD_CONFIG=/dev/null
[[ -x $BUFBROKER_CLI ]] || BUFBROKER_CLI="$BUILD/bufbroker_cli"

# Outputs are read whole before a grep or head: one that stops reading
# early SIGPIPEs a writer still writing, which pipefail counts as failure.
GPU=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)
GPU=${GPU%%$'\n'*}
[[ -z $FAKE ]] || GPU="the fake driver $FAKE (no GPU: these figures are not a GPU's)"
log "GPU: ${GPU:-unknown (no nvidia-smi)}"
cache=$(/sbin/ldconfig -p 2>/dev/null)
if ! grep -q 'libcuda\.so\.1' <<<"$cache"; then
	[[ -e /usr/lib/x86_64-linux-gnu/libcuda.so.1 || -e /usr/lib64/libcuda.so.1 ]] ||
		log "libcuda.so.1 not in the loader cache: the tests will say whether it loads"
fi

declare -a SUITE_NAME=() SUITE_RESULT=()
# suite NAME SECONDS COMMAND...: run it, keep its log, record its synthesis.
suite()
{
	local name=$1 secs=$2 logf="$OUT/${1// /_}.log" rc line
	shift 2
	log "running $name"
	timeout --kill-after=10 "$secs" "$@" >"$logf" 2>&1
	rc=$?
	line=$(grep -a 'Synthesis:' "$logf" | tail -n1 | sed 's/.*Synthesis: //')
	if [[ $rc -eq 124 || $rc -eq 137 ]]; then
		line="TIMED OUT after ${secs}s; $line"
	elif [[ $rc -eq 77 ]]; then
		line="SKIPPED: $(grep -a -m1 '^SKIP' "$logf")"
	elif [[ $rc -ne 0 ]]; then
		line="FAILED (exit $rc); $line"
		FAILED=1
	fi
	[[ $rc -eq 124 || $rc -eq 137 ]] && FAILED=1
	SUITE_NAME+=("$name")
	SUITE_RESULT+=("${line:-exit $rc}")
	if [[ $rc -ne 0 && $rc -ne 77 ]]; then
		grep -a -m 20 -E '\[(FAIL|----)\]|Assertion|failed' "$logf" >&2
	fi
}
FAILED=0

TEST_CUDA="$BUILD/integ_test_cuda"
# BBT_CUDA_HANDLE: the handle kind the harness makes every daemon's
# default (--cuda-handle), as ctest's integration.test_cuda_vmm does.
suite "CUDA tests, legacy buffers" 100 env BBT_CUDA_HANDLE=legacy "$TEST_CUDA" --jobs 1
suite "CUDA tests, VMM buffers" 100 env BBT_CUDA_HANDLE=vmm "$TEST_CUDA" --jobs 1
if [[ $(id -u) -eq 0 ]]; then
	suite "PID namespace, VMM" 60 "$TEST_CUDA" --jobs 1 --filter '*/*pid_namespace*'
else
	SUITE_NAME+=("PID namespace, VMM")
	SUITE_RESULT+=("SKIPPED: needs root for unshare --pid")
fi

log "benchmark (bufbroker-bench --only cuda)"
BENCH_OK=1
timeout --kill-after=10 120 "$ROOT/bench/run.sh" --build-dir "$BUILD" --out "$OUT/bench" \
	-- --only cuda --reps 1 --duration 0.5 >"$OUT/bench.log" 2>&1 || BENCH_OK=0

# p50 of one row of bench.json ("-" when missing or skipped).
p50()
{
	local f="$OUT/bench/bench.json"
	[[ -s $f ]] || { echo "-"; return; }
	if command -v python3 >/dev/null; then
		python3 - "$f" "$1" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception:
    print("-"); sys.exit(0)
rows = doc.get("results", doc if isinstance(doc, list) else [])
for r in rows:
    if r.get("name") == sys.argv[2]:
        v = r.get("p50_us")
        print("-" if r.get("skipped") or v is None else "%.1f" % v)
        break
else:
    print("-")
EOF
	else
		grep -o "\"name\": \"$1\"[^}]*" "$f" | grep -m1 -o '"p50_us": [0-9.]*' |
			awk '{printf "%.1f\n", $2} END {if (NR == 0) print "-"}'
	fi
}

echo
echo "bufbroker GPU check: ${GPU:-unknown GPU}, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
printf '%-34s %s\n' "suite" "result"
for i in "${!SUITE_NAME[@]}"; do
	printf '%-34s %s\n' "${SUITE_NAME[$i]}" "${SUITE_RESULT[$i]}"
done
echo
printf '%-52s %10s\n' "benchmark" "p50 (us)"
printf '%-52s %10s\n' "VMM: first map of a slab (bb_open+bb_map)" "$(p50 cuda.vmm_map_cold)"
printf '%-52s %10s\n' "VMM: map in an already mapped slab" "$(p50 cuda.vmm_map_warm)"
printf '%-52s %10s\n' "legacy: map, allocation already open" "$(p50 cuda.map_warm)"
printf '%-52s %10s\n' "legacy: map, fresh allocation (IPC open)" "$(p50 cuda.map_cold)"
printf '%-52s %10s\n' "legacy: cuIpcOpenMemHandle + cuIpcCloseMemHandle" "$(p50 cuda.ipc_open_close)"
printf '%-52s %10s\n' "VMM: import+reserve+map+access+unmap+release" "$(p50 cuda.vmm_import_map)"
if [[ -s $OUT/bench/bench.txt ]]; then
	echo
	grep -a -E '^  (met|NOT MET|not measured) .*VMM' "$OUT/bench/bench.txt" || true
fi
[[ $BENCH_OK -eq 1 ]] || { echo "(the benchmark failed: $OUT/bench.log)"; FAILED=1; }
echo "logs: $OUT; total $(($(date +%s) - T0)) s"
exit "$FAILED"
