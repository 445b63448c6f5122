#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/restart-crash.sh works: with --quick it fills a bufbrokerd --restart
# running under fakesd (systemd's stand-in) with 10 000 buffers, SIGKILLs
# it, and the restarted daemon restores every one of them from the fd
# store's bundles and the journal. Timings are never asserted (CI machines
# are shared and noisy); what is asserted is that the rows have numbers,
# that all 10 000 buffers came back, and that the store held bundles (one
# stored fd per 64 kept fds), not one fd per buffer.
#
# ctest sets BB_SOURCE_DIR, BB_BUILD_DIR and BB_FAKECUDA.
set -euo pipefail

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

[[ -n ${BB_SOURCE_DIR:-} && -n ${BB_BUILD_DIR:-} ]] || fail "BB_SOURCE_DIR and BB_BUILD_DIR must be set (ctest sets them)"
for f in bufbrokerd bufbroker-bench fakesd; do
	[[ -x $BB_BUILD_DIR/$f ]] || fail "$BB_BUILD_DIR/$f is not built"
done
[[ -n ${BB_FAKECUDA:-} && -f $BB_FAKECUDA ]] || fail "BB_FAKECUDA must name the fake driver (ctest sets it)"
export BUFBROKER_CUDA_LIBRARY=$BB_FAKECUDA FAKECUDA_NAMESPACE=bbt-restart-crash-$$

out=$(cd "$BB_SOURCE_DIR" && bench/restart-crash.sh --build-dir "$BB_BUILD_DIR" --quick 2>&1) ||
	fail "bench/restart-crash.sh failed: $out"
echo "$out"
ready=$(grep -E '^ +restart_ready: serving again after a SIGKILL, 10000 buffers +[0-9.]+ ms' <<<"$out") ||
	fail "no restart_ready row with a number"
[[ $ready == *"10000 of 10000 buffers restored"* ]] || fail "not every buffer was restored: $ready"
grep -qE '^ +restart_stall: .* +[0-9.]+ ms' <<<"$out" || fail "no restart_stall row with a number"
grep -q 'fakesd: main process [0-9]* killed by signal 9' <<<"$out" || fail "the daemon was not SIGKILLed"
started=$(grep -E 'fakesd: started .* \(start 2\) with [0-9]+ stored fds' <<<"$out") ||
	fail "fakesd did not start the daemon again"
stored=$(sed -E 's/.* with ([0-9]+) stored fds.*/\1/' <<<"$started")
# 10 000 host buffers: 157 bundles (two may be open), and the journal.
((stored >= 158 && stored <= 160)) || fail "the store held $stored fds, want the journal and 157 to 159 bundles"
grep -q 'event=restart_restored generation=2 buffers=10000 .*failed_missing=0' <<<"$out" ||
	fail "the daemon's restart_restored line is not a whole restore"
echo "restart_crash_quick: ok ($stored stored fds for 10000 buffers)"
