#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Prometheus endpoint (--metrics-listen), scraped with curl after a known
# workload: the counters and gauges must show exactly what was done; the
# exposition passes `promtool check metrics`; the process metrics have the
# names, types and values Prometheus's client libraries give them; other
# paths get 404; a port in use or a bad address stops the daemon from
# starting; SIGTERM with the endpoint running ends the daemon with 0 (and,
# in a sanitizer build, with no report).
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER and BB_CONSUMER, and BB_FAKECUDA,
# BB_SOURCE_DIR and BB_BUILD_DIR for the CUDA device check (fake driver, Python client:
# Debian's /usr/bin/python3). Without them, or without an IPv6 loopback, that part is
# skipped and the test skips (exit 77; a failure under CI).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test metrics
need_vars -x "an executable" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_CONSUMER
command -v curl >/dev/null || fail "curl is needed (apt-get install curl)"
command -v promtool >/dev/null || fail "promtool is needed (apt-get install prometheus)"

UID_NOW=$(id -u)
# Nothing from /etc/bufbroker may change the limits under test.
NOCONF=$DIR/empty.conf
: >"$NOCONF"

# Start a daemon with the given flags, logging to $1; wait for its socket and
# its metrics_listening line. Sets DPID and PORT.
start_daemon() {
	local log=$1
	shift
	"$BUFBROKERD" --config "$NOCONF" --socket "$SOCK" --no-cuda "$@" >"$log" 2>&1 &
	DPID=$!
	LOG=$log wait_socket bufbrokerd "event=metrics_listening"
	PORT=$(sed -n 's/.*event=metrics_listening address=127\.0\.0\.1:\([0-9]*\).*/\1/p' "$log")
	[[ $PORT =~ ^[0-9]+$ && $PORT -gt 0 ]] || fail "no metrics_listening line with a port in the log"
}

# stop_daemon: SIGTERM must end the daemon with 0 (fail shows $LOG).
stop_daemon() {
	sigterm_daemon
	[[ $DAEMON_RC -eq 0 ]] ||
		fail "bufbrokerd exited $DAEMON_RC after SIGTERM with the metrics endpoint running, want 0"
}

SCRAPE=
scrape() {
	SCRAPE=$(curl -sS --max-time 5 -D "$DIR/headers" "http://127.0.0.1:$PORT/metrics") ||
		fail "curl could not scrape /metrics"
	grep -q "^HTTP/1.1 200" "$DIR/headers" || fail "GET /metrics: $(head -1 "$DIR/headers")"
}

# The value of one series (the exact text before the value), or "absent".
value() {
	awk -v k="$1" '$1 == k { print $2; found = 1 } END { if (!found) print "absent" }' <<<"$SCRAPE"
}

# expect SERIES WANT: the series has exactly this value. A counter series
# that was never incremented is absent and reads as 0.
expect() {
	local got
	got=$(value "$1")
	[[ $got == absent && $1 == *_total* ]] && got=0
	[[ $got == "$2" ]] || fail "$1 is $got, want $2"
}

# Sum of every requests_total series of one op.
op_total() {
	awk -v p="bufbroker_requests_total{op=\"$1\"," 'index($1, p) == 1 { s += $2 } END { print s + 0 }' <<<"$SCRAPE"
}

# gt A B / ge A B: A > B, A >= B, of decimal numbers (B may be "N - M").
gt() { awk "BEGIN { exit !($1 > $2) }"; }
ge() { awk "BEGIN { exit !($1 >= $2) }"; }

