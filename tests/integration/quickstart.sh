#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's quick start works as pasted by root in a fresh Debian
# container (no sudo there) and by a user with sudo: it is two commands,
# neither starts with sudo, each runs a script of the repository; and the
# scripts' installer (scripts/lib.sh, bb_ensure_packages) calls apt-get
# directly as root, never sudo, through sudo as another user, and nothing
# at all when every package is there; a user without sudo is told what to
# run as root.
#
# The installer runs against stand-ins on a PATH of their own: dpkg-query
# (one package missing, or none), apt-get (records its arguments), id (the
# uid under test) and, where the case has it, sudo (records its arguments,
# then runs them). Nothing is installed. ctest sets BB_SOURCE_DIR.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test quickstart
LOG=
[[ -n ${BB_SOURCE_DIR:-} && -f $BB_SOURCE_DIR/README.md && -f $BB_SOURCE_DIR/scripts/lib.sh ]] ||
	fail "\$BB_SOURCE_DIR must be the repository (ctest sets it)"

# ---- the README ---------------------------------------------------------------------
STEP="README quick start"
# The indented command lines of the "Quick start" section.
mapfile -t cmds < <(awk '/^## /{q = ($0 == "## Quick start")} q && /^    [^ ]/{sub(/^    /, ""); print}' \
	"$BB_SOURCE_DIR/README.md")
[[ ${#cmds[@]} -eq 2 ]] || fail "the quick start has ${#cmds[@]} commands, want 2: ${cmds[*]}"
for c in "${cmds[@]}"; do
	[[ $c != sudo* ]] || fail "'$c' needs sudo, which a fresh Debian container lacks"
	[[ $c =~ ^\./scripts/[a-z-]+\.sh$ ]] || fail "'$c' is not ./scripts/NAME.sh"
	[[ -x $BB_SOURCE_DIR/${c#./} ]] || fail "'$c': ${c#./} is not an executable script"
	grep -q 'bb_ensure_packages' "$BB_SOURCE_DIR/${c#./}" ||
		fail "'$c' does not install its packages with bb_ensure_packages"
done

# ---- the installer --------------------------------------------------------------------
# fakebin: the stand-ins, plus links to the few real tools lib.sh uses, so
# that PATH=$FAKE finds no sudo unless a case puts one there.
FAKE=$DIR/bin
mkdir "$FAKE"
for t in dirname env; do
	ln -s "$(command -v "$t")" "$FAKE/$t"
done
CALLS=$DIR/calls
cat >"$FAKE/dpkg-query" <<'EOF'
#!/bin/bash
# The last argument is the package; $FAKE_MISSING is not installed.
pkg=${!#}
[ "$pkg" = "$FAKE_MISSING" ] && exit 1
printf installed
EOF
cat >"$FAKE/apt-get" <<'EOF'
#!/bin/bash
echo "apt-get $* (DEBIAN_FRONTEND=${DEBIAN_FRONTEND:-})" >>"$CALLS"
EOF
cat >"$FAKE/id" <<'EOF'
#!/bin/bash
[ "$1" = -u ] && { echo "$FAKE_UID"; exit 0; }
exit 1
EOF
SUDO=$DIR/sudo
cat >"$SUDO" <<'EOF'
#!/bin/bash
echo "sudo $*" >>"$CALLS"
exec "$@"
EOF
chmod +x "$FAKE"/dpkg-query "$FAKE"/apt-get "$FAKE"/id "$SUDO"

# ensure UID MISSING SUDO: bb_ensure_packages as uid UID with package MISSING
# not installed ("" for none), sudo on PATH when SUDO is "sudo"; its output
# in OUT, its status in RC, what it called in CALLS.
ensure() {
	rm -f "$CALLS" "$FAKE/sudo"
	touch "$CALLS"
	[[ $3 == sudo ]] && ln -s "$SUDO" "$FAKE/sudo"
	RC=0
	OUT=$(PATH=$FAKE FAKE_UID=$1 FAKE_MISSING=$2 CALLS=$CALLS /bin/bash -c \
		'source "$1/scripts/lib.sh" && bb_ensure_packages' _ "$BB_SOURCE_DIR" 2>&1) || RC=$?
}

# succeeded: bb_ensure_packages exited 0. called LINE: it ran LINE.
succeeded() { [[ $RC -eq 0 ]] || fail "bb_ensure_packages exited $RC: $OUT"; }
called() { grep -Fqx "$1" "$CALLS" || fail "it did not run '$1' but: $(cat "$CALLS")"; }
APT_INSTALL="apt-get install -y -q --no-install-recommends valgrind"

STEP="root without sudo installs with apt-get"
ensure 0 valgrind none
succeeded
called "apt-get update -q (DEBIAN_FRONTEND=noninteractive)"
called "$APT_INSTALL (DEBIAN_FRONTEND=noninteractive)"

STEP="root with sudo does not use it"
ensure 0 valgrind sudo
succeeded
grep -q '^sudo' "$CALLS" && fail "root called sudo: $(cat "$CALLS")"
called "$APT_INSTALL (DEBIAN_FRONTEND=noninteractive)"

STEP="a user with sudo installs through it"
ensure 1000 valgrind sudo
succeeded
called "sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q"
called "sudo env DEBIAN_FRONTEND=noninteractive $APT_INSTALL"

STEP="a user without sudo is told what to run"
ensure 1000 valgrind none
[[ $RC -ne 0 ]] || fail "bb_ensure_packages succeeded without a way to install: $OUT"
[[ ! -s $CALLS ]] || fail "it called something: $(cat "$CALLS")"
grep -q 'install them as root: apt-get install valgrind' <<<"$OUT" ||
	fail "it does not say what to run as root: $OUT"

STEP="nothing missing: no apt-get, no sudo"
for uid in 0 1000; do
	ensure "$uid" "" sudo
	succeeded
	[[ ! -s $CALLS ]] || fail "uid $uid called something with nothing missing: $(cat "$CALLS")"
done
finish quickstart
