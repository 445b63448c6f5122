#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The example monitoring in deploy/: the Prometheus alert rules pass
# `promtool check rules` and their unit tests (`promtool test rules`); the
# Grafana dashboard is valid JSON with a query in every panel; and every
# metric name the rules and the dashboard use is one a live bufbrokerd
# serves (read crudely from their expressions), every limit label value one
# it counts.
#
# ctest sets BUFBROKERD and BB_SOURCE_DIR. promtool is Debian's prometheus
# package (scripts/lib.sh installs it).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test monitoring
need_vars -x "an executable" BUFBROKERD
need_vars -d "a directory" BB_SOURCE_DIR
command -v curl >/dev/null || fail "curl is needed (apt-get install curl)"
command -v promtool >/dev/null || fail "promtool is needed (apt-get install prometheus)"
find_python "read the dashboard's JSON"
RULES=$BB_SOURCE_DIR/deploy/prometheus/bufbroker-rules.yml
RULES_TEST=$BB_SOURCE_DIR/deploy/prometheus/bufbroker-rules.test.yml
DASHBOARD=$BB_SOURCE_DIR/deploy/grafana/bufbroker.json

STEP="promtool check rules"
promtool check rules "$RULES" >"$DIR/out" 2>&1 || fail "$(cat "$DIR/out")"

STEP="promtool test rules"
# rule_files in the test are relative to its directory.
(cd "$(dirname "$RULES_TEST")" && promtool test rules "$(basename "$RULES_TEST")") >"$DIR/out" 2>&1 ||
	fail "$(cat "$DIR/out")"
# Every alert of the rules has a test that expects it to fire.
grep -o '^ *- alert: [A-Za-z]*' "$RULES" | awk '{ print $3 }' | sort >"$DIR/alerts"
awk '/^ *alertname: / { a = $2 } /^ *exp_alerts:$/ { print a }' "$RULES_TEST" | sort -u >"$DIR/fired"
comm -23 "$DIR/alerts" "$DIR/fired" >"$DIR/untested"
[[ ! -s $DIR/untested ]] || fail "alerts no test expects to fire: $(tr '\n' ' ' <"$DIR/untested")"

STEP="the dashboard's JSON"
# One expression a line: the panels' queries and the template variables'.
"$PY" - "$DASHBOARD" >"$DIR/dashboard.exprs" <<'PYEOF' || fail "the dashboard is not what Grafana reads"
import json, sys
d = json.load(open(sys.argv[1]))
assert d.get("title") and d.get("uid"), "no title or uid"
ids = set()
for p in d["panels"]:
    assert p["id"] not in ids, "panel id %s twice" % p["id"]
    ids.add(p["id"])
    if p["type"] == "row":
        continue
    assert p.get("title") and p.get("datasource"), "panel %s has no title or datasource" % p["id"]
    assert p.get("targets"), "panel %r has no query" % p["title"]
    for t in p["targets"]:
        assert t.get("expr"), "panel %r has an empty query" % p["title"]
        print(t["expr"])
for v in d["templating"]["list"]:
    q = v.get("query")
    if isinstance(q, dict):
        print(q["query"])
PYEOF
[[ $(wc -l <"$DIR/dashboard.exprs") -ge 10 ]] || fail "the dashboard has fewer than 10 queries"

STEP="a live daemon's metrics"
NOCONF=$DIR/empty.conf
: >"$NOCONF"
start_bufbrokerd --config "$NOCONF" --socket "$SOCK" --no-cuda --metrics-listen 127.0.0.1:0
wait_socket bufbrokerd "event=metrics_listening"
PORT=$(sed -n 's/.*event=metrics_listening address=127\.0\.0\.1:\([0-9]*\).*/\1/p' "$LOG")
[[ $PORT =~ ^[0-9]+$ ]] || fail "no metrics_listening line"
curl -sS --max-time 5 "http://127.0.0.1:$PORT/metrics" >"$DIR/scrape" || fail "curl could not scrape"
# The names a query may use: each family's, and a histogram's series.
awk '/^# TYPE / { print $3; if ($4 == "histogram") print $3 "_bucket\n" $3 "_sum\n" $3 "_count" }' \
	"$DIR/scrape" | sort -u >"$DIR/served"
sed -n 's/^bufbroker_refused_total{limit="\([^"]*\)"}.*/\1/p' "$DIR/scrape" | sort -u >"$DIR/limits"
[[ -s $DIR/limits ]] || fail "no bufbroker_refused_total series"

STEP="the names the rules and the dashboard use"
# The rules' expressions, one a line.
sed -n 's/^ *expr: //p' "$RULES" >"$DIR/rules.exprs"
for src in rules dashboard; do
	# Crudely: every word that begins as the daemon's metrics do. `up` is
	# Prometheus's own (a scrape that failed).
	grep -oE '\b(bufbroker|process)_[a-z_]+' "$DIR/$src.exprs" | sort -u >"$DIR/$src.names"
	[[ -s $DIR/$src.names ]] || fail "no metric names found in the $src"
	comm -23 "$DIR/$src.names" "$DIR/served" >"$DIR/unknown"
	[[ ! -s $DIR/unknown ]] || fail "$src: names the daemon does not serve: $(tr '\n' ' ' <"$DIR/unknown")"
	grep -oE 'limit!?=~?"[a-z_]+"' "$DIR/$src.exprs" | sed 's/.*"\(.*\)"/\1/' | sort -u >"$DIR/$src.limits" || true
	comm -23 "$DIR/$src.limits" "$DIR/limits" >"$DIR/unknown"
	[[ ! -s $DIR/unknown ]] || fail "$src: limit values the daemon does not count: $(tr '\n' ' ' <"$DIR/unknown")"
done
grep -vE '\b(bufbroker|process)_[a-z_]+' "$DIR/rules.exprs" >"$DIR/other" || true
grep -vE '^up\{job="bufbroker"\} == 0$' "$DIR/other" >"$DIR/unknown" || true
[[ ! -s $DIR/unknown ]] || fail "rules on no metric of the daemon's: $(cat "$DIR/unknown")"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM"
finish monitoring.sh
