#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python binding (python/bufbroker): its pytest suite, with Debian's
# /usr/bin/python3, against real daemons it starts itself; then the Python
# example pair and its pairings with the C examples through one daemon here,
# which SIGTERM must end with 0.
#
# A test that pytest skipped makes this test skip (lib.sh's skip_part: exit
# 77 at the end, a failure under CI).
#
# ctest sets BUFBROKERD, BB_PRODUCER, BB_CONSUMER, BB_SOURCE_DIR, BB_BUILD_DIR
# and BB_FAKECUDA (libfakecuda.so: the CUDA tests use it when set).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test python
need_vars -x "an executable" BUFBROKERD BB_PRODUCER BB_CONSUMER
need_vars -d "a directory" BB_SOURCE_DIR BB_BUILD_DIR
PY=/usr/bin/python3
[[ -x $PY ]] || fail "$PY is missing: apt-get install python3 python3-pytest python3-numpy"
"$PY" -c 'import pytest, numpy' 2>/dev/null ||
	fail "python3-pytest and python3-numpy are needed: apt-get install python3-pytest python3-numpy (scripts/lib.sh lists them)"

export PYTHONPATH=$BB_SOURCE_DIR/python${PYTHONPATH:+:$PYTHONPATH}
export BUFBROKER_LIBRARY=$BB_BUILD_DIR/libbufbroker.so.0
export PYTHONDONTWRITEBYTECODE=1 # keep the source tree clean
unset BUFBROKER_SOCKET
[[ -f $BUFBROKER_LIBRARY ]] || fail "no $BUFBROKER_LIBRARY"

# A sanitizer build's library needs its runtime loaded first; Python's own
# allocations are not ours to leak-check.
# (ldd's output whole first: awk's exit would SIGPIPE it, and pipefail fail
# the assignment.)
libs=$(ldd "$BUFBROKER_LIBRARY")
asan=$(awk '/libasan\.so/ { print $3; exit }' <<<"$libs")
if [[ -n $asan ]]; then
	export LD_PRELOAD=$asan${LD_PRELOAD:+:$LD_PRELOAD}
	# Last wins: the interpreter's own allocations are not ours to report.
	export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
fi

STEP="pytest"
cd "$BB_SOURCE_DIR"
"$PY" -m pytest -q -p no:cacheprovider -rs python/tests | tee "$DIR/pytest.out" ||
	fail "pytest failed"
# A test pytest skipped did not pass: the whole test skips (exit 77 at the
# end), and under CI it fails.
nskip=$(sed -En 's/^(|.* )([0-9]+) skipped.*/\2/p' "$DIR/pytest.out" | tail -n 1)
[[ -z $nskip ]] || skip_part "pytest skipped $nskip test(s): its SKIPPED lines above say why"

# The daemon the example pairs share; it is ASan-checked like the others
# when it is a sanitizer build, so it must not inherit the preload.
unset LD_PRELOAD ASAN_OPTIONS
STEP="start the daemon"
start_bufbrokerd --socket "$SOCK" --token-ttl 120000
if [[ -n $asan ]]; then
	export LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0
fi

PYPROD=("$PY" "$BB_SOURCE_DIR/examples/python/producer.py")
PYCONS=("$PY" "$BB_SOURCE_DIR/examples/python/consumer.py")

# pair NAME PRODUCER... -- CONSUMER...: a token and then a name, 64 KiB,
# pattern 7, through the shared daemon.
pair() {
	local name=$1 tok out
	shift
	local -a prod=() cons=()
	while [[ $1 != -- ]]; do prod+=("$1"); shift; done
	shift
	cons=("$@")
	STEP="$name: by token"
	tok=$(timeout 30 "${prod[@]}" --socket "$SOCK" --name "bbt-$name" --size 65536 --pattern 7) ||
		fail "the producer exited $?"
	[[ $tok =~ ^[0-9a-f]{32}$ ]] || fail "the producer printed '$tok', not a token"
	out=$(timeout 30 "${cons[@]}" --socket "$SOCK" --size 65536 --pattern 7 "$tok") ||
		fail "the consumer exited $?"
	grep -q "verified 65536 bytes" <<<"$out" || fail "the consumer did not verify: $out"
	STEP="$name: by name"
	tok=$(timeout 30 "${prod[@]}" --socket "$SOCK" --name "bbt-$name-n" --size 8192 --pattern 9)
	out=$(timeout 30 "${cons[@]}" --socket "$SOCK" --size 8192 --pattern 9 --name "bbt-$name-n") ||
		fail "the consumer --name exited $?"
	grep -q "verified 8192 bytes" <<<"$out" || fail "the consumer --name did not verify: $out"
	out=$(timeout 30 "${cons[@]}" --socket "$SOCK" --pattern 9 "$tok") || fail "adopting the by-name token exited $?"
	STEP="$name: wrong pattern"
	tok=$(timeout 30 "${prod[@]}" --socket "$SOCK" --name "bbt-$name-w" --size 4096 --pattern 3)
	rc=0
	timeout 30 "${cons[@]}" --socket "$SOCK" --pattern 4 "$tok" >/dev/null 2>"$DIR/err" || rc=$?
	[[ $rc -eq 1 ]] || fail "the consumer exited $rc for a wrong pattern, want 1"
	grep -qi "mismatch" "$DIR/err" || fail "no mismatch reported: $(cat "$DIR/err")"
}

pair py-py "${PYPROD[@]}" -- "${PYCONS[@]}"
pair c-py "$BB_PRODUCER" -- "${PYCONS[@]}"
pair py-c "${PYPROD[@]}" -- "$BB_CONSUMER"

STEP="nothing left behind"
# Every token was adopted and every consumer is gone: no buffers remain.
"$PY" - "$SOCK" <<'PYEOF' || fail "buffers were left behind"
import sys, bufbroker
with bufbroker.Client(sys.argv[1]) as c:
    for id_ in range(1, 64):
        try:
            info = c.stat(id_)
        except bufbroker.NotFound:
            continue
        sys.exit(f"buffer {id_} is still alive: {info}")
PYEOF

STEP="SIGTERM"
unset LD_PRELOAD ASAN_OPTIONS
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"
grep -Eq "Sanitizer|runtime error:" "$LOG" && fail "the daemon's log has a sanitizer report"
finish python.sh
