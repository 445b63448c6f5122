#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages, end to end: build them (debhelper, `dpkg-buildpackage
# -b` in a copy of the tree: debian/), check them with lintian (no error, no
# warning) and their binaries for Debian's hardening (relro, bindnow, PIE,
# stack protector, fortify), install all four with dpkg, check what they put
# where and that the bufbroker user and group exist, serve on a temporary socket
# with the installed /usr/sbin/bufbrokerd, build the example producer and
# consumer against the installed libbufbroker-dev (pkg-config, and CMake's
# find_package) and pass a buffer between them and from the installed
# Python module to them, stop the daemon, then remove and purge the packages
# and check that their files are gone.
#
# Usage: sudo ./scripts/package-test.sh
# The .debs are left in build-pkg (BUFBROKER_BUILD_DIR=DIR: DIR-pkg).
#
# Root only (dpkg -i). It leaves the system as it found it: the packages are
# purged and the user and group are deleted if this script created them,
# also on failure.
# Exits 0 on success, 1 on failure, 77 (after a "SKIP" line) when it cannot
# run here without changing the system: not root, or bufbroker packages or
# files of another install already in place.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT"

PKGS=(libbufbroker0 bufbroker libbufbroker-dev python3-bufbroker)
BUILD="$BB_BUILD_DIR-pkg"

skip()
{
	printf 'SKIP: package-test: %s\n' "$*"
	exit 77
}

if [ "$(id -u)" -ne 0 ]; then
	skip "needs root (it installs the packages with dpkg -i)"
fi
# A package of ours already there (a user's, or one a killed run left) is
# not ours to replace or remove.
for p in "${PKGS[@]}"; do
	if [ -n "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)" ]; then
		skip "package $p is already on this system; remove it first: dpkg --purge ${PKGS[*]}"
	fi
done

TMP="$(mktemp -d /tmp/bb-pkgtest-XXXXXX)"
DPID=
GROUP_CREATED=0
USER_CREATED=0

