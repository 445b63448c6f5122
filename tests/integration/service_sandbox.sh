#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bufbrokerd works inside the sandbox of systemd/bufbrokerd.service, as far
# as it can be reproduced without systemd as PID 1: the socket made by
# someone else and passed to it (systemd-socket-activate), the daemon as an
# unprivileged uid with no capabilities at all (empty bounding set, as
# CapabilityBoundingSet=), no_new_privs and the unit's UMask=. Through it a
# producer and a consumer in two processes move a host buffer, the CLI and
# the metrics endpoint answer, SIGHUP reloads and SIGTERM ends it with 0.
# Every system call the daemon made meanwhile (strace) is one the unit's
# SystemCallFilter= lets through, and every socket it made is of a family
# RestrictAddressFamilies= allows. (The unit's rating is
# scripts/check-units.sh's, run by shell.systemd.)
#
# ctest sets BUFBROKERD, BUFBROKER_CLI, BB_PRODUCER, BB_CONSUMER and
# BB_SOURCE_DIR. Needs root (to switch the daemon to uid nobody), strace
# allowed to trace, curl, systemd-analyze and systemd-socket-activate; skips
# without them (exit 77, a failure under CI).
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test service-sandbox
need_vars -x "an executable" BUFBROKERD BUFBROKER_CLI BB_PRODUCER BB_CONSUMER
UNIT=${BB_SOURCE_DIR:-}/systemd/bufbrokerd.service
[[ -f $UNIT ]] || fail "$UNIT is missing (ctest sets BB_SOURCE_DIR)"
find_python "compare system calls with the unit's filter"

for tool in systemd-analyze systemd-socket-activate strace setpriv curl; do
	command -v "$tool" >/dev/null 2>&1 || skip "$tool is not installed"
done
[[ $(id -u) -eq 0 ]] || skip "needs root to run the daemon as another uid"
strace -f -qq -o /dev/null true 2>/dev/null || skip "strace may not trace here (ptrace denied)"

# ---- the daemon as the unit runs it ---------------------------------------------------
STEP="start as nobody, no capabilities"
# The unit's identity and limits, read from it so that this follows it.
umask_unit=$(sed -n 's/^UMask=//p' "$UNIT")
[[ $umask_unit =~ ^0[0-7]{3}$ ]] || fail "the unit has no UMask=: '$umask_unit'"
grep -qx 'CapabilityBoundingSet=' "$UNIT" || fail "the unit does not empty CapabilityBoundingSet="
grep -qx 'NoNewPrivileges=yes' "$UNIT" || fail "the unit has no NoNewPrivileges=yes"
chmod 0755 "$DIR"
TRACE=$DIR/trace
LOG=$DIR/activate.log
# strace -D: the tracer is a grandchild, so the daemon keeps the pid that
# systemd-socket-activate gave in LISTEN_PID. LeakSanitizer cannot work
# under ptrace: in a sanitizer build, this daemon's leaks are left to the
# other tests (a later detect_leaks wins in ASAN_OPTIONS).
(umask "$umask_unit" && exec systemd-socket-activate --seqpacket -l "$SOCK" \
	-E BUFBROKERD_CONFIG=/dev/null -E ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
	strace -D -f -qq -o "$TRACE" \
	setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all \
	--bounding-set=-all --no-new-privs \
	"$BUFBROKERD" --no-cuda --metrics-listen 127.0.0.1:0) >"$LOG" 2>&1 &
DPID=$!
wait_socket systemd-socket-activate

STEP="producer and consumer through the daemon"
produce_activated bbt-sandbox 1048576 7
out=$(timeout 10 "$BB_CONSUMER" --socket "$SOCK" --size 1048576 --pattern 7 "$TOK") ||
	fail "bb-consumer exited $?"
grep -q "verified 1048576 bytes" <<<"$out" || fail "bb-consumer: $out"

STEP="the daemon's identity"
status=/proc/$DPID/status
nobody=$(id -u nobody)
grep -Eq "^Uid:([[:space:]]+${nobody}){4}\$" "$status" ||
	fail "the daemon does not run as nobody: $(grep '^Uid:' "$status")"
