#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the build dependencies (Debian), build, and run the whole test
# suite twice: a RelWithDebInfo build, then an AddressSanitizer +
# UndefinedBehaviorSanitizer build; then fuzz the daemon's request path
# with libFuzzer for a bounded time when clang is present (tests/fuzz/run.sh);
# then the first build's integration tests under valgrind memcheck
# (scripts/valgrind.sh); then, as root, build, lint (lintian, hardening),
# install and purge the Debian packages (scripts/package-test.sh); then the
# systemd units (scripts/check-units.sh) and the Kubernetes manifests
# (scripts/check-manifests.py); last, the formatting of every tracked .c and
# .h file against .clang-format (scripts/check-format.sh) and the license
# header of every source file (scripts/spdx.sh). Exits non-zero if anything
# fails.
#
# A step that cannot run here (no clang, no valgrind, not root, packages of
# ours already installed, no clang-format), and a suite in which ctest
# reports a test as Skipped, is SKIP in the summary, never PASS. Under CI
# (CI=true, 1 or yes) nothing may skip: every such skip is a FAIL, and the
# test programs themselves fail instead of skipping.
#
# Usage: ./scripts/test.sh    (as any user: as root it installs missing
#        packages itself, as another user through sudo, asked only then;
#        the parts that need root say SKIP unless run as root)
# Build trees: build/, build-asan/, build-fuzz/ and build-pkg/
# (BUFBROKER_BUILD_DIR=DIR: DIR, DIR-asan, DIR-fuzz, DIR-pkg).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT"

bb_ensure_packages

# run_suite NAME DIR BUILD_TYPE [CMAKE_ARGS...]: build DIR and run its tests;
# its summary line (bb_step) says SKIP, not PASS, when ctest skipped a test.
# Each step is checked explicitly: set -e does not apply inside a function
# called as a condition.
run_suite()
{
	local name="$1" dir="$2" type="$3"
	shift 3
	local -a runner=() skipped=()
	local label="$name ($dir, $type${*:+ $*})" out rc

	if ! bb_build "$dir" "$type" "$@"; then
		bb_step "$label" 1 build
		return 1
	fi
	if [ "$name" = asan ]; then
		# gcc 12's ASan cannot map its shadow memory with more than 28 bits
		# of mmap randomization (newer kernels default to 32): run without
		# ASLR then, when this environment allows it.
		local bits
		bits="$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0)"
		if [ "$bits" -gt 28 ]; then
			if setarch "$(uname -m)" -R true 2>/dev/null; then
				runner=(setarch "$(uname -m)" -R)
			else
				bb_warn "vm.mmap_rnd_bits=$bits may break ASan; try: sysctl vm.mmap_rnd_bits=28"
			fi
		fi
	fi
	bb_log "testing $dir"
	out="$BB_ROOT/$dir/ctest-output.txt"
	"${runner[@]}" ctest --test-dir "$BB_ROOT/$dir" --output-on-failure --no-tests=error -j2 |
		tee "$out"
	rc=${PIPESTATUS[0]}
	if [ "$rc" -ne 0 ]; then
		bb_step "$label" "$rc" "tests, see above"
		return 1
	fi
	mapfile -t skipped < <(bb_ctest_skipped "$out")
	if [ "${#skipped[@]}" -gt 0 ]; then
		# ctest shows no output of a skipped test: its reasons are in the log.
		grep -h '^SKIP' "$BB_ROOT/$dir/Testing/Temporary/LastTest.log" || true
		bb_step "$label" 77 "" "${#skipped[@]} test(s) skipped: ${skipped[*]}"
		return 0
	fi
	bb_step "$label" 0
}

run_suite release "$BB_BUILD_DIR" RelWithDebInfo || true

# Leaks, heap errors and undefined behaviour all fail the test that hits
# them: LeakSanitizer exits non-zero and ctest also matches the reports
# (FAIL_REGULAR_EXPRESSION in CMakeLists.txt). The caller's options win.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Debug: assertions on (NDEBUG off) and the clearest sanitizer reports.
run_suite asan "$BB_BUILD_DIR-asan" Debug -DBB_SANITIZE=ON || true