# Undoes whatever of the install happened; runs on every exit.
cleanup()
{
	local rc=$? p
	local -a installed=()
	set +e
	if [ -n "$DPID" ] && kill -0 "$DPID" 2>/dev/null; then
		kill -KILL "$DPID" 2>/dev/null
		wait "$DPID" 2>/dev/null
	fi
	for p in "${PKGS[@]}"; do
		if [ -n "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" ]; then
			installed+=("$p")
		fi
	done
	if [ "${#installed[@]}" -gt 0 ]; then
		bb_log "package-test: cleanup: purging ${installed[*]}"
		dpkg --purge "${installed[@]}" >/dev/null
	fi
	if [ "$USER_CREATED" = 1 ] && getent passwd bufbroker >/dev/null; then
		userdel bufbroker
	fi
	if [ "$GROUP_CREATED" = 1 ] && getent group bufbroker >/dev/null; then
		groupdel bufbroker
	fi
	rm -rf "$TMP"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail()
{
	printf 'FAIL: package-test: %s\n' "$*" >&2
	if [ -s "$TMP/daemon.log" ]; then
		tail -n 20 "$TMP/daemon.log" >&2
	fi
	exit 1
}

# is_owned PATH: whether a package lists PATH (dpkg -S matches patterns;
# fixed strings are enough for these paths).
is_owned()
{
	dpkg -S "$1" >/dev/null 2>&1
}

# ---- build ----------------------------------------------------------------
# In a copy of the tree (what git tracks, and new files it does not ignore),
# so that dpkg-buildpackage writes nothing into the checkout: debhelper
# builds in obj-*/ and debian/, and puts the .debs next to the source.
VERSION="$(dpkg-parsechangelog -l debian/changelog -S Version)"
UPSTREAM="${VERSION%-*}"
SRC="$TMP/src/bufbroker-$UPSTREAM"
mkdir -p "$SRC"
if git rev-parse --git-dir >/dev/null 2>&1; then
	git ls-files -z --cached --others --exclude-standard | grep -zv '^build' |
		xargs -0 cp -P --parents -t "$SRC"
else
	tar -c --exclude='./build*' --exclude=./.git . | tar -x -C "$SRC"
fi
[ -x "$SRC/debian/rules" ] || fail "copying the tree to $SRC (git ls-files)"
bb_log "package-test: dpkg-buildpackage -b ($VERSION)"
(cd "$SRC" && dpkg-buildpackage -b -uc -us -j"$(nproc)" >"$TMP/build.log" 2>&1) ||
	{ tail -n 40 "$TMP/build.log" >&2; fail "dpkg-buildpackage -b (full log: kept in $BUILD/build.log)"; }
mkdir -p "$BUILD"
rm -f "$BUILD"/*.deb
DEBS=()
for p in "${PKGS[@]}"; do
	f="$(echo "$TMP/src/${p}_${VERSION}_"*.deb)"
	[ -f "$f" ] || fail "dpkg-buildpackage made no $p package"
	cp "$f" "$BUILD/"
	DEBS+=("$f")
done
cp "$TMP/build.log" "$BUILD/build.log"
[ "$(sed -n 's/^project(bufbroker VERSION \([^ ]*\) .*/\1/p' CMakeLists.txt)" = "$UPSTREAM" ] ||
	fail "debian/changelog's version $VERSION is not CMakeLists.txt's project version"

# ---- lintian: no error, no warning -----------------------------------------
# Informational tags are shown, not fatal. An override lives in
# debian/PACKAGE.lintian-overrides with a comment saying why it is right.
bb_log "package-test: lintian ${DEBS[*]##*/}"
lintian --display-info "${DEBS[@]}" >"$TMP/lintian.log" 2>&1 || true
cat "$TMP/lintian.log"
if grep -qE '^[EW]: ' "$TMP/lintian.log"; then
	fail "lintian reports errors or warnings (above)"
fi
grep -qE '^(E|W|I|N): |^$|running with root privileges' "$TMP/lintian.log" ||
	[ ! -s "$TMP/lintian.log" ] || fail "lintian did not run: $(head -n 3 "$TMP/lintian.log")"

# ---- hardening: every ELF file the packages ship -----------------------------
# What dpkg-buildflags' hardening=+all gives (hardening-check's criteria):
# full RELRO (a GNU_RELRO segment and BIND_NOW), position-independent
# executables, -fstack-protector-strong (a call to __stack_chk_fail) and
# _FORTIFY_SOURCE (calls to the checked *_chk variants of libc functions).
for f in "${DEBS[@]}"; do
	dpkg-deb -x "$f" "$TMP/contents"
done
nelf=0
while IFS= read -r f; do
	[ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
	nelf=$((nelf + 1))
	name="${f#"$TMP/contents"}"
	readelf -lW "$f" >"$TMP/readelf-l.out"
	grep -q GNU_RELRO "$TMP/readelf-l.out" || fail "$name: no RELRO (-Wl,-z,relro)"
	readelf -dW "$f" >"$TMP/readelf-d.out"
	grep -qE '\(FLAGS\).*BIND_NOW|\(FLAGS_1\).*NOW' "$TMP/readelf-d.out" ||
		fail "$name: not bound immediately (-Wl,-z,now)"
	case "$name" in
	*.so.*) ;;
	*)
		readelf -hW "$f" >"$TMP/readelf-h.out"
		grep -qE '^ *Type: *DYN' "$TMP/readelf-h.out" || fail "$name: not a PIE"
		;;
	esac
	nm -D "$f" >"$TMP/nm.out"
	grep -q ' U __stack_chk_fail' "$TMP/nm.out" || fail "$name: no stack protector"
	grep -qE ' U __[a-z]+_chk(@|$)' "$TMP/nm.out" || fail "$name: no fortified function (_FORTIFY_SOURCE)"
done < <(find "$TMP/contents" -type f \( -perm -u+x -o -name '*.so*' \))
[ "$nelf" -ge 3 ] || fail "found $nelf ELF files in the packages, expected the daemon, the CLI and the library"

