#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What `cmake --install` leaves is enough to build a program against the
# public API in both ways a user would: `pkg-config bufbroker` (shared
# library) and CMake's `find_package(bufbroker)` with bufbroker::bufbroker.
# Both programs then pass a buffer between two processes through a daemon.
# The installed libbufbroker.so.0 exports bb_* names only.
#
# ctest sets BB_SOURCE_DIR, BB_BUILD_DIR and BUFBROKERD.
set -euo pipefail

DIR=$(mktemp -d /tmp/bbt-install-XXXXXX)
# DESTDIR staging, as a distribution package does: every file lands under
# $DIR (a rule with an absolute path, such as the config under /etc, too),
# so the test never writes outside its directory. The .pc file and the
# CMake package find their prefix from where they lie.
STAGE=$DIR/stage
configured=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$BB_BUILD_DIR/CMakeCache.txt")
PREFIX=$STAGE$configured
DPID=
cleanup() {
	if [[ -n $DPID ]] && kill -0 "$DPID" 2>/dev/null; then
		kill -KILL "$DPID" 2>/dev/null || true
	fi
	rm -rf "$DIR"
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*" >&2
	[[ -s $DIR/daemon.log ]] && tail -n 20 "$DIR/daemon.log" >&2
	exit 1
}

DESTDIR=$STAGE cmake --install "$BB_BUILD_DIR" >"$DIR/install.log" 2>&1 ||
	{ cat "$DIR/install.log" >&2; fail "cmake --install"; }
for f in include/bufbroker/bufbroker.h sbin/bufbrokerd bin/bufbroker; do
	[[ -e $PREFIX/$f ]] || fail "$f was not installed"
done
[[ -n $(find "$STAGE" -name bufbrokerd.conf -print -quit) ]] ||
	fail "the example config was not installed"
pcdir=$(dirname "$(find "$PREFIX" -name bufbroker.pc -print -quit)")
[[ -n $pcdir ]] || fail "bufbroker.pc was not installed"
libdir=$(dirname "$pcdir")
ls "$libdir"/libbufbroker.so.0 "$libdir"/libbufbroker.a >/dev/null || fail "libraries missing in $libdir"

# The installed shared library exports the public API and nothing else:
# not the client's internal bbc_* functions, not the common/ code, not the
# protobuf-c messages. Every name it defines for the dynamic linker starts
# with bb_.
command -v nm >/dev/null || fail "nm (binutils) is needed to list what libbufbroker.so.0 exports"
nm -D --defined-only "$libdir/libbufbroker.so.0" >"$DIR/exports" 2>"$DIR/nm.err" ||
	{ cat "$DIR/nm.err" >&2; fail "nm -D --defined-only $libdir/libbufbroker.so.0"; }
grep -q ' bb_connect$' "$DIR/exports" ||
	{ cat "$DIR/exports" >&2; fail "libbufbroker.so.0 does not export bb_connect"; }
awk '$NF !~ /^bb_/' "$DIR/exports" >"$DIR/offenders"
if [[ -s $DIR/offenders ]]; then
	echo "libbufbroker.so.0 exports names outside bb_*:" >&2
	cat "$DIR/offenders" >&2
	fail "the installed libbufbroker.so.0 exports $(wc -l <"$DIR/offenders") non-bb_ name(s)"
fi

# The installed header stands on its own: it points to no document or
# file of the source tree (a .md file, a path up or into the repository),
# which someone who installed the package does not have.
if grep -nE '[A-Za-z0-9_]+\.md\b|\.\./|(^|[^A-Za-z])(shared|docs|daemon|client|common)/' \
	"$PREFIX/include/bufbroker/bufbroker.h" >"$DIR/refs"; then
	cat "$DIR/refs" >&2
	fail "the installed bufbroker.h refers to files outside the install"
fi

