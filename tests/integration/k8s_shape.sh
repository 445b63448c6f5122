#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The shape of deploy/kubernetes, without Kubernetes: the daemon as the
# DaemonSet runs it (uid and gid 2000, no capabilities, no_new_privs, its
# socket mode 0660 in a directory of its own, mode 0750), and a worker as
# the example pod runs (uid 1000 with supplementary group 2000, no
# capabilities, no_new_privs) in its own PID, IPC and mount namespaces
# (unshare), where the host's /run, /tmp and /dev/shm are replaced by empty
# ones and the socket directory alone is mounted, read-only, at
# /run/bufbroker. Through it the worker allocates, maps and fills host
# buffers that a process outside those namespaces, of a third uid, adopts
# and verifies byte by byte, and the other way round; then no buffer is
# left. So the socket directory is all that a worker needs to share.
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER and BB_CONSUMER. Needs
# root (unshare, setpriv); skips without it or where namespaces cannot be
# made (exit 77, a failure under CI).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test k8s-shape
need_vars -x "an executable" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_CONSUMER
[[ $(id -u) -eq 0 ]] || skip "needs root to make namespaces and switch uids"
for tool in unshare setpriv mount; do
	command -v "$tool" >/dev/null 2>&1 || skip "$tool is not installed"
done
unshare --pid --ipc --mount --fork --mount-proc --propagation private true 2>/dev/null ||
	skip "cannot make PID, IPC and mount namespaces here (unshare failed)"

# The identities of deploy/kubernetes: the daemon's uid and gid (the
# socket's group), the worker's uid, and a third uid for the reader outside.
DAEMON=2000 WORKER=1000 OUTSIDE=3000
# The binaries must be reachable by those uids.
for exe in "$BUFBROKERD" "$BB_PRODUCER" "$BB_CONSUMER"; do
	setpriv --reuid=$WORKER --regid=$WORKER --clear-groups test -x "$exe" ||
		skip "uid $WORKER cannot run $exe (a build directory it cannot reach)"
done

# ---- the daemon, as the DaemonSet runs it -----------------------------------------
STEP="daemon as uid $DAEMON"
chmod 0755 "$DIR"
RUN=$DIR/run/bufbroker
mkdir -p "$RUN"
# What the DaemonSet's init container does to the node's /run/bufbroker.
chmod 0750 "$RUN"
chown $DAEMON:$DAEMON "$RUN"
SOCK=$RUN/bufbroker.sock
# as UID GID GROUPS CMD...: exec CMD as that uid and gid, with those
# supplementary groups ("": none), no capabilities and no_new_privs. It
# execs: call it in a subshell (then "(as ...) &" leaves in $! the pid of
# CMD itself).
as() {
	local uid=$1 gid=$2 groups=--clear-groups
	[[ -n $3 ]] && groups=--groups=$3
	shift 3
	exec setpriv --reuid="$uid" --regid="$gid" "$groups" --inh-caps=-all --bounding-set=-all \
		--no-new-privs "$@"
}
(as $DAEMON $DAEMON "" "$BUFBROKERD" --socket="$SOCK" --socket-mode=0660 --no-cuda) >"$LOG" 2>&1 &
DPID=$!
wait_socket
[[ $(stat -c '%a %g' "$SOCK") == "660 $DAEMON" ]] ||
	fail "the socket is $(stat -c '%a %U:%G' "$SOCK"), want mode 660 and group $DAEMON"

# ---- the worker, as the example pod runs -----------------------------------------
# worker SCRIPT: run SCRIPT (bash) in new PID, IPC and mount namespaces with
# the pod's view of the files, as uid $WORKER with group $DAEMON, with
# BUFBROKER_SOCKET set as the pod sets it. Its output goes to stdout.
# shellcheck disable=SC2016 # the script expands in the worker's shell
worker() {
	unshare --pid --ipc --mount --fork --mount-proc --propagation private \
		env RUN="$RUN" WORKER=$WORKER DAEMON=$DAEMON SCRIPT="$1" \
		bash -c '
set -e
# The node: an empty /run with the socket directory, read-only, at
# /run/bufbroker; empty /tmp and /dev/shm (the test directory, the host
# socket path and any shared memory files are gone).
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir /run/bufbroker
mount --bind "$RUN" /run/bufbroker
mount -o remount,bind,ro /run/bufbroker
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /dev/shm
exec setpriv --reuid=$WORKER --regid=$WORKER --groups=$DAEMON --inh-caps=-all \
	--bounding-set=-all --no-new-privs \
	env BUFBROKER_SOCKET=/run/bufbroker/bufbroker.sock bash -c "$SCRIPT"'
}

