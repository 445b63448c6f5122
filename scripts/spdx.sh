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
set -euo pipefail

ID='SPDX-License-Identifier: Apache-2.0'
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

case "${1:-}" in
--check | --fix) mode="${1#--}" ;;
*)
	echo "usage: $0 --check | --fix" >&2
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