for cap in CapPrm CapEff CapBnd CapAmb; do
	grep -Eq "^$cap:[[:space:]]+0+\$" "$status" || fail "the daemon has capabilities: $(grep "^$cap:" "$status")"
done
grep -Eq '^NoNewPrivs:[[:space:]]+1$' "$status" || fail "the daemon may gain privileges (NoNewPrivs 0)"

STEP="CLI, metrics and SIGHUP"
out=$(cli status) || fail "bufbroker status exited $?"
grep -Eq "^pid +$DPID\$" <<<"$out" || fail "status does not show the daemon's pid $DPID: $out"
port=$(sed -n 's/.*event=metrics_listening address=127\.0\.0\.1:\([0-9]*\).*/\1/p' "$LOG")
[[ $port =~ ^[0-9]+$ ]] || fail "no metrics_listening line with a port in the log"
scrape=$(curl -sS --max-time $((10 * ${BBT_SLOW:-1})) "http://127.0.0.1:$port/metrics") ||
	fail "curl could not scrape the metrics endpoint (exit $?)"
grep -q '^bufbroker_' <<<"$scrape" || fail "the metrics endpoint answered no bufbroker_ metric: $scrape"
kill -HUP "$DPID"
for _ in $(seq 500); do
	grep -q 'event=config_reloaded' "$LOG" && break
	sleep 0.01
done
grep -q 'event=config_reloaded' "$LOG" || fail "no config_reloaded line 5 s after SIGHUP"
# The daemon serves on after the reload.
cli status >/dev/null || fail "bufbroker status after SIGHUP exited $?"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"

# ---- what it called -----------------------------------------------------------------------
STEP="system calls and address families against the unit"
# The unit's filter, expanded with systemd-analyze syscall-filter: the union
# of its allow lists less the union of its ~deny lists; only calls made
# after the daemon's own execve count (before it, setpriv's).
"$PY" - "$UNIT" "$TRACE" "$(readlink -f "$BUFBROKERD")" <<'EOF' || fail "see above"
import re, subprocess, sys

unit, trace, daemon = sys.argv[1:4]
groups = {}
name = None
out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True,
                     text=True, check=True).stdout
for line in out.splitlines():
    s = line.strip()
    if not s or s.startswith("#"):
        continue
    if not line.startswith(" "):
        name = s
        groups[name] = []
    elif name:
        groups[name].append(s)

def expand(item, seen=()):
    if not item.startswith("@"):
        return {item}
    if item not in groups:
        sys.exit(f"the unit names {item}, which systemd-analyze does not know")
    calls = set()
    for x in groups[item]:
        if x not in seen:
            calls |= expand(x, seen + (item,))
    return calls

allow, deny = set(), set()
families = None
for line in open(unit):
    m = re.match(r"SystemCallFilter=(~?)(.*)", line.strip())
    if m:
        target = deny if m.group(1) else allow
        for item in m.group(2).split():
            target |= expand(item)
    m = re.match(r"RestrictAddressFamilies=(.*)", line.strip())
    if m:
        families = set(m.group(1).split())
if not allow:
    sys.exit("the unit has no SystemCallFilter= allow list")
if not families:
    sys.exit("the unit has no RestrictAddressFamilies=")
permitted = allow - deny

made, bad_families = set(), set()
started = False
call = re.compile(r"^\d+\s+(?:<\.\.\. )?([a-z0-9_]+)(\(| resumed>)")
for line in open(trace):
    if not started:
        started = line.split(None, 1)[1].startswith(f'execve("{daemon}"')
        continue
    m = call.match(line)
    if not m:
        continue
    made.add(m.group(1))
    s = re.search(r"\bsocket\((AF_[A-Z0-9]+)", line)
    if s and s.group(1) not in families:
        bad_families.add(s.group(1))
if not started:
    sys.exit(f"the trace has no execve of {daemon}")
refused = sorted(made - permitted)
if refused:
    sys.exit("the daemon made system calls the unit's SystemCallFilter= refuses: "
             + " ".join(refused))
if bad_families:
    sys.exit("the daemon made sockets RestrictAddressFamilies= refuses: "
             + " ".join(sorted(bad_families)))
print(f"{len(made)} distinct system calls, all allowed by the unit")
EOF
finish service_sandbox
