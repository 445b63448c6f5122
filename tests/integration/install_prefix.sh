#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `cmake --install BUILD --prefix DIR` writes nothing outside DIR: not the
# configuration under /etc or <configured prefix>/etc, not the systemd
# units, not the linker cache. Every file system change the install makes
# (strace: each successful open for writing, mkdir, rename, unlink, link,
# chmod, chown, utime... of it and of every process it starts) must be
# under DIR, a fresh directory, or be the install manifest CMake keeps in
# the build tree. Then what a user expects is under DIR: the daemon, the
# library, the header, the units and the example configuration.
#
# ctest sets BB_BUILD_DIR. Runs as any user; needs strace (skips without it,
# fails under CI).
set -euo pipefail
# shellcheck source=tests/integration/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

init_test install-prefix
need_vars -d "a build tree" BB_BUILD_DIR
command -v strace >/dev/null || skip "strace is needed to see what cmake --install writes"
find_python "read strace's output"

STEP="cmake --install --prefix"
PREFIX=$DIR/prefix
BUILD=$(cd "$BB_BUILD_DIR" && pwd -P)
mkdir "$DIR/cwd"
# An empty working directory inside DIR, no DESTDIR: the install as a user
# types it.
(cd "$DIR/cwd" && env -u DESTDIR strace -f -qq -y -s 4096 -o "$DIR/trace" \
	-e trace=%file,%desc -e signal=none \
	cmake --install "$BUILD" --prefix "$PREFIX") >"$DIR/install.log" 2>&1 ||
	{ cat "$DIR/install.log" >&2; fail "cmake --install --prefix $PREFIX"; }
[[ -s $DIR/trace ]] || fail "strace recorded nothing"

# The paths changed: successful calls that write, with a relative path
# resolved against the directory its descriptor names (strace -y).
"$PY" - "$DIR/trace" >"$DIR/written" <<'PY'
import os, re, sys

WRITE_CALLS = {
    "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat",
    "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmodat",
    "chown", "lchown", "fchownat", "truncate", "utime", "utimes", "utimensat",
    "futimesat", "mknod", "mknodat", "setxattr", "lsetxattr", "removexattr",
    "lremovexattr", "creat",
}
OPEN_CALLS = {"open", "openat", "openat2"}
WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")
line_re = re.compile(r"^\d+\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
# An argument: a descriptor with its path ("3</a/b>", "AT_FDCWD</a>") or a
# quoted string.
arg_re = re.compile(r'(?:(?:AT_FDCWD|\d+)<([^>]*)>|"((?:[^"\\]|\\.)*)")')

for line in open(sys.argv[1], errors="replace"):
    m = line_re.match(line)
    if not m or int(m.group(3)) < 0:
        continue
    call, args = m.group(1), m.group(2)
    if call in OPEN_CALLS:
        if not any(f in args for f in WRITE_FLAGS):
            continue
    elif call not in WRITE_CALLS:
        continue
    base = None
    # A link's target (symlink's first argument, link's) is read, not written.
    skip = 1 if call in ("symlink", "symlinkat", "link", "linkat") else 0
    for a in arg_re.finditer(args):
        if a.group(1) is not None:
            base = a.group(1)
            continue
        path = a.group(2)
        if skip:
            skip -= 1
            base = None
            continue
        if not path.startswith("/"):
            path = os.path.join(base or "<unknown cwd>", path)
        print(call, os.path.normpath(path))
        base = None
PY
STEP="what the install wrote"
[[ -s $DIR/written ]] || fail "the trace shows no file written (strace output not understood)"

while read -r call path; do
	case "$path" in
	"$PREFIX" | "$PREFIX"/*) ;;
	"$BUILD"/install_manifest*.txt) ;; # CMake's record of what it installed
	*) echo "$call $path" >>"$DIR/outside" ;;
	esac
done <"$DIR/written"
if [[ -s $DIR/outside ]]; then
	echo "cmake --install --prefix $PREFIX changed these outside it:" >&2
	sort -u "$DIR/outside" >&2
	fail "the install writes outside its prefix"
fi

for f in sbin/bufbrokerd bin/bufbroker include/bufbroker/bufbroker.h \
	etc/bufbroker/bufbrokerd.conf lib/systemd/system/bufbrokerd.service \
	lib/systemd/system/bufbrokerd.socket lib/sysusers.d/bufbroker.conf; do
	[[ -e $PREFIX/$f ]] || fail "$f is not under the prefix"
done
[[ -n $(find "$PREFIX" -name 'libbufbroker.so.0' -print -quit) ]] ||
	fail "libbufbroker.so.0 is not under the prefix"
echo "PASS: cmake --install --prefix wrote $(sort -u "$DIR/written" | wc -l) paths, all under the prefix"