# The fuzz target under libFuzzer for a bounded time (tests/fuzz/run.sh;
# FUZZ_TIME seconds, default 60, on FUZZ_JOBS cores, default 2). A finding
# fails and is copied into tests/fuzz/regressions/ to be committed. Needs
# clang with its libFuzzer runtime; skipped without (a failure under CI).
fuzz_label="fuzz ($BB_BUILD_DIR-fuzz, clang libFuzzer + ASan + UBSan, ${FUZZ_TIME:-60} s x ${FUZZ_JOBS:-2})"
if ! command -v clang >/dev/null 2>&1; then
	bb_step "$fuzz_label" 77 "" "no clang"
else
	fuzz_rc=0
	tests/fuzz/run.sh || fuzz_rc=$?
	bb_step "$fuzz_label" "$fuzz_rc" "see above; commit what it put in tests/fuzz/regressions/"
fi

# The integration tests under valgrind memcheck, every process they start
# traced (scripts/valgrind.sh), against the release build above. It skips
# (77) without valgrind, or when a test program skipped some of its tests.
vg_label="valgrind ($BB_BUILD_DIR, memcheck --trace-children=yes, integration tests)"
vg_rc=0
scripts/valgrind.sh "$BB_BUILD_DIR" || vg_rc=$?
bb_step "$vg_label" "$vg_rc"

# The Debian packages: build, dpkg -i, serve, build the examples against
# them, purge (scripts/package-test.sh). Root only: it installs packages.
pkg_label="packages ($BB_BUILD_DIR-pkg, dpkg-buildpackage, lintian, hardening, dpkg -i/--purge)"
if [ "$(id -u)" -ne 0 ]; then
	bb_step "$pkg_label" 77 "" "needs root; run: sudo scripts/package-test.sh"
else
	pkg_rc=0
	scripts/package-test.sh || pkg_rc=$?
	bb_step "$pkg_label" "$pkg_rc"
fi

# The systemd units: `systemd-analyze verify` finds nothing to say, and
# `systemd-analyze security` rates the service 2.0 or lower
# (scripts/check-units.sh, against the release build's daemon).
units_label="units (systemd-analyze verify; security of bufbrokerd.service at most 2.0)"
units_rc=0
scripts/check-units.sh "$BB_BUILD_DIR/bufbrokerd" || units_rc=$?
bb_step "$units_label" "$units_rc"

# The Kubernetes manifests (deploy/kubernetes): YAML as yamllint wants it,
# valid for the Kubernetes API schema offline (Debian's python3-kubernetes)
# and within the pod rules the examples promise (scripts/check-manifests.py).
k8s_label="manifests (deploy/kubernetes: yamllint, Kubernetes API schema, pod rules)"
if ! command -v yamllint >/dev/null 2>&1 ||
	! /usr/bin/python3 -c 'import kubernetes, yaml' 2>/dev/null; then
	echo "SKIP: yamllint or python3-kubernetes is not installed"
	bb_step "$k8s_label" 77 "" "yamllint or python3-kubernetes missing"
else
	k8s_rc=0
	yamllint -s deploy/kubernetes || k8s_rc=$?
	scripts/check-manifests.py deploy/kubernetes/*.yaml || k8s_rc=1
	bb_step "$k8s_label" "$k8s_rc"
fi

# Every tracked .c and .h file formatted as .clang-format says, by the
# clang-format version it names (scripts/check-format.sh). Without that
# clang-format: a skip on a developer's machine, a failure under CI.
fmt_label="format (clang-format, .clang-format, every tracked .c and .h)"
fmt_rc=0
scripts/check-format.sh || fmt_rc=$?
bb_step "$fmt_label" "$fmt_rc" "see above; scripts/check-format.sh --fix formats in place"

# Every source file carries the SPDX line of LICENSE (scripts/spdx.sh).
spdx_label="license headers (SPDX-License-Identifier: Apache-2.0, every source file)"
spdx_rc=0
scripts/spdx.sh --check || spdx_rc=$?
bb_step "$spdx_label" "$spdx_rc" "see above; scripts/spdx.sh --fix adds them"

echo
for line in "${BB_SUMMARY[@]}"; do
	printf '==> %s\n' "$line"
done
if [ "$BB_FAILED" -eq 0 ] && [ "$BB_SKIPPED" -eq 1 ]; then
	printf '==> not a full run: what says SKIP did not run here (under CI=true a skip fails)\n'
fi
exit "$BB_FAILED"