# doc_matches WHAT: the families of $SCRAPE are those of docs/OPERATIONS.md's
# metrics table, of the same types; every label a series has is in its row's
# Labels (le aside); the limit values of bufbroker_refused_total are those of
# the doc's limit table.
DOC=${BB_SOURCE_DIR:-$(dirname "${BASH_SOURCE[0]}")/../..}/docs/OPERATIONS.md
doc_matches() {
	[[ -f $DOC ]] || fail "no $DOC"
	awk -F'|' -v dir="$DIR" '
		/^\| Metric \| Type \| Labels \|/ { t = "m"; next }
		/^\| `limit` \| Flag \|/ { t = "l"; next }
		!/^\|/ { t = ""; next }
		/^\|---/ || !t { next }
		{ name = $2; gsub(/[ `]/, "", name) }
		t == "m" {
			type = $3; gsub(/ /, "", type)
			print name, type > (dir "/doc_metrics")
			rest = $4
			while (match(rest, /`[a-z_]+`/)) {
				print name, substr(rest, RSTART + 1, RLENGTH - 2) > (dir "/doc_labels")
				rest = substr(rest, RSTART + RLENGTH)
			}
		}
		t == "l" { print name > (dir "/doc_limits") }' "$DOC"
	sort -o "$DIR/doc_metrics" "$DIR/doc_metrics"
	sort -u -o "$DIR/doc_labels" "$DIR/doc_labels"
	sort -o "$DIR/doc_limits" "$DIR/doc_limits"
	awk '/^# TYPE / { print $3, $4 }' <<<"$SCRAPE" | sort >"$DIR/got_metrics"
	diff "$DIR/doc_metrics" "$DIR/got_metrics" >"$DIR/diff" ||
		fail "$1: the families served (>) and OPERATIONS.md's table (<) differ: $(cat "$DIR/diff")"
	awk '/^# TYPE / { t[$3] = $4; next } /^#/ { next }
	     { n = $1; sub(/\{.*/, "", n); b = n; sub(/_(bucket|sum|count)$/, "", b)
	       if ((b in t) && t[b] == "histogram") n = b
	       rest = $1
	       while (match(rest, /[a-z_]+="/)) {
	         l = substr(rest, RSTART, RLENGTH - 2)
	         if (l != "le") print n, l
	         rest = substr(rest, RSTART + RLENGTH) } }' <<<"$SCRAPE" | sort -u >"$DIR/got_labels"
	comm -23 "$DIR/got_labels" "$DIR/doc_labels" >"$DIR/diff"
	[[ ! -s $DIR/diff ]] || fail "$1: labels OPERATIONS.md does not list: $(cat "$DIR/diff")"
	sed -n 's/^bufbroker_refused_total{limit="\([^"]*\)"}.*/\1/p' <<<"$SCRAPE" | sort >"$DIR/got_limits"
	diff "$DIR/doc_limits" "$DIR/got_limits" >"$DIR/diff" ||
		fail "$1: the limit labels served (>) and OPERATIONS.md's limit table (<) differ: $(cat "$DIR/diff")"
}

STEP="start the daemon with the endpoint"
BEFORE_START=$(date +%s.%N)
start_daemon "$LOG" --uid-buffers 2 --token-ttl 120000 --metrics-listen 127.0.0.1:0
AFTER_START=$(date +%s.%N)

STEP="an idle scrape"
scrape
grep -qi "^Content-Type: text/plain; version=0.0.4; charset=utf-8" "$DIR/headers" ||
	fail "wrong Content-Type: $(grep -i content-type "$DIR/headers")"
expect 'bufbroker_buffers{kind="host"}' 0
expect 'bufbroker_connections' 0
expect 'bufbroker_refused_total{limit="uid_buffers"}' 0
grep -q '^bufbroker_build_info{version="[^"]*",protocol="[0-9]*\.[0-9]*"} 1$' <<<"$SCRAPE" ||
	fail "no bufbroker_build_info line"
# Every family has HELP and TYPE; every sample belongs to a declared family.
for name in connections buffers buffer_bytes tokens parked_waits uid_buffers uid_bytes \
	host_pooled_memfds host_memfds_total \
	device_buffer_bytes device_reserved_bytes device_limit_bytes device_free_bytes \
	requests_total request_duration_seconds refused_total uptime_seconds build_info; do
	grep -q "^# HELP bufbroker_$name " <<<"$SCRAPE" || fail "no HELP line for bufbroker_$name"
	grep -q "^# TYPE bufbroker_$name \(gauge\|counter\|histogram\)$" <<<"$SCRAPE" ||
		fail "no TYPE line for bufbroker_$name"
done
# The process's fds, as Prometheus's client libraries name them: the limit
# is the daemon's soft RLIMIT_NOFILE; the open fds are counted while the
# scrape's own connection is open (1 or 2 more than now, as the endpoint
# may still hold it).
for name_type in process_open_fds:gauge process_max_fds:gauge \
	process_resident_memory_bytes:gauge process_virtual_memory_bytes:gauge \
	process_start_time_seconds:gauge process_cpu_seconds_total:counter; do
	name=${name_type%:*}
	grep -q "^# HELP $name " <<<"$SCRAPE" || fail "no HELP line for $name"
	grep -q "^# TYPE $name ${name_type#*:}$" <<<"$SCRAPE" || fail "no TYPE line '$name ${name_type#*:}'"
done
expect 'process_max_fds' "$(awk '/^Max open files/ { print $4 }' "/proc/$DPID/limits")"
open_fds=$(value process_open_fds)
now_fds=$(find "/proc/$DPID/fd" -mindepth 1 -maxdepth 1 | wc -l)
[[ $open_fds =~ ^[0-9]+$ ]] && ((open_fds >= now_fds && open_fds <= now_fds + 2)) ||
	fail "process_open_fds is $open_fds; the daemon has $now_fds open after the scrape"
expect 'bufbroker_refused_total{limit="host_buffers"}' 0
expect 'bufbroker_refused_total{limit="open_files"}' 0
expect 'bufbroker_refused_total{limit="uid_cuda_bytes"}' 0
# The start time, unix seconds from the kernel's boot time (whole seconds,
# rounded down: up to 1 s early) and the process's start in clock ticks.
start=$(value process_start_time_seconds)
ge "$start" "$BEFORE_START - 1" && ge "$AFTER_START" "$start" ||
	fail "process_start_time_seconds is $start; the daemon started between $BEFORE_START and $AFTER_START"
rss=$(value process_resident_memory_bytes) vsz=$(value process_virtual_memory_bytes)
[[ $rss =~ ^[0-9]+$ && $rss -gt 0 ]] || fail "process_resident_memory_bytes is $rss"
[[ $vsz =~ ^[0-9]+$ && $vsz -ge $rss ]] ||
	fail "process_virtual_memory_bytes is $vsz, less than the resident $rss"
# The daemon's own view of its resident set, in kB (/proc/PID/status), is
# the same pages give or take what the scrape itself touched.
rss_kb=$(awk '/^VmRSS:/ { print $2 }' "/proc/$DPID/status")
((rss > rss_kb * 1024 / 2 && rss < rss_kb * 1024 * 2)) ||
	fail "process_resident_memory_bytes is $rss; /proc/$DPID/status says VmRSS $rss_kb kB"
promtool check metrics <<<"$SCRAPE" >"$DIR/promtool" 2>&1 ||
	fail "promtool check metrics: $(cat "$DIR/promtool")"
awk '/^# TYPE / { t[$3] = $4; next } /^#/ { next }
     { n = $1; sub(/\{.*/, "", n); b = n; sub(/_(bucket|sum|count)$/, "", b)
       if (!(n in t) && !((b in t) && t[b] == "histogram")) { print n; bad = 1 } }
     END { exit bad }' <<<"$SCRAPE" >"$DIR/undeclared" ||
	fail "samples of undeclared families: $(sort -u "$DIR/undeclared" | tr '\n' ' ')"

STEP="workload: a produced buffer consumed"
tok=$(timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-m1 --size 65536 --pattern 7) ||
	fail "bb-producer exited $?"
timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size 65536 --pattern 7 "$tok" >/dev/null ||
	fail "bb-consumer exited $?"

STEP="workload: two buffers left alive by their tokens"
timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-m2 --size 65536 --pattern 1 >/dev/null
timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-m3 --size 4096 --pattern 2 >/dev/null

STEP="workload: a third live buffer is over --uid-buffers 2"
rc=0
timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name bbt-m4 --size 4096 >/dev/null 2>"$DIR/err" || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "the producer over the buffer limit exited $rc"

STEP="workload: stat of a buffer that does not exist"
rc=0
cli stat 999 >/dev/null 2>&1 || rc=$?
[[ $rc -eq 4 ]] || fail "bufbroker stat 999 exited $rc, want 4 (not found)"

STEP="the numbers after the workload"
scrape
expect 'bufbroker_requests_total{op="alloc",status="OK"}' 3
expect 'bufbroker_requests_total{op="alloc",status="NO_MEMORY"}' 1
expect 'bufbroker_requests_total{op="take",status="OK"}' 3
expect 'bufbroker_requests_total{op="adopt",status="OK"}' 1
expect 'bufbroker_requests_total{op="stat",status="NOT_FOUND"}' 1
expect 'bufbroker_refused_total{limit="uid_buffers"}' 1
expect 'bufbroker_refused_total{limit="uid_bytes"}' 0
expect 'bufbroker_buffers{kind="host"}' 2
expect 'bufbroker_buffers{kind="cuda"}' 0
expect 'bufbroker_buffer_bytes{kind="host"}' $((65536 + 4096))
expect 'bufbroker_buffer_bytes{kind="cuda"}' 0
expect "bufbroker_uid_buffers{uid=\"$UID_NOW\"}" 2
expect "bufbroker_uid_bytes{uid=\"$UID_NOW\",kind=\"host\"}" $((65536 + 4096))
expect 'bufbroker_tokens' 2
expect 'bufbroker_parked_waits' 0
expect 'bufbroker_connections' 0
# bbt-m1's memfd, freed by the consumer (same uid), served bbt-m2.
expect 'bufbroker_host_memfds_total{source="new"}' 2
expect 'bufbroker_host_memfds_total{source="reused"}' 1
expect 'bufbroker_host_pooled_memfds' 0

STEP="docs/OPERATIONS.md lists what is served"
doc_matches "host buffers"

STEP="histogram counts match the requests"
for op in hello alloc take adopt stat; do
	want=$(op_total "$op")
	[[ $want -gt 0 ]] || fail "no requests_total series for op $op"
	expect "bufbroker_request_duration_seconds_count{op=\"$op\"}" "$want"
	expect "bufbroker_request_duration_seconds_bucket{op=\"$op\",le=\"+Inf\"}" "$want"
	awk -v p="bufbroker_request_duration_seconds_bucket{op=\"$op\"," \
		'index($1, p) == 1 { if ($2 < last) bad = 1; last = $2; n++ } END { exit bad || n != 18 }' \
		<<<"$SCRAPE" || fail "the $op buckets are not 18 cumulative counts"
done
expect 'bufbroker_request_duration_seconds_count{op="alloc"}' 4
# Four producers, the consumer and the CLI said Hello.
expect 'bufbroker_requests_total{op="hello",status="OK"}' 6

STEP="process_cpu_seconds_total grows as the daemon works"
cpu0=$(value process_cpu_seconds_total)
[[ $cpu0 =~ ^[0-9]+(\.[0-9]+)?$ ]] || fail "process_cpu_seconds_total is $cpu0"
# The kernel counts CPU time in clock ticks (10 ms): keep the daemon busy
# until it has spent one more, for at most 30 s (times $BBT_SLOW).
deadline=$((SECONDS + 30 * ${BBT_SLOW:-1}))
cpu=$cpu0
while ! gt "$cpu" "$cpu0"; do
	((SECONDS < deadline)) || fail "process_cpu_seconds_total stayed at $cpu0 for 30 s of requests"
	for _ in 1 2 3 4 5 6 7 8 9 10; do cli status >/dev/null; done
	scrape
	cpu=$(value process_cpu_seconds_total)
done
ticks=$(awk '{ sub(/.*\) /, ""); print $12 + $13 }' "/proc/$DPID/stat")
hz=$(getconf CLK_TCK)
ge "$ticks / $hz" "$cpu" ||
	fail "process_cpu_seconds_total is $cpu, more than /proc/$DPID/stat's $ticks ticks at $hz Hz"

STEP="other paths and methods"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/")
[[ $code == 404 ]] || fail "GET / answered $code, want 404"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/metrics/x")
[[ $code == 404 ]] || fail "GET /metrics/x answered $code, want 404"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "http://127.0.0.1:$PORT/metrics")
[[ $code == 405 ]] || fail "POST /metrics answered $code, want 405"
code=$(curl -sI -o "$DIR/head" -w '%{http_code}' "http://127.0.0.1:$PORT/metrics")
[[ $code == 200 ]] || fail "HEAD /metrics answered $code, want 200"
grep -qi "^Content-Length: [1-9]" "$DIR/head" || fail "HEAD /metrics has no Content-Length"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/metrics?x=1")
[[ $code == 200 ]] || fail "GET /metrics?x=1 answered $code, want 200"

STEP="a port in use stops a second daemon"
rc=0
timeout 10 "$BUFBROKERD" --config "$NOCONF" --socket "$DIR/second.sock" --no-cuda \
	--metrics-listen "127.0.0.1:$PORT" >"$DIR/second.log" 2>&1 || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "a second daemon on metrics port $PORT exited $rc"
grep -q "event=metrics_failed.*in use" "$DIR/second.log" ||
	fail "no metrics_failed line naming the port in use: $(cat "$DIR/second.log")"
[[ ! -e $DIR/second.sock ]] || fail "the second daemon left its socket file behind"

STEP="a bad address is refused"
rc=0
timeout 10 "$BUFBROKERD" --config "$NOCONF" --socket "$DIR/third.sock" --no-cuda \
	--metrics-listen "300.1.1.1:9464" >"$DIR/third.log" 2>&1 || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "a daemon with --metrics-listen 300.1.1.1:9464 exited $rc"
grep -q "300.1.1.1" "$DIR/third.log" || fail "the bad address is not named: $(cat "$DIR/third.log")"

STEP="concurrent scrapes while clients work"
pids=()
for i in 1 2 3 4 5 6; do
	curl -sS --max-time 5 -o "$DIR/scrape$i" -w '%{http_code}' \
		"http://127.0.0.1:$PORT/metrics" >"$DIR/code$i" 2>&1 &
	pids+=($!)
	cli status >/dev/null
done
for p in "${pids[@]}"; do wait "$p" || fail "a concurrent curl exited non-zero"; done
for i in 1 2 3 4 5 6; do
	[[ $(cat "$DIR/code$i") == 200 ]] || fail "concurrent scrape $i answered $(cat "$DIR/code$i")"
	grep -q '^bufbroker_buffers{kind="host"} 2$' "$DIR/scrape$i" ||
		fail "concurrent scrape $i lacks the buffers gauge"
done

STEP="SIGTERM with the endpoint running"
stop_daemon
grep -q "event=stopped" "$LOG" || fail "no event=stopped line"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$PORT/metrics" || true)
[[ $code == 000 ]] || fail "the endpoint still answers ($code) after the daemon stopped"

STEP="IPv6 loopback"
if grep -qs "^0\{31\}1 " /proc/net/if_inet6; then
	rm -f "$SOCK"
	LOG6=$DIR/daemon6.log
	"$BUFBROKERD" --config "$NOCONF" --socket "$SOCK" --no-cuda --metrics-listen "[::1]:0" >"$LOG6" 2>&1 &
	DPID=$!
	for _ in $(seq 500); do
		grep -q "event=metrics_listening" "$LOG6" && break
		kill -0 "$DPID" 2>/dev/null || fail "bufbrokerd on [::1] exited: $(cat "$LOG6")"
		sleep 0.01
	done
	PORT6=$(sed -n 's/.*event=metrics_listening address=\[::1\]:\([0-9]*\).*/\1/p' "$LOG6")
	[[ $PORT6 =~ ^[0-9]+$ ]] || fail "no [::1] metrics_listening line: $(cat "$LOG6")"
	# Read it all before grep -q, which stops at the first match: curl
	# writing the rest into a closed pipe would fail the pipeline.
	out6=$(curl -sS --max-time 5 -g "http://[::1]:$PORT6/metrics") || fail "curl could not scrape [::1]"
	grep -q '^bufbroker_connections 0$' <<<"$out6" || fail "no metrics over [::1]"
	LOG=$LOG6 stop_daemon
else
	skip_part "the [::1] check: no IPv6 loopback here"
fi

STEP="CUDA devices (fake driver)"
if [[ -n ${BB_FAKECUDA:-} && -n ${BB_BUILD_DIR:-} && -n ${BB_SOURCE_DIR:-} ]]; then
	# The fake driver is set up: this check runs, or fails.
	[[ -x /usr/bin/python3 ]] ||
		fail "/usr/bin/python3 is needed for the CUDA check (apt-get install python3)"
	rm -f "$SOCK"
	LOGC=$DIR/daemon-cuda.log
	export BUFBROKER_CUDA_LIBRARY=$BB_FAKECUDA FAKECUDA_NAMESPACE=bbt-metrics-$$ \
		FAKECUDA_DEVICES=1 FAKECUDA_MEMORY=256M
	# start_daemon passes --no-cuda: this one is started by hand.
	"$BUFBROKERD" --config "$NOCONF" --socket "$SOCK" --metrics-listen 127.0.0.1:0 \
		--token-ttl 120000 --cuda-slab-bytes 2M --cuda-cache-bytes 0 \
		--cuda-device-bytes 8M --uid-cuda-bytes 32M >"$LOGC" 2>&1 &
	DPID=$!
	for _ in $(seq 500); do
		[[ -S $SOCK ]] && grep -q "event=metrics_listening" "$LOGC" && break
		kill -0 "$DPID" 2>/dev/null || fail "bufbrokerd with the fake driver exited: $(cat "$LOGC")"
		sleep 0.01
	done
	PORT=$(sed -n 's/.*event=metrics_listening address=127\.0\.0\.1:\([0-9]*\).*/\1/p' "$LOGC")
	uuid=$(sed -n 's/.*event=cuda_device ordinal=0 .*uuid=\(GPU-[0-9a-f-]*\).*/\1/p' "$LOGC")
	[[ -n $uuid ]] || fail "no cuda_device line: $(cat "$LOGC")"
	# A 1 MiB CUDA buffer left alive by its token, then 16 MiB over the
	# 8 MiB device limit, then 40 MiB over the uid's 32 MiB of CUDA buffers.
	# (ldd's output whole first: awk's exit would SIGPIPE it, and pipefail
	# fail the assignment.)
	libs=$(ldd "$BB_BUILD_DIR/libbufbroker.so.0")
	PY_ASAN=$(awk '/libasan\.so/ { print $3; exit }' <<<"$libs")
	PYTHONPATH=$BB_SOURCE_DIR/python BUFBROKER_LIBRARY=$BB_BUILD_DIR/libbufbroker.so.0 \
		PYTHONDONTWRITEBYTECODE=1 LD_PRELOAD=$PY_ASAN ASAN_OPTIONS=detect_leaks=0 \
		timeout 20 /usr/bin/python3 - "$SOCK" <<'PYEOF' || fail "the Python CUDA client failed"
import sys
import bufbroker
c = bufbroker.Client(sys.argv[1])
c.alloc(1 << 20, kind="cuda").take()
try:
    c.alloc(16 << 20, kind="cuda")
    sys.exit("16 MiB over an 8 MiB device limit was granted")
except bufbroker.NoMemory:
    pass
try:
    c.alloc(40 << 20, kind="cuda")
    sys.exit("40 MiB over a uid's 32 MiB of CUDA buffers was granted")
except bufbroker.NoMemory as e:
    if "--uid-cuda-bytes" not in str(e):
        sys.exit("refused, but not by --uid-cuda-bytes: %s" % e)
PYEOF
	scrape
	dev="device=\"0\",uuid=\"$uuid\""
	expect "bufbroker_device_buffer_bytes{$dev}" $((1 << 20))
	expect "bufbroker_device_reserved_bytes{$dev}" $((2 << 20))
	expect "bufbroker_device_limit_bytes{$dev}" $((8 << 20))
	expect "bufbroker_device_total_bytes{$dev}" $((256 << 20))
	[[ $(value "bufbroker_device_free_bytes{$dev}") =~ ^[0-9]+$ ]] || fail "no device_free_bytes"
	expect 'bufbroker_buffers{kind="cuda"}' 1
	expect 'bufbroker_buffer_bytes{kind="cuda"}' $((1 << 20))
	# The daemon's default handle kind is legacy; the fake device can do VMM.
	expect 'bufbroker_cuda_buffers{handle="legacy"}' 1
	expect 'bufbroker_cuda_buffer_bytes{handle="legacy"}' $((1 << 20))
	expect 'bufbroker_cuda_buffers{handle="vmm"}' 0
	expect 'bufbroker_cuda_buffer_bytes{handle="vmm"}' 0
	expect "bufbroker_device_vmm{$dev}" 1
	expect "bufbroker_device_vmm_allocations{$dev}" 0
	expect "bufbroker_uid_bytes{uid=\"$UID_NOW\",kind=\"cuda\"}" $((1 << 20))
	expect 'bufbroker_refused_total{limit="device_bytes"}' 1
	# The per-uid CUDA limit has a label of its own; uid_bytes is the host one.
	expect 'bufbroker_refused_total{limit="uid_cuda_bytes"}' 1
	expect 'bufbroker_refused_total{limit="uid_bytes"}' 0
	# The first alloc parked while its slab was made: counted once, when answered.
	expect 'bufbroker_requests_total{op="alloc",status="OK"}' 1
	expect 'bufbroker_requests_total{op="alloc",status="NO_MEMORY"}' 2
	expect 'bufbroker_request_duration_seconds_count{op="alloc"}' 3
	expect 'bufbroker_parked_allocs' 0
	doc_matches "CUDA buffers"
	LOG=$LOGC stop_daemon
	unset BUFBROKER_CUDA_LIBRARY FAKECUDA_NAMESPACE FAKECUDA_DEVICES FAKECUDA_MEMORY
else
	skip_part "the CUDA check: \$BB_FAKECUDA, \$BB_BUILD_DIR or \$BB_SOURCE_DIR is unset (ctest sets them)"
fi

STEP="sanitizer reports"
# A sanitizer build reports into the logs, the failed starts' included.
if grep -Eq "AddressSanitizer|LeakSanitizer|runtime error:" "$DIR"/*.log; then
	grep -E -A30 "AddressSanitizer|LeakSanitizer|runtime error:" "$DIR"/*.log >&2
	fail "a daemon's log has a sanitizer report"
fi

finish metrics.sh
