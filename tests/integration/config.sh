#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bufbrokerd's configuration file: every key set in a file is honoured (seen
# in what the daemon does, not in what it prints back), flags override the
# file, --check-config reports every bad line (file:line, key, why) and exits
# 1, or says "FILE: ok"; SIGHUP applies live keys and logs each change, logs
# the keys that need a restart, and changes nothing when the file is bad.
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER, BB_SOURCE_DIR and
# BB_FAKECUDA (libfakecuda.so stands in for the CUDA driver).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test config
# No daemon log and no socket yet: each part of the test names its SOCK, and
# start NAME the log.
LOG=
unset SOCK
need_vars -e "a file" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_FAKECUDA
[[ -n ${BB_SOURCE_DIR:-} && -f $BB_SOURCE_DIR/systemd/bufbrokerd.conf ]] ||
	fail "\$BB_SOURCE_DIR/systemd/bufbrokerd.conf is missing (ctest sets BB_SOURCE_DIR)"
find_python "read JSON"

# The fake driver: one device of 1 GiB, accounting private to this test.
export BUFBROKER_CUDA_LIBRARY=$BB_FAKECUDA FAKECUDA_DEVICES=1 FAKECUDA_MEMORY=1G
export FAKECUDA_NAMESPACE=bbt-config-$$
GROUP=$(id -gn)

# start NAME ARGS...: run the daemon with ARGS, its log in $DIR/NAME.log,
# until the socket named by SOCK exists.
start() {
	local name=$1
	shift
	LOG=$DIR/$name.log
	start_bufbrokerd "$@"
}

stop() {
	kill -TERM "$DPID"
	local rc=0
	wait "$DPID" || rc=$?
	DPID=
	[[ $rc -eq 0 ]] || fail "bufbrokerd exited $rc after SIGTERM, want 0"
}

json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# produce NAME SIZE: one host buffer held by a token; the output in $DIR/out.
produce() {
	timeout 10 "$BB_PRODUCER" --socket "$SOCK" --name "$1" --size "$2" >"$DIR/out" 2>&1
}
# wait_log PATTERN: until the daemon's log has a line matching PATTERN (5 s).
wait_log() {
	for _ in $(seq 500); do
		grep -Eq "$1" "$LOG" && return 0
		sleep 0.01
	done
	fail "no log line matching '$1' within 5 s"
}

# ---- --check-config -----------------------------------------------------------
STEP="--check-config on the shipped example"
out=$("$BUFBROKERD" --check-config "$BB_SOURCE_DIR/systemd/bufbrokerd.conf" 2>&1) ||
	fail "the shipped example is refused: $out"
[[ $out == "$BB_SOURCE_DIR/systemd/bufbrokerd.conf: ok" ]] || fail "unexpected output: $out"