STEP="the worker's view"
host_ipc=$(readlink /proc/self/ns/ipc)
# shellcheck disable=SC2016 # what the worker's shell expands
view=$(worker '
echo "uid $(id -u) groups $(id -G)"
echo "ipc $(readlink /proc/self/ns/ipc)"
echo "pid $$"
ls /proc | grep -c "^[0-9]" | sed "s/^/processes /"
comms=$(cat /proc/[0-9]*/comm 2>/dev/null) || true
grep -qx bufbrokerd <<<"$comms" && echo "sees bufbrokerd"
test -e "'"$SOCK"'" && echo "sees the host socket path"
touch /run/bufbroker/x 2>/dev/null && echo "can write the socket directory"
grep -q "^CapEff:[[:space:]]*0*$" /proc/self/status || echo "has capabilities"
ls -A /tmp /dev/shm | grep -v ":$" | grep . && echo "sees files in /tmp or /dev/shm"
true') || fail "the worker exited $?: $view"
grep -qx "uid $WORKER groups $WORKER $DAEMON" <<<"$view" || fail "the worker is not uid $WORKER with group $DAEMON: $view"
grep -q "^ipc ipc:" <<<"$view" || fail "the worker did not tell its IPC namespace: $view"
if grep -Fqx "ipc $host_ipc" <<<"$view"; then
	fail "the worker shares the host's IPC namespace ($host_ipc): $view"
fi
# In its own PID namespace the worker's shell is a low pid and sees only
# its own few processes.
grep -Eqx 'pid [0-9]' <<<"$view" || fail "the worker is not in a PID namespace of its own: $view"
grep -Eqx 'processes [1-9]' <<<"$view" || fail "the worker sees the host's processes: $view"
for bad in "sees bufbrokerd" "sees the host socket path" "can write the socket directory" \
	"has capabilities" "sees files in /tmp or /dev/shm"; do
	grep -Fqx "$bad" <<<"$view" && fail "the worker $bad: $view"
done

# ---- buffers across the boundary ------------------------------------------------------
STEP="worker allocates, an outside process verifies"
size=4194304
out=$(worker "timeout 10 '$BB_PRODUCER' --name bbt-k8s-worker --size $size --pattern 201") ||
	fail "bb-producer in the worker exited $?: $out"
tok=$(grep -E -m1 '^[0-9a-f]{32}$' <<<"$out") || fail "the worker's producer printed no token: $out"
out=$(as $OUTSIDE $OUTSIDE $DAEMON timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size $size \
	--pattern 201 "$tok") || fail "bb-consumer outside exited $?: $out"
grep -q "verified $size bytes" <<<"$out" || fail "bb-consumer outside: $out"

STEP="outside allocates, the worker verifies"
out=$(as $OUTSIDE $OUTSIDE $DAEMON timeout 10 "$BB_PRODUCER" --socket "$SOCK" \
	--name bbt-k8s-outside --size $size --pattern 57) || fail "bb-producer outside exited $?: $out"
tok=$(grep -E -m1 '^[0-9a-f]{32}$' <<<"$out") || fail "the producer outside printed no token: $out"
out=$(worker "timeout 10 '$BB_CONSUMER' --size $size --pattern 57 $tok") ||
	fail "bb-consumer in the worker exited $?: $out"
grep -q "verified $size bytes" <<<"$out" || fail "bb-consumer in the worker: $out"

STEP="nothing left behind"
# The consumers' last releases travel without a reply: wait for the daemon
# to have acted on them.
json=
for _ in $(seq $((500 * ${BBT_SLOW:-1}))); do
	json=$(cli --json status) || fail "bufbroker --json status exited $?"
	grep -q '"host":{"buffers":0,' <<<"$json" && break
	sleep 0.01
done
grep -q '"host":{"buffers":0,' <<<"$json" || fail "buffers left behind: $json"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"
finish k8s_shape
