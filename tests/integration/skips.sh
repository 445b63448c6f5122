#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A skip is never a pass, and under CI it is a failure:
#  - a Criterion program (tests/criterion_main.c) whose tests skip names each
#    on a SKIP line and exits 77; under CI it exits 1; a failure wins over a
#    skip; tests left out by --filter are no skip. The probe is
#    tests/integration/skip_probe.c;
#  - every unit., integration. and shell. test has SKIP_RETURN_CODE 77, and
#    ctest then reports Skipped, not Passed;
#  - lib.sh's skip, skip_part and finish do the same for the shell tests;
#  - scripts/lib.sh, of which scripts/test.sh makes its summary:
#    bb_ctest_skipped finds the tests ctest skipped, and bb_step calls a
#    skip SKIP, never PASS, and under CI a FAIL.
#
# ctest sets BB_BUILD_DIR (skip_probe is built there) and BB_SOURCE_DIR.
# shellcheck disable=SC2016 # the bash -c scripts expand their own "$1"
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test skips
need_vars -d "a directory" BB_BUILD_DIR BB_SOURCE_DIR
PROBE=$BB_BUILD_DIR/skip_probe
[[ -x $PROBE ]] || fail "no $PROBE (the skip_probe target)"
TESTLIB=$BB_SOURCE_DIR/tests/integration/lib.sh
SCRIPTLIB=$BB_SOURCE_DIR/scripts/lib.sh
OUT=$DIR/out

# run ENV... -- COMMAND...: COMMAND with CI unset and the ENV assignments
# given; its exit status in RC, its output in $OUT.
run() {
	local -a envs=()
	while [[ $1 != -- ]]; do
		envs+=("$1")
		shift
	done
	shift
	RC=0
	env -u CI -u BB_SKIP_PROBE_FAIL "${envs[@]}" "$@" >"$OUT" 2>&1 || RC=$?
}

# want RC PATTERN...: RC is the last run's status and each grep -E PATTERN
# matches a line of its output.
want() {
	local rc=$1 p
	shift
	[[ $RC -eq $rc ]] || fail "exit $RC, want $rc; output:"$'\n'"$(cat "$OUT")"
	for p in "$@"; do
		grep -Eq -- "$p" "$OUT" || fail "no line matches '$p'; output:"$'\n'"$(cat "$OUT")"
	done
}

STEP="a Criterion program whose test skips exits 77 and names it"
run -- "$PROBE" --jobs 1
want 77 '^SKIP: probe::skips_itself: the probe always skips this one$' '^SKIP: 1 test\(s\) skipped'

STEP="under CI a skip fails the program"
for v in true TRUE 1 yes; do
	run CI=$v -- "$PROBE" --jobs 1
	want 1 '^SKIP: probe::skips_itself' "CI=$v allows no skip"
done
run CI=false -- "$PROBE" --jobs 1
want 77

STEP="a failure wins over a skip"
run BB_SKIP_PROBE_FAIL=1 -- "$PROBE" --jobs 1
want 1

STEP="tests left out by --filter are no skip"
run -- "$PROBE" --jobs 1 --filter 'probe/passes'
want 0
grep -q SKIP "$OUT" && fail "a filtered run reports a skip: $(cat "$OUT")"

STEP="every test of the build skips with 77"
run -- ctest --test-dir "$BB_BUILD_DIR" --show-only=json-v1
want 0
/usr/bin/python3 - "$OUT" <<'EOF' || fail "SKIP_RETURN_CODE is not 77 everywhere"
import json, sys

tests = json.load(open(sys.argv[1]))["tests"]
bad = []
for t in tests:
    if t["name"].split(".")[0] not in ("unit", "integration", "shell"):
        continue
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    if str(props.get("SKIP_RETURN_CODE")) != "77":
        bad.append(t["name"])
if bad or not tests:
    sys.exit(f"no SKIP_RETURN_CODE 77: {bad}")
EOF

STEP="ctest reports the skipping program as Skipped, and bb_ctest_skipped names it"
mkdir "$DIR/ctest"
cat >"$DIR/ctest/CTestTestfile.cmake" <<EOF
add_test(probe.skips "$PROBE" --jobs 1)
set_tests_properties(probe.skips PROPERTIES SKIP_RETURN_CODE 77)
add_test(probe.passes "$PROBE" --jobs 1 --filter probe/passes)
set_tests_properties(probe.passes PROPERTIES SKIP_RETURN_CODE 77)
EOF
run -- ctest --test-dir "$DIR/ctest"
want 0 'probe\.skips .*Skipped' 'probe\.passes .*Passed'
cp "$OUT" "$DIR/ctest.out"
run -- bash -c 'source "$1"; bb_ctest_skipped "$2"' _ "$SCRIPTLIB" "$DIR/ctest.out"
want 0
[[ $(cat "$OUT") == probe.skips ]] || fail "bb_ctest_skipped said '$(cat "$OUT")', want probe.skips"

STEP="lib.sh: skip exits 77, or fails under CI"
run -- bash -c 'source "$1"; init_test skip-a; skip "no widget here"' _ "$TESTLIB"
want 77 '^SKIP: no widget here$'
run CI=true -- bash -c 'source "$1"; init_test skip-b; skip "no widget here"' _ "$TESTLIB"
want 1 'allows no skip'

STEP="lib.sh: skip_part carries on, then finish exits 77; or it fails under CI"
part='source "$1"; init_test skip-c; skip_part "the widget part"; echo "carried on"; finish t.sh'
run -- bash -c "$part" _ "$TESTLIB"
want 77 '^SKIP \(part\): the widget part$' '^carried on$' '^SKIP: the widget part$'
run CI=true -- bash -c "$part" _ "$TESTLIB"
want 1 'allows no skip'
grep -q "carried on" "$OUT" && fail "skip_part under CI carried on"
run -- bash -c 'source "$1"; init_test skip-d; finish t.sh' _ "$TESTLIB"
want 0 '^t\.sh: all checks passed$'

STEP="scripts/lib.sh: bb_step never calls a skip a pass"
steps='source "$1"; bb_step a 0; bb_step b 77 "" "no tool"; bb_step c 3 broken
printf "%s\n" "${BB_SUMMARY[@]}"; echo "failed=$BB_FAILED skipped=$BB_SKIPPED"'
run -- bash -c "$steps" _ "$SCRIPTLIB"
want 0 '^a: PASS$' '^b: SKIP \(no tool\)$' '^c: FAIL \(broken\)$' '^failed=1 skipped=1$'
run -- bash -c 'source "$1"; bb_step b 77; echo "failed=$BB_FAILED"' _ "$SCRIPTLIB"
want 0 '^failed=0$'
run CI=true -- bash -c "$steps" _ "$SCRIPTLIB"
want 0 '^b: FAIL \(skipped: no tool; CI=true allows no skip\)$' '^failed=1 skipped=0$'

finish skips.sh
