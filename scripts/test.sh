#!/usr/bin/env bash
# Install the build dependencies (Debian), build, and run the whole test
# suite twice: a RelWithDebInfo build, then an AddressSanitizer +
# UndefinedBehaviorSanitizer build; then fuzz the daemon's request path
# with libFuzzer for a bounded time when clang is present (tests/fuzz/run.sh);
# then the first build's integration tests under valgrind memcheck
# (scripts/valgrind.sh); then, as root, build, install and purge the Debian
# packages (scripts/package-test.sh); last, the formatting of every tracked
# .c and .h file against .clang-format (scripts/check-format.sh). Exits
# non-zero if anything fails. Under CI (CI=true) a missing clang-format
# fails the format step instead of skipping it.
#
# Usage: sudo ./scripts/test.sh        (root or sudo only to install packages)
# Build trees: build/, build-asan/, build-fuzz/ and build-pkg/
# (BUFBROKER_BUILD_DIR=DIR: DIR, DIR-asan, DIR-fuzz, DIR-pkg).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT"

bb_ensure_packages

declare -a summary=()
failed=0

# run_suite NAME DIR BUILD_TYPE [CMAKE_ARGS...]: build DIR and run its tests.
# Each step is checked explicitly: set -e does not apply inside a function
# called as a condition.
run_suite()
{
	local name="$1" dir="$2" type="$3"
	shift 3
	local -a runner=()
	local label="$name ($dir, $type${*:+ $*})"

	if ! bb_build "$dir" "$type" "$@"; then
		summary+=("$label: FAIL (build)")
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
	if ! "${runner[@]}" ctest --test-dir "$BB_ROOT/$dir" --output-on-failure --no-tests=error -j2; then
		summary+=("$label: FAIL (tests, see above)")
		return 1
	fi
	summary+=("$label: PASS")
}

if ! run_suite release "$BB_BUILD_DIR" RelWithDebInfo; then
	failed=1
fi

# Leaks, heap errors and undefined behaviour all fail the test that hits
# them: LeakSanitizer exits non-zero and ctest also matches the reports
# (FAIL_REGULAR_EXPRESSION in CMakeLists.txt). The caller's options win.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Debug: assertions on (NDEBUG off) and the clearest sanitizer reports.
if ! run_suite asan "$BB_BUILD_DIR-asan" Debug -DBB_SANITIZE=ON; then
	failed=1
fi

# The fuzz target under libFuzzer for a bounded time (tests/fuzz/run.sh;
# FUZZ_TIME seconds, default 60, on FUZZ_JOBS cores, default 2). A finding
# fails and is copied into tests/fuzz/regressions/ to be committed. Needs
# clang with its libFuzzer runtime; skipped without.
fuzz_label="fuzz ($BB_BUILD_DIR-fuzz, clang libFuzzer + ASan + UBSan, ${FUZZ_TIME:-60} s x ${FUZZ_JOBS:-2})"
if ! command -v clang >/dev/null 2>&1; then
	summary+=("$fuzz_label: SKIP (no clang)")
else
	fuzz_rc=0
	tests/fuzz/run.sh || fuzz_rc=$?
	case "$fuzz_rc" in
	0) summary+=("$fuzz_label: PASS") ;;
	77) summary+=("$fuzz_label: SKIP (see the SKIP line above)") ;;
	*)
		summary+=("$fuzz_label: FAIL (see above; commit what it put in tests/fuzz/regressions/)")
		failed=1
		;;
	esac
fi

# The integration tests under valgrind memcheck, every process they start
# traced (scripts/valgrind.sh), against the release build above.
vg_label="valgrind ($BB_BUILD_DIR, memcheck --trace-children=yes, integration tests)"
vg_rc=0
scripts/valgrind.sh "$BB_BUILD_DIR" || vg_rc=$?
case "$vg_rc" in
0) summary+=("$vg_label: PASS") ;;
77) summary+=("$vg_label: SKIP (valgrind is not installed)") ;;
*)
	summary+=("$vg_label: FAIL (see above)")
	failed=1
	;;
esac

# The Debian packages: build, dpkg -i, serve, build the examples against
# them, purge (scripts/package-test.sh). Root only: it installs packages.
pkg_label="packages ($BB_BUILD_DIR-pkg, cpack -G DEB, dpkg -i/--purge)"
if [ "$(id -u)" -ne 0 ]; then
	summary+=("$pkg_label: SKIP (needs root; run: sudo scripts/package-test.sh)")
else
	pkg_rc=0
	scripts/package-test.sh || pkg_rc=$?
	case "$pkg_rc" in
	0) summary+=("$pkg_label: PASS") ;;
	77) summary+=("$pkg_label: SKIP (see the SKIP line above)") ;;
	*)
		summary+=("$pkg_label: FAIL (see above)")
		failed=1
		;;
	esac
fi

# Every tracked .c and .h file formatted as .clang-format says, by the
# clang-format version it names (scripts/check-format.sh). Without that
# clang-format: a skip on a developer's machine, a failure under CI.
fmt_label="format (clang-format, .clang-format, every tracked .c and .h)"
fmt_rc=0
scripts/check-format.sh || fmt_rc=$?
case "$fmt_rc" in
0) summary+=("$fmt_label: PASS") ;;
77)
	if bb_ci; then
		summary+=("$fmt_label: FAIL (clang-format is missing and CI is set)")
		failed=1
	else
		summary+=("$fmt_label: SKIP (see the SKIP line above)")
	fi
	;;
*)
	summary+=("$fmt_label: FAIL (see above; scripts/check-format.sh --fix formats in place)")
	failed=1
	;;
esac

echo
for line in "${summary[@]}"; do
	printf '==> %s\n' "$line"
done
exit "$failed"
