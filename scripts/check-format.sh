#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Check that every tracked C source and header (git ls-files '*.c' '*.h')
# is formatted as the repository's .clang-format says, with the clang-format
# version that file names (14, Debian 12's package clang-format): that
# version's `clang-format --dry-run --Werror` must find nothing. Prints the
# files that need formatting and the command that formats them.
#
# Usage: scripts/check-format.sh         check
#        scripts/check-format.sh --fix   format those files in place
# Environment: CLANG_FORMAT=PROGRAM to use another binary of the right
#        version; CI=true makes a missing clang-format a failure, not a skip.
# Exit status: 0 all formatted (or --fix formatted them), 1 files need
# formatting (or CI is set and clang-format is missing), 2 usage or a
# clang-format error, 77 skipped: no clang-format of that version.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$BB_ROOT"

# Tracked files that are not ours to format (generated or third-party), as
# shell patterns. None today: the protobuf-c output is generated into the
# build tree and never tracked.
BB_FORMAT_EXCLUDE=()

fix=0
case "${1:-}" in
"") ;;
--fix) fix=1 ;;
-h | --help)
	sed -n '/^# Usage:/,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p'
	exit 0
	;;
*)
	echo "usage: scripts/check-format.sh [--fix]" >&2
	exit 2
	;;
esac

# The version .clang-format names in its header ("clang-format 14"): others
# format differently, so another version's verdict would be noise.
want="$(sed -n 's/.*(clang-format \([0-9][0-9]*\).*/\1/p' .clang-format | head -n 1)"
if [ -z "$want" ]; then
	echo "check-format: error: .clang-format names no version ('(clang-format N, ...)' in its header)" >&2
	exit 2
fi

# clang_format_version PROGRAM: its major version, or nothing.
clang_format_version()
{
	"$1" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9][0-9]*\).*/\1/p' | head -n 1
}

cf=""
if [ -n "${CLANG_FORMAT:-}" ] && [ "$(clang_format_version "$CLANG_FORMAT")" != "$want" ]; then
	echo "check-format: error: CLANG_FORMAT=$CLANG_FORMAT is not clang-format $want" >&2
	exit 2
fi
for c in ${CLANG_FORMAT:+"$CLANG_FORMAT"} "clang-format-$want" clang-format; do
	if command -v "$c" >/dev/null 2>&1 && [ "$(clang_format_version "$c")" = "$want" ]; then
		cf="$c"
		break
	fi
done
if [ -z "$cf" ]; then
	why="clang-format $want is not installed (apt-get install clang-format on Debian 12)"
	if bb_ci; then
		echo "check-format: error: $why, and under CI that is a failure" >&2
		exit 1
	fi
	echo "SKIP: $why"
	exit 77
fi

excluded()
{
	local p
	for p in "${BB_FORMAT_EXCLUDE[@]}"; do
		# shellcheck disable=SC2053 # a pattern on purpose
		[[ "$1" == $p ]] && return 0
	done
	return 1
}

mapfile -d '' -t tracked < <(git ls-files -z -- '*.c' '*.h')
if [ "${#tracked[@]}" -eq 0 ]; then
	echo "check-format: error: git ls-files lists no .c or .h file: is $BB_ROOT a git checkout?" >&2
	exit 2
fi
files=()
for f in "${tracked[@]}"; do
	# A tracked file deleted in the work tree is not there to check.
	[ -f "$f" ] || continue
	excluded "$f" || files+=("$f")
done

# One file at a time, so that a file that needs formatting is told apart
# from a clang-format that cannot read its input or the configuration.
bad=()
for f in "${files[@]}"; do
	rc=0
	err="$("$cf" --dry-run --Werror --ferror-limit=1 -- "$f" 2>&1 >/dev/null)" || rc=$?
	if [ "$rc" -eq 0 ]; then
		continue
	fi
	if grep -q -- '-Wclang-format-violations' <<<"$err"; then
		bad+=("$f")
	else
		printf 'check-format: error: %s failed on %s (exit %d):\n%s\n' "$cf" "$f" "$rc" "$err" >&2
		exit 2
	fi
done

version="$("$cf" --version | head -n 1)"
if [ "${#bad[@]}" -eq 0 ]; then
	printf 'check-format: OK: %d files formatted as .clang-format says (%s)\n' "${#files[@]}" "$version"
	exit 0
fi
if [ "$fix" -eq 1 ]; then
	"$cf" -i -- "${bad[@]}"
	printf 'check-format: formatted %d of %d files in place (%s):\n' "${#bad[@]}" "${#files[@]}" "$version"
	printf '  %s\n' "${bad[@]}"
	exit 0
fi
printf 'check-format: FAIL: %d of %d files need formatting (%s):\n' "${#bad[@]}" "${#files[@]}" "$version"
printf '  %s\n' "${bad[@]}"
printf 'Where: %s --dry-run FILE\n' "$cf"
printf -v quoted ' %q' "${bad[@]}"
printf 'Fix:   %s -i%s\n' "$cf" "$quoted"
printf '  or:  scripts/check-format.sh --fix\n'
exit 1