# Files of another install (`cmake --install` to /usr, say) at the packages'
# paths would be overwritten by dpkg -i and deleted by dpkg -r.
while IFS= read -r f; do
	f="/${f#./}"
	if { [ -e "$f" ] || [ -L "$f" ]; } && ! is_owned "$f"; then
		skip "$f is already there (not from a package); remove the other install first"
	fi
done < <(cd "$TMP/contents" && find . ! -type d)

# ---- install -------------------------------------------------------------
getent group bufbroker >/dev/null || GROUP_CREATED=1
getent passwd bufbroker >/dev/null || USER_CREATED=1
bb_log "package-test: dpkg -i ${DEBS[*]##*/}"
if ! dpkg -i "${DEBS[@]}" >"$TMP/dpkg-i.log" 2>&1; then
	cat "$TMP/dpkg-i.log" >&2
	# Only missing dependencies should get here; lib.sh installs them all.
	bb_warn "dpkg -i failed; trying apt-get install -f (what it pulls in stays installed)"
	DEBIAN_FRONTEND=noninteractive apt-get install -f -y -q --no-install-recommends ||
		fail "dpkg -i, then apt-get install -f"
fi
for p in "${PKGS[@]}"; do
	st="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
	[ "$st" = "install ok installed" ] || fail "$p is '$st' after dpkg -i"
done

# ---- what is installed where ---------------------------------------------
getent group bufbroker >/dev/null || fail "the bufbroker group was not created"
getent passwd bufbroker >/dev/null || fail "the bufbroker user was not created"
[ "$(id -gn bufbroker)" = bufbroker ] || fail "the bufbroker user's group is $(id -gn bufbroker)"
MA="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)"
declare -A expect=(
	[libbufbroker0]="/usr/lib/$MA/libbufbroker.so.0"
	[bufbroker]="/usr/sbin/bufbrokerd /usr/bin/bufbroker
		/lib/systemd/system/bufbrokerd.service
		/lib/systemd/system/bufbrokerd.socket
		/usr/lib/sysusers.d/bufbroker.conf"
	[libbufbroker-dev]="/usr/include/bufbroker/bufbroker.h
		/usr/lib/$MA/libbufbroker.a /usr/lib/$MA/libbufbroker.so
		/usr/lib/$MA/pkgconfig/bufbroker.pc
		/usr/lib/$MA/cmake/bufbroker/bufbrokerConfig.cmake
		/usr/lib/$MA/cmake/bufbroker/bufbrokerConfigVersion.cmake"
	[python3-bufbroker]="/usr/lib/python3/dist-packages/bufbroker/__init__.py
		/usr/lib/python3/dist-packages/bufbroker-$UPSTREAM.dist-info/METADATA"
)
# Every package: the copyright file and the Debian changelog.
for p in "${PKGS[@]}"; do
	expect[$p]+=" /usr/share/doc/$p/copyright /usr/share/doc/$p/changelog.Debian.gz"
done
# What the source tree has, the package must ship.
if [ -f systemd/bufbrokerd.conf ]; then
	expect[bufbroker]+=" /etc/bufbroker/bufbrokerd.conf"
fi
sources="$(git ls-files --cached --others --exclude-standard 2>/dev/null || true)"
if grep -q 'bufbrokerd\.8' <<<"$sources"; then
	expect[bufbroker]+=" /usr/share/man/man8/bufbrokerd.8.gz|/usr/share/man/man8/bufbrokerd.8"
fi
if grep -q 'bufbroker\.1' <<<"$sources"; then
	expect[bufbroker]+=" /usr/share/man/man1/bufbroker.1.gz|/usr/share/man/man1/bufbroker.1"
fi
for p in "${PKGS[@]}"; do
	dpkg -L "$p" >"$TMP/$p.list"
	for want in ${expect[$p]}; do
		found=0
		IFS='|' read -ra alts <<<"$want"
		for f in "${alts[@]}"; do
			if grep -qxF "$f" "$TMP/$p.list" && { [ -e "$f" ] || [ -L "$f" ]; }; then
				found=1
			fi
		done
		[ "$found" = 1 ] || fail "$p does not install ${want//|/ or }"
	done
