#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the libFuzzer target fuzz_dispatch with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer, and fuzz the daemon's request path for a
# bounded time (tests/fuzz/README.md). Any crash, leak, sanitizer report or
# timeout fails, and its input is copied into tests/fuzz/regressions/ to be
# committed: ctest fuzz.replay then runs it in every suite.
#
# Usage: tests/fuzz/run.sh
# Environment:
#   FUZZ_TIME   seconds of fuzzing (default 60)
#   FUZZ_JOBS   fuzzing processes, one per core (default 2)
#   BUFBROKER_BUILD_DIR   as for scripts/test.sh; the tree is DIR-fuzz
#                         (default build-fuzz); the corpus it grows stays
#                         there (DIR-fuzz/fuzz-corpus) for the next run
# Exit status: 0 clean, 1 a finding or a failed build, 77 skipped (no clang
# or no libFuzzer runtime).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
cd "$BB_ROOT"

FUZZ_TIME="${FUZZ_TIME:-60}"
FUZZ_JOBS="${FUZZ_JOBS:-2}"
dir="$BB_ROOT/$BB_BUILD_DIR-fuzz"
seeds="$BB_ROOT/tests/fuzz/corpus"
regressions="$BB_ROOT/tests/fuzz/regressions"

if ! command -v clang >/dev/null 2>&1; then
	echo "SKIP: clang is not installed (apt-get install clang libclang-rt-dev)"
	exit 77
fi
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
	>"$probe/probe.c"
if ! clang -fsanitize=fuzzer "$probe/probe.c" -o "$probe/probe" >/dev/null 2>&1; then
	echo "SKIP: clang cannot link libFuzzer (apt-get install libclang-rt-dev)"
	exit 77
fi

# -O1 and assertions on (Debug, not NDEBUG); every object carries the
# coverage instrumentation (fuzzer-no-link), only the target links libFuzzer.
bb_log "configuring $dir (clang, libFuzzer, ASan + UBSan)"
cmake -S "$BB_ROOT" -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug \
	-DCMAKE_C_FLAGS="-O1 -fsanitize=fuzzer-no-link" -DBB_SANITIZE=ON -DBB_FUZZ=ON \
	-DBB_BUILD_TESTS=OFF -DBB_BUILD_EXAMPLES=OFF >/dev/null
bb_log "building fuzz_dispatch"
cmake --build "$dir" -j "$(nproc)" --target fuzz_dispatch

# As in scripts/test.sh: ASan cannot map its shadow with more than 28 bits
# of mmap randomization on some toolchains; run without ASLR then.
runner=()
bits="$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)"
if [ "$bits" -gt 28 ] && setarch "$(uname -m)" -R true 2>/dev/null; then
	runner=(setarch "$(uname -m)" -R)
fi

work="$dir/fuzz-corpus"
artifacts="$dir/fuzz-artifacts"
mkdir -p "$work"
rm -rf "$artifacts"
mkdir -p "$artifacts"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

# One process per job, all growing the same corpus (libFuzzer reloads what
# the others add); new inputs go to $work, the seeds stay as they are.
bb_log "fuzzing for $FUZZ_TIME s with $FUZZ_JOBS processes (logs: $dir/fuzz-N.log)"
pids=()
for ((i = 0; i < FUZZ_JOBS; i++)); do
	"${runner[@]}" "$dir/fuzz_dispatch" -max_total_time="$FUZZ_TIME" -timeout=10 \
		-rss_limit_mb=2048 -print_final_stats=1 -seed=$((i + 1)) \
		-artifact_prefix="$artifacts/" "$work" "$seeds" "$regressions" \
		>"$dir/fuzz-$i.log" 2>&1 &
	pids+=("$!")
done
failed=0
for ((i = 0; i < FUZZ_JOBS; i++)); do
	if ! wait "${pids[$i]}"; then
		failed=1
		echo "---- fuzz process $i failed; the end of $dir/fuzz-$i.log:"
		tail -n 60 "$dir/fuzz-$i.log"
	fi
done

for ((i = 0; i < FUZZ_JOBS; i++)); do
	grep -h -E '^stat::number_of_executed_units|^stat::peak_rss_mb' "$dir/fuzz-$i.log" |
		sed "s/^/fuzz process $i: /" || true
done
echo "corpus: $(find "$work" -type f | wc -l) inputs in $work"

shopt -s nullglob
found=("$artifacts"/*)
if [ "${#found[@]}" -gt 0 ]; then
	for f in "${found[@]}"; do
		cp "$f" "$regressions/"
		echo "FINDING: $(basename "$f") copied to tests/fuzz/regressions/"
	done
	echo "Reproduce:  $dir/fuzz_dispatch tests/fuzz/regressions/<file>"
	echo "  (or, with any compiler: FUZZ_DISPATCH_TRACE=1 build/fuzz_dispatch_replay FILE)"
	echo "Fix the daemon, then commit the file(s) in tests/fuzz/regressions/: ctest fuzz.replay"
	echo "runs them in every suite from then on."
	exit 1
fi
if [ "$failed" -ne 0 ]; then
	echo "FAIL: a fuzz process failed without leaving an input (see the log above)"
	exit 1
fi
echo "fuzz: no finding in $FUZZ_TIME s x $FUZZ_JOBS processes"
