#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The symbols file of the libbufbroker0 package (debian/libbufbroker0.symbols)
# against the library and the public header: every bb_* name that
# libbufbroker.so.0 exports, and every function bufbroker.h declares, has a
# line there with the version it appeared in, and the file names nothing
# else. A new export without its line fails here (ctest packaging.symbols)
# before it can reach a package; dpkg-gensymbols checks the same again when
# the package is built (debian/rules, -c4).
#
# Usage: scripts/check-symbols.sh LIBBUFBROKER.so.0
#        scripts/check-symbols.sh --package LIBBUFBROKER.so.0 OUT
# The second form writes to OUT the symbols file for the package built from
# that library: the lines of the names it exports. A function the header
# declares and the library does not define yet (a contract ahead of its
# implementation) has its line in debian/ but cannot be promised by a
# package that lacks it; the first form names such functions, the second
# leaves them out. Exits 0 when all is well, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SYMBOLS="$ROOT/debian/libbufbroker0.symbols"
HEADER="$ROOT/include/bufbroker/bufbroker.h"

mode=check
if [ "${1:-}" = --package ]; then
	mode=package
	shift
fi
if { [ "$mode" = check ] && [ $# -ne 1 ]; } || { [ "$mode" = package ] && [ $# -ne 2 ]; }; then
	echo "usage: $0 LIB | --package LIB OUT" >&2
	exit 2
fi
LIB="$1"

TMP="$(mktemp -d /tmp/bb-symbols-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT

fail=0
problem()
{
	printf 'check-symbols: %s\n' "$*" >&2
	fail=1
}

# What the library exports: defined dynamic symbols (functions and data).
nm -D --defined-only "$LIB" | awk '{print $NF}' | sed 's/@.*//' | sort -u >"$TMP/exported"

# The file's entries: " NAME@Base VERSION" after the header line.
head -n1 "$SYMBOLS" | grep -qE '^libbufbroker\.so\.0 libbufbroker0 #MINVER#$' ||
	problem "$SYMBOLS: the first line must be 'libbufbroker.so.0 libbufbroker0 #MINVER#'"
tail -n +2 "$SYMBOLS" | grep -vE '^(\* |#)' >"$TMP/lines" || true
if grep -vE '^ bb_[a-z0-9_]+@Base [0-9][0-9A-Za-z.+~-]*$' "$TMP/lines" >"$TMP/bad"; then
	problem "$SYMBOLS: lines not of the form ' bb_NAME@Base VERSION':"
	cat "$TMP/bad" >&2
fi
sed -n 's/^ \(bb_[a-z0-9_]*\)@Base .*/\1/p' "$TMP/lines" | sort >"$TMP/listed"
if [ -n "$(uniq -d "$TMP/listed")" ]; then
	problem "names listed twice: $(uniq -d "$TMP/listed" | tr '\n' ' ')"
fi

if [ "$mode" = package ]; then
	head -n1 "$SYMBOLS" >"$2"
	grep -E '^\* ' "$SYMBOLS" >>"$2" || true
	while IFS= read -r line; do
		name="${line# }"
		name="${name%%@*}"
		if grep -qxF "$name" "$TMP/exported"; then
			printf '%s\n' "$line" >>"$2"
		else
			printf 'check-symbols: %s is not in %s yet: left out of the package symbols\n' \
				"$name" "${LIB##*/}" >&2
		fi
	done <"$TMP/lines"
	exit "$fail"
fi

# What the header declares: the compiler's own list of its prototypes.
printf '#include <bufbroker/bufbroker.h>\n' >"$TMP/h.c"
"${CC:-cc}" -I"$ROOT/include" -fsyntax-only -aux-info "$TMP/aux" "$TMP/h.c"
grep -F '/bufbroker/bufbroker.h:' "$TMP/aux" |
	sed -n 's/.*[ *]\(bb_[a-z0-9_]*\) (.*/\1/p' | sort -u >"$TMP/declared"
[ -s "$TMP/declared" ] || problem "no bb_* function found in $HEADER"

while IFS= read -r n; do
	problem "libbufbroker.so.0 exports $n, which $SYMBOLS does not list: add ' $n@Base VERSION' (the version that first exports it)"
done < <(comm -23 "$TMP/exported" "$TMP/listed")
while IFS= read -r n; do
	problem "bufbroker.h declares $n, which $SYMBOLS does not list"
done < <(comm -23 "$TMP/declared" "$TMP/listed")
while IFS= read -r n; do
	if grep -qxF "$n" "$TMP/declared"; then
		printf 'check-symbols: note: bufbroker.h declares %s, which %s does not define yet\n' \
			"$n" "${LIB##*/}"
	else
		problem "$SYMBOLS lists $n, which neither the library exports nor the header declares"
	fi
done < <(comm -13 "$TMP/exported" "$TMP/listed")

if [ "$fail" -eq 0 ]; then
	echo "check-symbols: $(wc -l <"$TMP/listed") names, every export and declaration listed"
fi
exit "$fail"