# A client written only against the public header.
cat >"$DIR/app.c" <<'C'
#include <bufbroker/bufbroker.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	bb_client *c;
	bb_buf *b;
	bb_token t;
	void *p;
	bb_alloc_opts o = {.size = 65536, .kind = BB_HOST};
	if (argc != 2 || bb_connect(argv[1], &c) || bb_alloc(c, &o, &b) || bb_map(b, &p))
		return fprintf(stderr, "app: %s\n", bb_last_error()), 1;
	memset(p, 0x5a, o.size);
	if (bb_take(bb_ref(b), &t) || bb_set_ready(b))
		return fprintf(stderr, "app: %s\n", bb_last_error()), 1;
	pid_t pid = fork();
	if (pid == 0) {
		bb_client *c2;
		bb_buf *b2;
		bb_state st;
		unsigned char *q;
		if (bb_connect(argv[1], &c2) || bb_adopt(c2, &t, &b2) || bb_wait(b2, 5000, &st) ||
		    st != BB_READY || bb_map(b2, (void **)&q))
			_exit(2);
		for (size_t i = 0; i < o.size; i++)
			if (q[i] != 0x5a)
				_exit(3);
		bb_unref(b2);
		bb_disconnect(c2);
		_exit(0);
	}
	int status;
	waitpid(pid, &status, 0);
	bb_unref(b);
	bb_disconnect(c);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		return fprintf(stderr, "app: the consumer process failed\n"), 1;
	puts("app: ok");
	return 0;
}
C

# A sanitized build's library needs the sanitizer runtime in the program too.
SAN=
if grep -q '^BB_SANITIZE:BOOL=ON' "$BB_BUILD_DIR/CMakeCache.txt"; then
	SAN="-fsanitize=address,undefined"
fi

export PKG_CONFIG_PATH=$pcdir
cc $SAN -Wall -Werror -o "$DIR/app-pc" "$DIR/app.c" $(pkg-config --cflags --libs bufbroker) ||
	fail "building against pkg-config bufbroker"
cc $SAN -o "$DIR/app-pc-static" "$DIR/app.c" $(pkg-config --static --cflags bufbroker) \
	"$libdir/libbufbroker.a" $(pkg-config --static --libs-only-l bufbroker | sed 's/-lbufbroker//') ||
	fail "building statically against pkg-config bufbroker"

mkdir -p "$DIR/cm"
cp "$DIR/app.c" "$DIR/cm/"
cat >"$DIR/cm/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(app C)
find_package(bufbroker 0.1 REQUIRED)
add_executable(app-cmake app.c)
target_link_libraries(app-cmake PRIVATE bufbroker::bufbroker)
CM
cmake -S "$DIR/cm" -B "$DIR/cm/build" -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_C_FLAGS="$SAN" >"$DIR/cm.log" 2>&1 &&
	cmake --build "$DIR/cm/build" >>"$DIR/cm.log" 2>&1 ||
	{ cat "$DIR/cm.log" >&2; fail "building with find_package(bufbroker)"; }

"$PREFIX/sbin/bufbrokerd" --socket "$DIR/bb.sock" 2>"$DIR/daemon.log" &
DPID=$!
for _ in $(seq 50); do [[ -S $DIR/bb.sock ]] && break; sleep 0.1; done
[[ -S $DIR/bb.sock ]] || fail "the installed daemon did not start"

LD_LIBRARY_PATH=$libdir "$DIR/app-pc" "$DIR/bb.sock" || fail "the pkg-config build"
"$DIR/app-pc-static" "$DIR/bb.sock" || fail "the static build"
LD_LIBRARY_PATH=$libdir "$DIR/cm/build/app-cmake" "$DIR/bb.sock" || fail "the CMake build"

kill -TERM "$DPID"
rc=0
wait "$DPID" || rc=$?
DPID=
[[ $rc -eq 0 ]] || fail "the installed daemon exited $rc on SIGTERM"
echo "PASS: installed header, libraries, pkg-config and CMake package build working clients"