STEP="--check-config on a bad file"
BAD=$DIR/bad.conf
cat >"$BAD" <<'EOF'
# line 1: a comment
[limits]
uid_buffers = lots
max_connections = 0
colour = blue
uid_buffers = 7
[socket]
mode = 0999
group = bbt-no-such-group-xyz
this line has no equals sign
[tokens]
ttl_ms = 5Q
[nonsense]
anything = goes
[log]
level = loud
[metrics]
listen = nowhere
[cuda]
enabled = maybe
handle = sometimes
forbid = auto
EOF
rc=0
out=$("$BUFBROKERD" --check-config "$BAD" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "--check-config on a bad file exited $rc, want 1: $out"
expect() {
	grep -Fq -- "$1" <<<"$out" || fail "--check-config does not say '$1'; it said:
$out"
}
expect "bad.conf:3: [limits] uid_buffers: \"lots\" is not a number"
expect "bad.conf:4: [limits] max_connections: \"0\" is too small"
expect "bad.conf:5: [limits] colour: unknown key"
expect "bad.conf:6: [limits] uid_buffers: is set twice (first on line 3)"
expect "bad.conf:8: [socket] mode: \"0999\" is not an octal mode"
expect "bad.conf:9: [socket] group: no group named \"bbt-no-such-group-xyz\""
expect "bad.conf:10: expected \"key = value\""
expect "bad.conf:12: [tokens] ttl_ms: \"5Q\" is not a number"
expect "bad.conf:13: unknown section [nonsense]"
expect "bad.conf:16: [log] level: \"loud\" is not a level"
expect "bad.conf:18: [metrics] listen: \"nowhere\" is not ADDRESS:PORT"
expect "bad.conf:20: [cuda] enabled: \"maybe\" is not true or false"
expect "bad.conf:21: [cuda] handle: \"sometimes\" is not legacy, auto or vmm"
expect "bad.conf:22: [cuda] forbid: \"auto\" is not none, legacy or vmm"
grep -q "anything" <<<"$out" && fail "a key of an unknown section was reported on its own: $out"
[[ $(grep -c "bad.conf:[0-9]" <<<"$out") -eq 14 ]] || fail "want exactly 14 problems reported: $out"
grep -q ": ok" <<<"$out" && fail "a bad file was called ok: $out"

STEP="--check-config: a CUDA handle default that is forbidden"
printf '[cuda]\nhandle = vmm\nforbid = vmm\n' >"$DIR/forbidden.conf"
rc=0
out=$("$BUFBROKERD" --check-config "$DIR/forbidden.conf" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "a forbidden default was accepted (exit $rc): $out"
expect "cuda-handle = vmm is forbidden by cuda-forbid = vmm"
rc=0
out=$("$BUFBROKERD" --socket "$DIR/never.sock" --config /dev/null --cuda-forbid legacy 2>&1) || rc=$?
[[ $rc -eq 2 ]] || fail "bufbrokerd --cuda-forbid legacy (the default handle) exited $rc, want 2 (bad flags): $out"
expect "cuda-handle = legacy is forbidden by cuda-forbid = legacy"
[[ ! -e $DIR/never.sock ]] || fail "a daemon with a forbidden default made its socket"

STEP="--check-config: unknown key alone"
printf '[limits]\nuid_buffer = 5\n' >"$DIR/typo.conf"
rc=0
out=$("$BUFBROKERD" --check-config "$DIR/typo.conf" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "a misspelt key was accepted (exit $rc): $out"
expect "typo.conf:2: [limits] uid_buffer: unknown key (the keys of [limits] are: uid_host_bytes"

STEP="--check-config on a missing file"
rc=0
out=$("$BUFBROKERD" --check-config "$DIR/missing.conf" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "--check-config on a missing file exited $rc, want 1"
expect "missing.conf: cannot read it"

STEP="the daemon refuses a bad file and a missing --config file"
SOCK=$DIR/never.sock
rc=0
out=$("$BUFBROKERD" --socket "$SOCK" --config "$BAD" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "bufbrokerd --config BAD exited $rc, want 1: $out"
expect "bad.conf:3: [limits] uid_buffers"
rc=0
out=$("$BUFBROKERD" --socket "$SOCK" --config "$DIR/missing.conf" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "bufbrokerd --config MISSING exited $rc, want 1: $out"
[[ ! -e $SOCK ]] || fail "a refused configuration still made the socket"
rc=0
out=$("$BUFBROKERD" --socket "$SOCK" --uid-buffers lots 2>&1) || rc=$?
[[ $rc -eq 2 ]] || fail "a bad flag exited $rc, want 2: $out"
expect "--uid-buffers: \"lots\" is not a number"

# ---- every key set in the file -------------------------------------------------
FULL=$DIR/full.conf
SOCK=$DIR/full.sock
cat >"$FULL" <<EOF
; every key, none at its default
[socket]
path = $SOCK
mode = 0600
group = $GROUP

[limits]
uid_host_bytes = 1M        ; comments may follow a value
uid_cuda_bytes = 3M
uid_buffers = 3
max_connections = 64
max_host_buffers = 1000
conn_tokens = 16
conn_waits = 16
queue_bytes = 64K
max_datagram = 32K
host_pool_memfds = 0

[tokens]
ttl_ms = 1500

[cuda]
enabled = yes
slab_bytes = 2M
cache_bytes = 6M
device_bytes = 24M
handle = auto
forbid = legacy
max_vmm_allocations = 8

[log]
level = debug

[metrics]
listen = 127.0.0.1:0

[restart]
journal = on
EOF
STEP="--check-config on a file with every key"
out=$("$BUFBROKERD" --check-config "$FULL" 2>&1) || fail "the full file is refused: $out"
[[ $out == "$FULL: ok" ]] || fail "unexpected output: $out"

STEP="start with the full file"
start full --config "$FULL"

STEP="[restart] journal"
grep -q "event=journal_on fd=" "$LOG" || fail "no journal_on line: the state journal is not on"

STEP="[socket] path, mode, group"
[[ $(stat -c %a "$SOCK") == 600 ]] || fail "socket mode $(stat -c %a "$SOCK"), want 600"
[[ $(stat -c %G "$SOCK") == "$GROUP" ]] || fail "socket group $(stat -c %G "$SOCK"), want $GROUP"

STEP="[limits] max_connections, max_host_buffers: the open-file budget"
grep -q "event=open_files .*connections=64 per_connection=9 host_buffers=1000$" "$LOG" ||
	fail "the open_files line does not show max_connections 64 and max_host_buffers 1000"

STEP="[limits] max_datagram"
st=$(cli --json status)
grep -q "event=listening .*max_datagram=32768" "$LOG" || fail "max_datagram is not 32768"

STEP="[cuda] enabled, slab_bytes, cache_bytes, device_bytes"
[[ $(json "d['cuda']" <<<"$st") == "" ]] || fail "CUDA is not served: $st"
[[ $(json "d['devices'][0]['limit_bytes']" <<<"$st") == 25165824 ]] ||
	fail "device limit is not 24M: $st"
[[ $(json "d['devices'][0]['vmm'], d['devices'][0]['vmm_allocations']" <<<"$st") == "True 0" ]] ||
	fail "status does not say that VMM buffers can be had (forbid = legacy): $st"
# The output first, then grep (grep -q on a pipe exits at its match and
# pipefail fails the step when the writer is SIGPIPEd).
text=$(cli status)
grep -q "^  vmm           yes, 0 allocations held$" <<<"$text" ||
	fail "the status text has no vmm line: $text"
grep -q "event=cuda_ready .*slab_bytes=2097152 cache_bytes=6291456 handle=auto forbid=legacy max_vmm_allocations=8" "$LOG" ||
	fail "the CUDA backend did not get slab_bytes=2M cache_bytes=6M handle=auto forbid=legacy max_vmm_allocations=8"

STEP="[log] level = debug"
grep -q "level=debug event=hello" "$LOG" || fail "no debug line for the CLI's Hello"

STEP="[limits] uid_host_bytes"
produce big 2097152 && fail "a 2 MiB buffer was allowed under uid_host_bytes = 1M"
grep -q "the limit is 1.0 MiB" "$DIR/out" ||
	fail "the refusal does not name the 1 MiB limit: $(cat "$DIR/out")"

STEP="[limits] uid_buffers"
for i in 1 2 3; do
	produce "b$i" 4096 || fail "buffer $i of 3 refused: $(cat "$DIR/out")"
done
produce b4 4096 && fail "a 4th buffer was allowed under uid_buffers = 3"
grep -q "would own 4 buffers; the limit is 3" "$DIR/out" ||
	fail "the 4th buffer's refusal does not name the limit: $(cat "$DIR/out")"
[[ $(cli --json status | json "d['kinds']['host']['buffers']") == 3 ]] ||
	fail "want 3 live buffers"

STEP="[tokens] ttl_ms"
# The three tokens release their buffers 1.5 s after they were made.
for _ in $(seq 40); do
	[[ $(cli --json status | json "d['kinds']['host']['buffers']") == 0 ]] && break
	sleep 0.1
done
[[ $(cli --json status | json "d['kinds']['host']['buffers']") == 0 ]] ||
	fail "tokens outlived ttl_ms = 1500 by seconds"

STEP="[limits] host_pool_memfds = 0"
# The freed buffers' memfds were closed, not kept for reuse (the state
# journal, [restart] journal = on, is a memfd of its own).
memfds=$(find "/proc/$DPID/fd" -lname '/memfd:*' ! -lname '/memfd:bufbroker-journal*' | wc -l)
[[ $memfds == 0 ]] || fail "the daemon kept $memfds memfds of freed buffers"
stop

# ---- flags override the file -----------------------------------------------------
STEP="flags override the file"
SOCK=$DIR/flags.sock
start flags --config "$FULL" --socket "$SOCK" --socket-mode 0640 --uid-buffers 5 \
	--log-level warn --token-ttl 60000 --uid-host-bytes 4M
[[ $(stat -c %a "$SOCK") == 640 ]] || fail "socket mode $(stat -c %a "$SOCK"), want 640 (flag)"
[[ ! -e $DIR/full.sock ]] || fail "the file's socket path was used despite --socket"
produce big 2097152 || fail "--uid-host-bytes 4M did not override 1M: $(cat "$DIR/out")"
for i in 2 3 4 5; do
	produce "b$i" 4096 || fail "buffer $i of 5 refused: $(cat "$DIR/out")"
done
produce b6 4096 && fail "a 6th buffer was allowed under --uid-buffers 5"
sleep 2 # past the file's ttl_ms: --token-ttl keeps them
[[ $(cli --json status | json "d['kinds']['host']['buffers']") == 5 ]] ||
	fail "--token-ttl 60000 did not override ttl_ms = 1500"
grep -q "level=info\|level=debug" "$LOG" && fail "--log-level warn did not override level = debug"
stop

# ---- the open-file budget ----------------------------------------------------------
# start_nofile N NAME ARGS...: start NAME ARGS... (as start does) with its
# open-file limit, soft and hard, at N.
start_nofile() {
	local n=$1 name=$2
	shift 2
	LOG=$DIR/$name.log
	(ulimit -n "$n" && exec "$BUFBROKERD" "$@") >"$LOG" 2>&1 &
	DPID=$!
	wait_socket bufbrokerd
}
# refuse_nofile N ARGS...: the daemon, with its open-file limit at N, must
# refuse to start (exit 1) without making its socket; its output in $out.
refuse_nofile() {
	local n=$1 rc=0
	shift
	out=$( (ulimit -n "$n" && exec timeout 10 "$BUFBROKERD" --socket "$SOCK" "$@") 2>&1) || rc=$?
	[[ $rc -eq 1 ]] || fail "bufbrokerd with $n open files and $* exited $rc, want 1: $out"
	[[ ! -e $SOCK ]] || fail "a daemon whose limits do not fit made its socket"
}
SOCK=$DIR/nofile.sock

STEP="the open-file budget: connections that do not fit"
refuse_nofile 512 --config /dev/null
expect "1024 connections need 9216 file descriptors (9 each) on top of the "
expect "but its open-file limit (RLIMIT_NOFILE) is 512: lower --max-connections to at most "

STEP="the open-file budget: VMM CUDA allocations that do not fit"
refuse_nofile 512 --config /dev/null --max-connections 16
expect "1024 VMM CUDA allocations (one each) and 16 connections (144) need "
expect "lower --max-cuda-vmm-allocations to at most "
vmm_most=$(sed -n 's/.*lower --max-cuda-vmm-allocations to at most \([0-9]*\) .*/\1/p' <<<"$out")
[[ $vmm_most =~ ^[0-9]+$ && $vmm_most -gt 0 ]] || fail "no number to lower --max-cuda-vmm-allocations to: $out"
start_nofile 512 nofile-vmm --config /dev/null --socket "$SOCK" --max-connections 16 \
	--max-cuda-vmm-allocations "$vmm_most"
grep -q "event=open_files limit=512 .*vmm_allocations=$vmm_most connections=16 .*host_buffers=[0-9]* (what the limit leaves)$" "$LOG" ||
	fail "the open_files line does not show the VMM allocations: $(grep open_files "$LOG")"
stop

# The host-buffer steps below serve no CUDA: its VMM allocations' fds
# would take the room these count.
STEP="the open-file budget: host buffers that do not fit"
refuse_nofile 512 --config /dev/null --no-cuda --max-connections 16 --max-host-buffers 1000
expect "1000 host buffers (one each) and 16 connections (144) need "
most=$(sed -n 's/.*lower --max-host-buffers to at most \([0-9]*\) .*/\1/p' <<<"$out")
[[ $most =~ ^[0-9]+$ && $most -gt 0 ]] || fail "no number to lower --max-host-buffers to: $out"

STEP="the open-file budget: the number it names fits, and is enforced"
start_nofile 512 nofile --config /dev/null --no-cuda --socket "$SOCK" --max-connections 16 \
	--max-host-buffers "$most"
grep -q "event=open_files limit=512 .*connections=16 per_connection=9 host_buffers=$most$" "$LOG" ||
	fail "the open_files line does not show the budget: $(grep open_files "$LOG")"
for i in $(seq "$most"); do
	produce "n$i" 4096 || fail "host buffer $i of $most refused: $(cat "$DIR/out")"
done
produce "n$((most + 1))" 4096 && fail "a host buffer past --max-host-buffers $most was allowed"
grep -q "the daemon would hold $((most + 1)) host buffers; the limit is $most (--max-host-buffers)" \
	"$DIR/out" || fail "the refusal does not name the limit: $(cat "$DIR/out")"

stop

STEP="the open-file budget: a reload whose limits do not fit changes nothing"
printf '[limits]\nmax_connections = 16\nmax_host_buffers = 0\n' >"$DIR/nofile.conf"
start_nofile 512 nofile-hup --config "$DIR/nofile.conf" --no-cuda --socket "$SOCK"
auto=$(sed -n 's/.*event=open_files .* host_buffers=\([0-9]*\) (what the limit leaves)$/\1/p' "$LOG")
[[ $auto =~ ^[0-9]+$ && $auto -gt 0 ]] || fail "max_host_buffers = 0 is not what the limit leaves: $(grep open_files "$LOG")"
printf '[limits]\nmax_connections = 1000\nmax_host_buffers = 0\n' >"$DIR/nofile.conf"
kill -HUP "$DPID"
wait_log "event=config_reload_failed"
grep -q 'event=config_reload_failed .*error="1000 connections need 9000 file descriptors .*lower --max-connections to at most [0-9]*, .*action=none' "$LOG" ||
	fail "the failed reload does not say which limit to lower: $(grep config_reload_failed "$LOG")"
grep -q "event=config_changed" "$LOG" && fail "a reload whose limits do not fit changed something"
printf '[limits]\nmax_connections = 8\nmax_host_buffers = 0\n' >"$DIR/nofile.conf"
kill -HUP "$DPID"
wait_log "event=config_reloaded"
grep -q "event=config_changed key=limits.max_connections old=16 new=8" "$LOG" ||
	fail "a reload that fits did not apply"
stop

STEP="the open-file budget: the defaults fit the unit's LimitNOFILE"
# Raising the limit to the unit's may be refused here (no CAP_SYS_RESOURCE):
# start at this host's limit, check the daemon's sum as OPERATIONS.md
# writes it, and apply the same sum to the unit's limit.
unit_nofile=$(sed -n 's/^LimitNOFILE=//p' "$BB_SOURCE_DIR/systemd/bufbrokerd.service")
[[ $unit_nofile =~ ^[0-9]+$ ]] || fail "no LimitNOFILE= in systemd/bufbrokerd.service"
start unit --config "$BB_SOURCE_DIR/systemd/bufbrokerd.conf" --socket "$SOCK"
line=$(grep "event=open_files " "$LOG") || fail "no open_files line"
field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$line"; }
own=$(field own) spare=$(field spare) pool=$(field pool) conns=$(field connections)
per=$(field per_connection) host=$(field host_buffers) limit=$(field limit)
vmm=$(field vmm_allocations)
[[ $conns == 1024 && $per == 9 && $pool == 64 && $spare == 256 && $vmm == 1024 ]] ||
	fail "the defaults are not what OPERATIONS.md says: $line"
((host == limit - own - spare - pool - vmm - conns * per)) ||
	fail "host_buffers is not what the limit leaves, as OPERATIONS.md sums it: $line"
stop
unit_host=$((unit_nofile - own - spare - pool - vmm - conns * per))
# More than one uid's --uid-buffers: one user cannot take every host buffer.
((unit_host > 65536)) ||
	fail "with LimitNOFILE=$unit_nofile the defaults leave $unit_host host buffers, want > 65536"

# ---- SIGHUP -------------------------------------------------------------------------
SOCK=$DIR/hup.sock
HUP=$DIR/hup.conf
cat >"$HUP" <<EOF
[socket]
path = $SOCK
[limits]
conn_tokens = 0
EOF
STEP="SIGHUP: before"
start hup --config "$HUP"
produce t1 4096 && fail "a token was made under conn_tokens = 0"
grep -q "tokens" "$DIR/out" || fail "the refusal does not name the token limit: $(cat "$DIR/out")"

STEP="SIGHUP applies a live limit and names restart-only keys"
cat >"$HUP" <<EOF
[socket]
path = $DIR/elsewhere.sock
[limits]
conn_tokens = 4
host_pool_memfds = 0
[log]
level = debug
EOF
kill -HUP "$DPID"
wait_log "event=config_reloaded"
grep -q "event=config_changed key=limits.conn_tokens old=0 new=4" "$LOG" ||
	fail "no config_changed line for limits.conn_tokens"
grep -q "event=config_changed key=log.level old=info new=debug" "$LOG" ||
	fail "no config_changed line for log.level"
grep -q "event=config_changed key=limits.host_pool_memfds old=64 new=0" "$LOG" ||
	fail "no config_changed line for limits.host_pool_memfds"
grep -q "event=config_restart_needed keys=socket.path" "$LOG" ||
	fail "no config_restart_needed line naming socket.path"
[[ $(grep -c "event=config_changed" "$LOG") -eq 3 ]] || fail "want exactly 3 config_changed lines"
[[ -S $SOCK && ! -e $DIR/elsewhere.sock ]] || fail "the socket moved without a restart"
produce t2 4096 || fail "conn_tokens = 4 did not apply live: $(cat "$DIR/out")"
grep -q "level=debug event=hello" "$LOG" || fail "level = debug did not apply live"

STEP="SIGHUP with a bad file changes nothing"
cat >"$HUP" <<EOF
[socket]
path = $SOCK
[limits]
conn_tokens = 0
uid_buffers = lots
EOF
kill -HUP "$DPID"
wait_log "event=config_reload_failed"
grep -q 'level=error event=config_invalid .*line=5 key=limits.uid_buffers error="\\"lots\\" is not a number' "$LOG" ||
	fail "the bad key is not logged with its line"
grep -q "key=limits.conn_tokens old=4 new=0" "$LOG" && fail "a bad file still changed conn_tokens"
produce t3 4096 || fail "conn_tokens changed after a bad reload: $(cat "$DIR/out")"

STEP="SIGHUP: the CUDA handle policy is live, and a forbidden default changes nothing"
printf '[socket]\npath = %s\n[limits]\nconn_tokens = 4\n[cuda]\nhandle = auto\nforbid = legacy\n' "$SOCK" >"$HUP"
kill -HUP "$DPID"
wait_log "event=config_changed key=cuda.forbid old=none new=legacy"
grep -q "event=config_changed key=cuda.handle old=legacy new=auto" "$LOG" ||
	fail "no config_changed line for cuda.handle"
[[ $(cli --json status | json "d['devices'][0]['vmm']") == True ]] ||
	fail "VMM is not available after forbid = legacy: $(cli --json status)"
printf '[socket]\npath = %s\n[limits]\nconn_tokens = 4\n[cuda]\nhandle = auto\nforbid = auto\n' "$SOCK" >"$HUP"
kill -HUP "$DPID"
wait_log 'error="\\"auto\\" is not none, legacy or vmm"'
printf '[socket]\npath = %s\n[limits]\nconn_tokens = 4\n[cuda]\nhandle = vmm\nforbid = vmm\n' "$SOCK" >"$HUP"
kill -HUP "$DPID"
wait_log "cuda-handle = vmm is forbidden by cuda-forbid = vmm"
grep -q "key=cuda.forbid old=legacy new=vmm" "$LOG" && fail "a forbidden default was applied"
printf '[socket]\npath = %s\n[cuda]\nforbid = vmm\n' "$SOCK" >"$HUP"
kill -HUP "$DPID"
wait_log "event=config_changed key=cuda.forbid old=legacy new=vmm"
[[ $(cli --json status | json "d['devices'][0]['vmm'], d['devices'][0]['vmm_unavailable']") == "False forbidden by the operator (cuda-forbid = vmm)" ]] ||
	fail "forbid = vmm did not apply live: $(cli --json status)"

STEP="SIGHUP with the file gone (given with --config)"
rm "$HUP"
kill -HUP "$DPID"
for _ in $(seq 500); do
	[[ $(grep -c "event=config_reload_failed" "$LOG") -ge 2 ]] && break
	sleep 0.01
done
[[ $(grep -c "event=config_reload_failed" "$LOG") -ge 2 ]] || fail "a missing file did not fail the reload"
produce t4 4096 || fail "the daemon changed after a failed reload: $(cat "$DIR/out")"
kill -0 "$DPID" || fail "the daemon died on SIGHUP"
stop

echo "config.sh: all checks passed"