done
if [ -f systemd/bufbrokerd.conf ]; then
	dpkg-query -W -f='${Conffiles}\n' bufbroker | grep ' /etc/bufbroker/bufbrokerd.conf ' >/dev/null ||
		fail "/etc/bufbroker/bufbrokerd.conf is not a conffile"
fi
exec_start="$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' /lib/systemd/system/bufbrokerd.service)"
[ -x "$exec_start" ] || fail "the service's ExecStart=$exec_start is not an installed program"
if readelf -d /usr/sbin/bufbrokerd /usr/bin/bufbroker "/usr/lib/$MA/libbufbroker.so.0" |
	grep -E 'RPATH|RUNPATH' >/dev/null; then
	fail "an installed binary carries an RPATH into the build tree"
fi
# (/lib is /usr/lib on merged-/usr systems.) No `grep -q` after a pipe in
# this script: it exits at its first match, the writer then dies of SIGPIPE,
# and pipefail turns the match into a failure (it did: "bb-consumer does not
# load the installed libbufbroker.so.0" with the right ldd line).
ldconfig -p | grep -E "libbufbroker\.so\.0 .*=> (/usr)?/lib/$MA/libbufbroker\.so\.0\$" >/dev/null ||
	fail "libbufbroker.so.0 is not in the linker cache (the ldconfig trigger)"

# ---- the installed daemon serves -----------------------------------------
SOCK="$TMP/bb.sock"
bb_log "package-test: /usr/sbin/bufbrokerd --socket $SOCK"
/usr/sbin/bufbrokerd --socket "$SOCK" 2>"$TMP/daemon.log" &
DPID=$!
for _ in $(seq 100); do
	[ -S "$SOCK" ] && break
	kill -0 "$DPID" 2>/dev/null || break
	sleep 0.05
done
[ -S "$SOCK" ] || fail "the installed daemon did not start"
/usr/bin/bufbroker --socket "$SOCK" status >"$TMP/status.out" ||
	fail "the installed CLI: bufbroker status"

# ---- programs built against the installed packages ------------------------
# Nothing of the build tree: copies of the sources, the system's pkg-config
# and CMake search paths only.
unset PKG_CONFIG_PATH LD_LIBRARY_PATH CMAKE_PREFIX_PATH
mkdir -p "$TMP/src"
cp examples/producer.c examples/consumer.c "$TMP/src/"
bb_log "package-test: building the examples with pkg-config bufbroker"
[ "$(pkg-config --modversion bufbroker)" = "$UPSTREAM" ] ||
	fail "pkg-config bufbroker is not the installed version"
for ex in producer consumer; do
	# shellcheck disable=SC2046 # pkg-config's output is words
	cc -Wall -Wextra -Werror -o "$TMP/bb-$ex" "$TMP/src/$ex.c" \
		$(pkg-config --cflags --libs bufbroker) ||
		fail "building $ex.c with pkg-config bufbroker"
done
ldd "$TMP/bb-consumer" >"$TMP/ldd.out" 2>&1 || true
grep -qE "libbufbroker\.so\.0 => (/usr)?/lib/$MA/libbufbroker\.so\.0 " "$TMP/ldd.out" ||
	fail "bb-consumer does not load the installed libbufbroker.so.0: ldd says $(tr '\n\t' '  ' <"$TMP/ldd.out")"

bb_log "package-test: building the consumer with find_package(bufbroker)"
mkdir -p "$TMP/cm"
cp "$TMP/src/consumer.c" "$TMP/cm/"
cat >"$TMP/cm/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(consumer C)
find_package(bufbroker 0.1 REQUIRED)
add_executable(bb-consumer-cmake consumer.c)
target_link_libraries(bb-consumer-cmake PRIVATE bufbroker::bufbroker)
CM
{ cmake -S "$TMP/cm" -B "$TMP/cm/build" && cmake --build "$TMP/cm/build"; } >"$TMP/cm.log" 2>&1 ||
	{ cat "$TMP/cm.log" >&2; fail "building with find_package(bufbroker)"; }
grep -q "bufbroker_DIR:PATH=/usr/lib/$MA/cmake/bufbroker" "$TMP/cm/build/CMakeCache.txt" ||
	fail "find_package(bufbroker) did not find the installed package"

