#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The producer/consumer examples and the bufbroker CLI (status, ls, stat, and
# their --json forms) against a real bufbrokerd; SIGTERM must end it with 0.
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER and BB_CONSUMER.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test examples
need_vars -x "an executable" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_CONSUMER
find_python "check the JSON output"

# Check a JSON document on stdin with a Python expression over `d`.
json_check() {
	local what=$1 expr=$2 doc
	doc=$(cat)
	printf '%s' "$doc" | "$PY" -m json.tool >/dev/null 2>&1 || fail "$what: not valid JSON: $doc"
	printf '%s' "$doc" | "$PY" -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if ($expr) else 1)" ||
		fail "$what: JSON does not satisfy '$expr': $doc"
}

STEP="start the daemon"
start_bufbrokerd --socket "$SOCK" --token-ttl 120000

STEP="status"
out=$(cli status) || fail "bufbroker status exited $?"
grep -Eq "^pid +$DPID\$" <<<"$out" || fail "status does not show the daemon's pid $DPID: $out"
grep -qi "version" <<<"$out" || fail "status does not show a version: $out"
cli --json status | json_check "status --json" \
	"d['pid'] == $DPID and d['connections'] >= 1 and d['kinds']['host']['buffers'] == 0 and 'version' in d and 'uptime_ms' in d and 'tokens' in d"
BUFBROKER_SOCKET=$SOCK timeout 10 "$BUFBROKER_CLI" --json status | json_check "status via \$BUFBROKER_SOCKET" "d['pid'] == $DPID"

STEP="producer"
tok=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-example --size 65536 --pattern 7) ||
	fail "bb-producer exited $?"
[[ $tok =~ ^[0-9a-f]{32}$ ]] || fail "bb-producer printed '$tok', not a 32-hex-digit token"

STEP="ls"
out=$(cli ls)
grep -q "bbt-example" <<<"$out" || fail "ls does not list bbt-example: $out"
cli --json ls | json_check "ls --json" \
	"[b['name'] for b in d['buffers']] == ['bbt-example'] and d['buffers'][0]['size'] == 65536 and d['buffers'][0]['refs'] == 1 and d['buffers'][0]['tokens'] == 1"

STEP="stat"
out=$(cli stat bbt-example)
grep -q "bbt-example" <<<"$out" || fail "stat NAME does not show the name: $out"
grep -qi "ready" <<<"$out" || fail "stat NAME does not show the state READY: $out"
cli --json stat bbt-example | json_check "stat --json NAME" \
	"d['name'] == 'bbt-example' and d['size'] == 65536 and d['state'].lower() == 'ready' and d['refs'] == 1 and d['tokens'] == 1 and d['kind'].lower() == 'host'"
id=$(cli --json stat --name bbt-example | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["id"])')
cli --json stat "$id" | json_check "stat --json ID" "d['id'] == $id and d['name'] == 'bbt-example'"
cli --json stat --id "$id" | json_check "stat --json --id ID" "d['id'] == $id"

STEP="consumer"
out=$(timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size 65536 --pattern 7 "$tok") ||
	fail "bb-consumer exited $? for a good token"
grep -q "verified 65536 bytes" <<<"$out" || fail "bb-consumer did not verify the bytes: $out"

STEP="the adopted buffer is freed"
rc=0
cli stat bbt-example >/dev/null 2>"$DIR/err" || rc=$?
[[ $rc -eq 4 ]] || fail "stat of a freed buffer exited $rc, want 4 (not found)"
[[ -s $DIR/err ]] || fail "stat of a freed buffer printed no error"
cli --json ls | json_check "ls --json after the consumer" "d['buffers'] == []"
cli --json status | json_check "status --json after the consumer" "d['kinds']['host']['buffers'] == 0 and d['tokens'] == 0"

STEP="a token works once"
rc=0
timeout 10 "$BB_CONSUMER" --socket "$SOCK" "$tok" >/dev/null 2>&1 || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "a second bb-consumer with the same token exited $rc"

STEP="consumer sees a wrong pattern"
tok=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-pattern --size 4096 --pattern 3)
rc=0
timeout 10 "$BB_CONSUMER" --socket "$SOCK" --pattern 4 "$tok" >/dev/null 2>"$DIR/err" || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "bb-consumer accepted the wrong pattern (exit $rc)"
grep -qi "mismatch" "$DIR/err" || fail "bb-consumer did not report a mismatch: $(cat "$DIR/err")"

STEP="consumer by name"
tok=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-byname --size 8192 --pattern 9)
out=$(timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size 8192 --pattern 9 --name bbt-byname) ||
	fail "bb-consumer --name exited $?"
grep -q "verified 8192 bytes" <<<"$out" || fail "bb-consumer --name: $out"
cli --json stat bbt-byname | json_check "stat after consumer --name" "d['refs'] == 1 and d['tokens'] == 1"

STEP="CLI errors"
rc=0 rc2=0
cli bogus-command >/dev/null 2>&1 || rc=$?
timeout 10 "$BUFBROKER_CLI" --socket "$DIR/missing.sock" status >/dev/null 2>&1 || rc2=$?
[[ $rc -eq 2 ]] || fail "an unknown command exited $rc, want 2"
[[ $rc2 -eq 3 ]] || fail "status on a missing socket exited $rc2, want 3 (unreachable)"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM with a live token, want 0"
echo "examples.sh: all checks passed"
