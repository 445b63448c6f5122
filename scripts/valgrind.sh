#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run the integration tests under valgrind memcheck, following every process
# they start (--trace-children=yes): the test runners, their forked client
# children and the bufbrokerd daemons the harness execs, and the CLI. Any
# memory error or leak in any of them fails the run; so does a test that
# fails.
#
# Usage: scripts/valgrind.sh [BUILD_DIR]   (default: build/, a non-sanitized
#        tree that scripts/test.sh or bb_build has built)
# Environment: BB_VALGRIND_TESTS="api faults ..." to pick the test programs
#        (tests/integration/test_NAME.c; NAME_vmm runs test_NAME with VMM
#        CUDA buffers as the daemons' default, as ctest's *_vmm tests do), BB_VALGRIND_JOBS (default 2) test
#        programs at once, BB_VALGRIND_LOGS=DIR to keep the logs there.
# Exits 0 when clean, 1 when not, 77 when valgrind is not installed or when
# a test program was clean but skipped some of its tests (it exited 77:
# tests/criterion_main.c; under CI=true such a program fails instead).
set -uo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT" || exit 1

build="${1:-$BB_BUILD_DIR}"
case "$build" in
/*) ;;
*) build="$BB_ROOT/$build" ;;
esac
tests="${BB_VALGRIND_TESTS:-api admin cuda cuda_vmm vmm_wire badinput faults soak restart fakesd restart_chaos restart_torn resume upgrade}"
jobs="${BB_VALGRIND_JOBS:-2}"

if ! command -v valgrind >/dev/null 2>&1; then
	echo "SKIP: valgrind is not installed (apt-get install valgrind)"
	exit 77
fi
for t in $tests; do
	if [ ! -x "$build/integ_test_${t%_vmm}" ]; then
		echo "error: $build/integ_test_${t%_vmm} is missing: build $build first" >&2
		exit 1
	fi
done

logs="${BB_VALGRIND_LOGS:-}"
if [ -z "$logs" ]; then
	logs="$(mktemp -d /tmp/bb-valgrind.XXXXXX)"
	trap 'rm -rf "$logs"' EXIT
fi
mkdir -p "$logs"
# Tests switch some children to another uid (nobody) before they exec the
# CLI: it must be able to create its log here. (%n in the log names: after
# such an exec the process's pid is the same, but the log its root-owned
# fork opened is not writable to it; %n moves on to a new name.)
chmod 1777 "$logs"

# What ctest gives the integration tests (CMakeLists.txt), plus BBT_SLOW:
# the harness stretches its timeouts by this factor.
export BUFBROKERD="$build/bufbrokerd"
export BUFBROKER_CLI="$build/bufbroker"
export BB_PRODUCER="$build/bb-producer"
export BB_CONSUMER="$build/bb-consumer"
export BUFBROKERD_CONFIG=/dev/null
export BB_FAKECUDA="$build/libfakecuda.so"
export BB_FAKECUDA_NOVMM="$build/libfakecuda_novmm.so"
export BBT_SLOW="${BBT_SLOW:-20}"
export BBT_VALGRIND=1
# The soak test: a few short rounds of a few clients.
export BBT_SOAK_ROUNDS="${BBT_SOAK_ROUNDS:-3}"
export BBT_SOAK_CLIENTS="${BBT_SOAK_CLIENTS:-3}"
# The restart tests: a few disruptions of a few clients, a few torn
# journals. fakesd (the systemd stand-in) runs traced too, so that the
# daemons it starts are.
export BB_FAKESD="$build/fakesd"
export BB_FAKESD_TOY="$build/fakesd_toy"
export BBT_CHAOS_ROUNDS="${BBT_CHAOS_ROUNDS:-3}"
export BBT_CHAOS_CLIENTS="${BBT_CHAOS_CLIENTS:-4}"
export BBT_TORN_ROUNDS="${BBT_TORN_ROUNDS:-3}"

# --error-exitcode: a process with an error exits 99, so a test child or a
# daemon stopped with SIGTERM fails its test by itself. Processes that die of
# SIGKILL (on purpose) never get to their summary; the log scan below
# catches what they reported before.
# shellcheck disable=SC2054 # the commas belong to valgrind's option values
vg=(valgrind --tool=memcheck --trace-children=yes --leak-check=full
	--show-leak-kinds=definite,indirect,possible --errors-for-leak-kinds=definite,indirect,possible
	--error-exitcode=99 --num-callers=30 --vgdb=no
	--suppressions="$BB_ROOT/tests/valgrind.supp"
	--trace-children-skip='*/sh,*/bash,*/dash,*/python*,*/env,*/setarch')

run_one()
{
	local t="$1" start rc handle=
	start=$(date +%s)
	[ "$t" != "${t%_vmm}" ] && handle=vmm
	BBT_CUDA_HANDLE=$handle "${vg[@]}" --log-file="$logs/$t.%p.%n.log" \
		"$build/integ_test_${t%_vmm}" --jobs 1 >"$logs/$t.out" 2>&1
	rc=$?
	echo "$rc $(($(date +%s) - start))" >"$logs/$t.rc"
}

bb_log "valgrind: ${tests} (logs in $logs, BBT_SLOW=$BBT_SLOW)"
running=0
for t in $tests; do
	run_one "$t" &
	running=$((running + 1))
	if [ "$running" -ge "$jobs" ]; then
		wait -n
		running=$((running - 1))
	fi
done
wait

failed=0
skipped=0
for t in $tests; do
	rc=1 secs='?'
	[ -r "$logs/$t.rc" ] && read -r rc secs <"$logs/$t.rc"
	# Errors in any process of this test program: a non-zero ERROR SUMMARY,
	# or an error reported by a process that was killed before its summary.
	bad=$(grep -lE 'ERROR SUMMARY: [1-9]|^==[0-9]+== (Invalid (read|write|free)|Mismatched free|Conditional jump|Use of uninitialised|Syscall param|Source and destination overlap|Jump to the invalid address|Argument .* of function .* has a fishy)' \
		"$logs/$t".*.log 2>/dev/null)
	if [ "$rc" -eq 77 ] && [ -z "$bad" ]; then
		skipped=1
		echo "---- integ_test_$t: clean, but not every test ran (${secs}s):"
		grep -E '^SKIP' "$logs/$t.out"
	elif [ "$rc" -ne 0 ] || [ -n "$bad" ]; then
		failed=1
		echo "---- integ_test_$t: FAIL (exit $rc, ${secs}s)"
		grep -E '^\[(FAIL|----)\]|^(FAIL|SKIP): |Synthesis' "$logs/$t.out" | tail -n 40
		for f in $bad; do
			echo "---- $f"
			grep -E '^==[0-9]+== (Command:|Parent PID:)' "$f"
			# Read whole, then cut: head on the pipe would SIGPIPE sed.
			errors=$(sed -n '/^==[0-9]*== \(Invalid\|Mismatched\|Conditional\|Use of\|Syscall\|Source and\|Jump to\|Argument\|.* are \(definitely\|indirectly\|possibly\) lost\)/,/^==[0-9]*== $/p' "$f")
			head -n 80 <<<"$errors"
		done
	else
		nlogs=$(find "$logs" -maxdepth 1 -name "$t.*.log" | wc -l)
		echo "---- integ_test_$t: clean (${secs}s, $nlogs processes)"
	fi
done
if [ "$failed" -eq 0 ] && [ "$skipped" -eq 1 ]; then
	echo "SKIP: valgrind: some tests skipped themselves (named above)"
	exit 77
fi
exit "$failed"
