#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package installs offline with Debian's tools, and the installed
# package finds the installed library:
#  - pip install --no-build-isolation into a virtual environment (what a
#    user does), from a copy of python/ (pip builds in the tree it is given);
#  - python3 -m build --no-isolation --wheel and python3 -m installer (what
#    Debian's pybuild does for python3-bufbroker);
#  - each carries py.typed and the version of the CMake project;
#  - the installed package, with neither PYTHONPATH nor $BUFBROKER_LIBRARY,
#    loads libbufbroker.so.0 through the dynamic loader's search path, and
#    with $BUFBROKER_LIBRARY the library it names, not the loader's; and it
#    runs examples/python/tensors.py against a daemon.
#
# ctest sets BUFBROKERD, BB_SOURCE_DIR and BB_BUILD_DIR.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test python_package
need_vars -x "an executable" BUFBROKERD
need_vars -d "a directory" BB_SOURCE_DIR BB_BUILD_DIR
PY=/usr/bin/python3
[[ -x $PY ]] || fail "$PY is missing: apt-get install python3"
for mod in pip build installer setuptools wheel venv numpy; do
	"$PY" -c "import $mod" 2>/dev/null ||
		fail "Python's $mod is needed: apt-get install python3-$mod (scripts/lib.sh lists the packages)"
done
unset PYTHONPATH BUFBROKER_LIBRARY BUFBROKER_SOCKET
export PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
LIB=$BB_BUILD_DIR/libbufbroker.so.0
[[ -f $LIB ]] || fail "no $LIB"
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:[A-Z]*=//p' "$BB_BUILD_DIR/CMakeCache.txt")
[[ -n $version ]] || fail "no CMAKE_PROJECT_VERSION in $BB_BUILD_DIR/CMakeCache.txt"

# copy_source DEST: python/ without the byproducts of earlier builds.
copy_source() {
	mkdir -p "$1"
	(cd "$BB_SOURCE_DIR/python" && tar --exclude=__pycache__ --exclude=build --exclude='*.egg-info' -cf - .) |
		tar -xf - -C "$1"
}

STEP="pip install --no-build-isolation into a venv"
copy_source "$DIR/src-pip"
"$PY" -m venv --without-pip --system-site-packages "$DIR/venv"
VPY=$DIR/venv/bin/python
"$VPY" -m pip install -q --no-build-isolation --no-deps "$DIR/src-pip" >"$DIR/pip.out" 2>&1 ||
	{ cat "$DIR/pip.out"; fail "pip install exited non-zero"; }
# From outside both trees, so that only the installed copy is importable.
got=$(cd "$DIR" && "$VPY" -c '
import importlib.metadata as md, pathlib, bufbroker
p = pathlib.Path(bufbroker.__file__).parent
print(p, bufbroker.__version__, md.version("bufbroker"), (p / "py.typed").is_file())')
read -r where pkgver distver typed <<<"$got"
[[ $where == "$DIR/venv/lib/"*"/site-packages/bufbroker" ]] || fail "bufbroker imported from $where, not the venv"
[[ $pkgver == "$version" && $distver == "$version" ]] ||
	fail "bufbroker $pkgver (distribution $distver), but the CMake project is $version"
[[ $typed == True ]] || fail "the installed package has no py.typed"

STEP="wheel and installer, as pybuild does"
copy_source "$DIR/src-wheel"
"$PY" -m build --no-isolation --wheel --outdir "$DIR/dist" "$DIR/src-wheel" >"$DIR/build.out" 2>&1 ||
	{ cat "$DIR/build.out"; fail "python3 -m build exited non-zero"; }
wheels=("$DIR"/dist/bufbroker-"$version"-py3-none-any.whl)
[[ -f ${wheels[0]} ]] || fail "no wheel bufbroker-$version-py3-none-any.whl in: $(ls "$DIR/dist")"
"$PY" - "${wheels[0]}" <<'PYEOF' || fail "the wheel's contents are wrong"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
want = {f"bufbroker/{n}" for n in ("__init__.py", "_native.py", "_dlpack.py", "client.py", "errors.py", "py.typed")}
missing = want - names
extra = {n for n in names if not n.startswith(("bufbroker/", "bufbroker-"))}
if missing or extra:
    sys.exit(f"missing {sorted(missing)}, extra {sorted(extra)}")
PYEOF
"$PY" -m installer --destdir "$DIR/root" "${wheels[0]}"
typed=$(find "$DIR/root" -path '*/bufbroker/py.typed' -print -quit)
[[ -n $typed ]] || fail "installer put no bufbroker/py.typed under $DIR/root"

# A sanitizer build's library needs its runtime first in the interpreter.
# (ldd's output whole first: awk's exit would SIGPIPE it, and pipefail fail
# the assignment.)
libs=$(ldd "$LIB")
asan=$(awk '/libasan\.so/ { print $3; exit }' <<<"$libs")

STEP="start the daemon"
start_bufbrokerd --socket "$SOCK" --token-ttl 120000

STEP="the installed package finds libbufbroker.so.0 through the loader"
out=$(cd "$DIR" && env ${asan:+LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0} LD_LIBRARY_PATH="$BB_BUILD_DIR" \
	timeout 60 "$VPY" -c '
import bufbroker, bufbroker._native as n
bufbroker.Client(__import__("sys").argv[1]).close()
print(n.lib()._name)' "$SOCK") || fail "the installed package could not connect (exit $?)"
[[ $out == libbufbroker.so.0 ]] || fail "it loaded $out, not libbufbroker.so.0 by its soname"
STEP="\$BUFBROKER_LIBRARY overrides the loader's search"
mkdir "$DIR/elsewhere"
cp "$LIB" "$DIR/elsewhere/libbb-copy.so"
out=$(cd "$DIR" && env ${asan:+LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0} LD_LIBRARY_PATH="$BB_BUILD_DIR" \
	BUFBROKER_LIBRARY="$DIR/elsewhere/libbb-copy.so" timeout 60 "$VPY" -c '
import bufbroker, bufbroker._native as n
bufbroker.Client(__import__("sys").argv[1]).close()
print(n.lib()._name)' "$SOCK") || fail "the installed package could not connect (exit $?)"
[[ $out == "$DIR/elsewhere/libbb-copy.so" ]] || fail "it loaded $out, not \$BUFBROKER_LIBRARY"

STEP="examples/python/tensors.py with the installed package"
out=$(cd "$DIR" && env ${asan:+LD_PRELOAD=$asan ASAN_OPTIONS=detect_leaks=0} LD_LIBRARY_PATH="$BB_BUILD_DIR" \
	timeout 60 "$VPY" "$BB_SOURCE_DIR/examples/python/tensors.py" --socket "$SOCK" --rows 64 --cols 96) ||
	fail "examples/python/tensors.py exited $?"
[[ $out == "verified 64x96 float32" ]] || fail "tensors.py printed: $out"

STEP="SIGTERM"
sigterm_daemon
[[ $DAEMON_RC -eq 0 ]] || fail "bufbrokerd exited $DAEMON_RC after SIGTERM, want 0"
grep -Eq "Sanitizer|runtime error:" "$LOG" && fail "the daemon's log has a sanitizer report"
finish python_package.sh