bb_log "package-test: producer -> consumer (pkg-config build), producer -> consumer (CMake build)"
tok="$("$TMP/bb-producer" --socket "$SOCK" --name pkgtest-1 --pattern 7)" ||
	fail "bb-producer (pkg-config build)"
"$TMP/bb-consumer" --socket "$SOCK" --pattern 7 "$tok" || fail "bb-consumer (pkg-config build)"
tok="$("$TMP/bb-producer" --socket "$SOCK" --name pkgtest-2 --pattern 9)" ||
	fail "bb-producer (pkg-config build), second run"
"$TMP/cm/build/bb-consumer-cmake" --socket "$SOCK" --pattern 9 "$tok" ||
	fail "bb-consumer (find_package build)"

# The installed Python module (python3-bufbroker), found by Debian's python3
# on its own (no PYTHONPATH, run from /) and loading the installed library.
bb_log "package-test: Python producer (python3-bufbroker) -> consumer"
cp examples/python/producer.py "$TMP/src/producer.py"
modpath="$(cd / && env -u PYTHONPATH -u BUFBROKER_LIBRARY /usr/bin/python3 -c 'import bufbroker; print(bufbroker.__file__)')" ||
	fail "python3 cannot import the installed bufbroker"
[ "$modpath" = /usr/lib/python3/dist-packages/bufbroker/__init__.py ] ||
	fail "python3 imports bufbroker from $modpath, not from python3-bufbroker"
tok="$(cd / && env -u PYTHONPATH -u BUFBROKER_LIBRARY /usr/bin/python3 "$TMP/src/producer.py" \
	--socket "$SOCK" --name pkgtest-3 --size 65536 --pattern 5)" ||
	fail "the Python producer with the installed module"
"$TMP/bb-consumer" --socket "$SOCK" --size 65536 --pattern 5 "$tok" ||
	fail "bb-consumer of the Python producer's buffer"
/usr/bin/bufbroker --socket "$SOCK" --json ls >"$TMP/ls.json" || fail "the installed CLI: bufbroker ls"
if grep -q pkgtest "$TMP/ls.json"; then
	fail "buffers left behind: $(cat "$TMP/ls.json")"
fi

kill -TERM "$DPID"
rc=0
wait "$DPID" || rc=$?
DPID=
[ "$rc" -eq 0 ] || fail "the installed daemon exited $rc on SIGTERM"

# ---- remove, purge, and nothing left ---------------------------------------
bb_log "package-test: dpkg -r, dpkg --purge"
dpkg -r "${PKGS[@]}" >"$TMP/dpkg-r.log" 2>&1 ||
	{ cat "$TMP/dpkg-r.log" >&2; fail "dpkg -r"; }
for p in "${PKGS[@]}"; do
	while IFS= read -r f; do
		if [ -d "$f" ]; then
			continue # shared directories (/usr/lib/...) stay
		fi
		case "$f" in
		/etc/*) ;; # conffiles stay until purge
		*) if [ -e "$f" ] || [ -L "$f" ]; then fail "$f is still there after dpkg -r $p"; fi ;;
		esac
	done <"$TMP/$p.list"
done
dpkg --purge "${PKGS[@]}" >"$TMP/dpkg-purge.log" 2>&1 ||
	{ cat "$TMP/dpkg-purge.log" >&2; fail "dpkg --purge"; }
for p in "${PKGS[@]}"; do
	[ -z "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)" ] ||
		fail "dpkg still knows $p after --purge"
	while IFS= read -r f; do
		if [ ! -d "$f" ] && { [ -e "$f" ] || [ -L "$f" ]; }; then
			fail "$f is still there after dpkg --purge $p"
		fi
	done <"$TMP/$p.list"
done
[ ! -e /etc/bufbroker ] || fail "/etc/bufbroker is still there after dpkg --purge"
if ldconfig -p | grep 'libbufbroker\.so\.0 ' >/dev/null; then
	fail "libbufbroker.so.0 is still in the linker cache after purge"
fi

echo "PASS: package-test: ${DEBS[*]##*/} built, installed, served, built against, purged"
