#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every source file of the project carries the line
# "SPDX-License-Identifier: Apache-2.0" (LICENSE) near its top: C, headers,
# the .proto, shell, Python, CMake (CMakeLists.txt, *.cmake, *.cmake.in)
# and every other script that starts with "#!" (debian/rules, the
# maintainer scripts). The files are those git tracks plus new ones it does
# not ignore; the fuzz corpus and saved crashes are data.
#
# Usage: scripts/spdx.sh --check   list the files without it; exit 1 if any
#        scripts/spdx.sh --fix     add it as the first line (after a "#!"
#                                  line), in the file's comment syntax
#        scripts/spdx.sh --self-test   both, on a small tree of each kind
#                                  (ctest packaging.spdx_self_test)
set -euo pipefail

ID='SPDX-License-Identifier: Apache-2.0'
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# self_test: --check and --fix on a scratch git tree holding a file of each
# kind, with and without the line; exits 0 when every verdict is right.
self_test()
{
	local t out
	t="$(mktemp -d /tmp/bb-spdx-XXXXXX)"
	trap 'rm -rf "$t"' EXIT
	st_fail()
	{
		printf 'spdx self-test: FAIL: %s\n' "$*" >&2
		exit 1
	}
	mkdir -p "$t/scripts" "$t/sub" "$t/tests/fuzz/corpus" "$t/debian"
	cp "$ROOT/scripts/spdx.sh" "$t/scripts/spdx.sh"
	printf 'int x;\n' >"$t/a.c"
	printf '#pragma once\n' >"$t/sub/b.h"
	printf 'syntax = "proto3";\n' >"$t/c.proto"
	printf '#!/bin/sh\necho hi\n' >"$t/d.sh"
	printf '"""Doc."""\n' >"$t/e.py"
	printf 'project(x)\n' >"$t/sub/CMakeLists.txt"
	printf '@PACKAGE_INIT@\n' >"$t/f.cmake.in"
	printf '#!/usr/bin/make -f\n%%:\n\tdh $@\n' >"$t/debian/rules"
	printf '/* %s */\nint y;\n' "$ID" >"$t/done.c"
	printf 'notes\n' >"$t/README.md"
	printf '#!binary' >"$t/tests/fuzz/corpus/seed"
	(cd "$t" && git init -q && git add -A) || st_fail "git init"

	out="$(cd "$t" && scripts/spdx.sh --check 2>/dev/null)" && st_fail "--check passed a tree that lacks the line"
	for f in a.c sub/b.h c.proto d.sh e.py sub/CMakeLists.txt f.cmake.in debian/rules scripts/spdx.sh; do
		[ "$f" = scripts/spdx.sh ] && continue # a copy of this file: it has the line
		grep -qxF "$f" <<<"$out" || st_fail "--check did not list $f"
	done
	for f in done.c README.md tests/fuzz/corpus/seed scripts/spdx.sh; do
		grep -qxF "$f" <<<"$out" && st_fail "--check listed $f"
	done
	(cd "$t" && scripts/spdx.sh --fix >/dev/null) || st_fail "--fix failed"
	[ "$(head -n 1 "$t/a.c")" = "/* $ID */" ] || st_fail "a.c: $(head -n 1 "$t/a.c")"
	[ "$(head -n 1 "$t/c.proto")" = "// $ID" ] || st_fail "c.proto: $(head -n 1 "$t/c.proto")"
	[ "$(head -n 1 "$t/e.py")" = "# $ID" ] || st_fail "e.py: $(head -n 1 "$t/e.py")"
	[ "$(head -n 2 "$t/d.sh")" = "#!/bin/sh
# $ID" ] || st_fail "d.sh: the line must follow the #! line"
	[ "$(sed -n 3p "$t/d.sh")" = "echo hi" ] || st_fail "d.sh lost its body"
	[ "$(head -n 2 "$t/debian/rules" | tail -n 1)" = "# $ID" ] || st_fail "debian/rules"
	[ "$(cat "$t/done.c")" = "/* $ID */
int y;" ] || st_fail "done.c changed"
	[ "$(cat "$t/README.md")" = notes ] || st_fail "README.md changed"
	(cd "$t" && scripts/spdx.sh --check >/dev/null) || st_fail "--check fails after --fix"
	out="$(cd "$t" && scripts/spdx.sh --fix)"
	[ -z "$out" ] || st_fail "a second --fix changed something: $out"
	echo "spdx self-test: PASS"
	exit 0
}

case "${1:-}" in
--self-test) self_test ;;
--check | --fix) mode="${1#--}" ;;
*)
	echo "usage: $0 --check | --fix | --self-test" >&2
	exit 2
	;;
esac

# comment_for FILE: the identifier line in FILE's comment syntax; nothing
# when FILE is not a source file of ours.
comment_for()
{
	case "$1" in
	tests/fuzz/corpus/* | tests/fuzz/regressions/*) return 0 ;;
	*.c | *.h) printf '/* %s */\n' "$ID" ;;
	*.proto) printf '// %s\n' "$ID" ;;
	*.sh | *.py | *.cmake | *.cmake.in | CMakeLists.txt | */CMakeLists.txt) printf '# %s\n' "$ID" ;;
	*)
		if [ "$(head -c 2 "$1")" = '#!' ]; then
			printf '# %s\n' "$ID"
		fi
		;;
	esac
}

# has_id FILE: the identifier is in FILE's first 3 lines.
has_id()
{
	head -n 3 "$1" | grep -qF "$ID"
}

if git rev-parse --git-dir >/dev/null 2>&1; then
	mapfile -d '' files < <(git ls-files -z --cached --others --exclude-standard)
else
	mapfile -d '' files < <(find . -path './build*' -prune -o -path ./.git -prune -o -type f -printf '%P\0')
fi

missing=0
for f in "${files[@]}"; do
	[ -f "$f" ] && [ ! -L "$f" ] || continue
	line="$(comment_for "$f")"
	[ -n "$line" ] || continue
	has_id "$f" && continue
	if [ "$mode" = check ]; then
		printf '%s\n' "$f"
		missing=$((missing + 1))
		continue
	fi
	tmp="$(mktemp "$f.spdx-XXXXXX")"
	if [ "$(head -c 2 "$f")" = '#!' ]; then
		{
			head -n 1 "$f"
			printf '%s\n' "$line"
			tail -n +2 "$f"
		} >"$tmp"
	else
		{
			printf '%s\n' "$line"
			cat "$f"
		} >"$tmp"
	fi
	chmod --reference="$f" "$tmp"
	mv "$tmp" "$f"
	printf 'spdx: added to %s\n' "$f"
done

if [ "$mode" = check ] && [ "$missing" -gt 0 ]; then
	printf 'spdx: %d file(s) above lack "%s" in their first 3 lines: scripts/spdx.sh --fix\n' \
		"$missing" "$ID" >&2
	exit 1
fi
[ "$mode" = fix ] || echo "spdx: every source file carries \"$ID\""
