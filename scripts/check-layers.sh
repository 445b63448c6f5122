#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Check that the daemon's modules only call downwards (issue 11): no object
# file of the daemon uses a global symbol of another that in turn, directly
# or through others, uses one of its own. nm on the objects is the evidence:
# object A depends on object B when A has an undefined symbol (nm: U, or a
# weak reference) that B defines as a global. Every strongly connected
# component of two or more objects is a cycle; each is printed with the
# symbols behind each of its edges.
#
# The objects: every .o of the CMake targets bufbrokerd (daemon/*.c but the
# core), bbbroker (the pure core: broker.c, idmap.c, journal.c) and bbcommon (common/*.c
# and the generated protobuf-c code) in a configured and built tree. An
# object whose source file is gone (a stale leftover of a moved or deleted
# file) is skipped with a note; an object older than its source, and a
# daemon/*.c or common/*.c without an object, are errors.
#
# With --layers FILE the modules must also follow that file's order: one
# layer a line, the top layer first, the modules of one layer on one line.
# A module is a source file's name without .c ("conn"), or with its
# directory ("daemon/log") when the name alone would name two objects; shell
# patterns are allowed ("common/*"); '#' starts a comment. An edge from a
# lower layer to a higher one is a call back up; an object the file does not
# name, an entry that names no object, and an object on two lines are errors,
# so the file stays true. Edges within one layer are allowed (cycles among
# them are still cycles).
#
# Usage: scripts/check-layers.sh [--layers FILE] BUILD_DIR
#        scripts/check-layers.sh --suggest BUILD_DIR   (print the layers the
#            objects have now, in the file's format, cycles on one line)
#        scripts/check-layers.sh --self-test   (compiles small C files into
#            a temporary tree and checks the verdicts)
# ctest runs it as layers.daemon (with daemon/LAYERS when that file exists)
# and layers.self_test.
# Exit status: 0 no cycle and no call back up, 1 a cycle, a call back up or
# an error in the layer file, 2 usage or an unusable build tree.
set -euo pipefail

# The CMake targets whose objects are the daemon. Edit this list when the
# targets change: a target named here that the tree lacks is an error.
BB_LAYER_TARGETS=(bufbrokerd bbbroker bbcommon)

self="${BASH_SOURCE[0]}"

usage()
{
	sed -n '/^# Usage:/,/^set -euo/p' "$self" | sed -n 's/^# \{0,1\}//p'
}

die()
{
	printf 'check-layers: error: %s\n' "$*" >&2
	exit 2
}

bb_python()
{
	if [ -x /usr/bin/python3 ]; then
		/usr/bin/python3 "$@"
	else
		python3 "$@"
	fi
}

# The graph part. argv: the nm listing (lines "@ OBJECT" then that object's
# `nm -P` lines), the layer file or "", the build tree's name for the
# report, "check" or "suggest".
# shellcheck disable=SC2016 # Python source, not shell
graph_py='
import collections, fnmatch, os, sys

listing, layers_path, label, mode = sys.argv[1:5]

# nm -P types. Undefined: U, and w/v (a weak reference: lower case means no
# value). Defined globals: upper case but U, plus u (unique global) and
# i (GNU indirect function).
UNDEF = set("Uwv")
DEFINED = set("ABCDGIRSTVWiu")

objs = []
uses = collections.defaultdict(set)     # object -> symbols it needs
definers = collections.defaultdict(set) # symbol -> objects that define it
cur = None
with open(listing) as f:
    for line in f:
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "@":
            cur = fields[1]
            objs.append(cur)
            continue
        if len(fields) < 2:
            continue
        name, kind = fields[0], fields[1]
        if kind in UNDEF:
            uses[cur].add(name)
        elif kind in DEFINED:
            definers[name].add(cur)

edges = collections.defaultdict(set)    # (a, b) -> symbols a uses from b
for a in objs:
    for sym in uses[a]:
        for b in definers.get(sym, ()):
            if b != a:
                edges[(a, b)].add(sym)
succ = collections.defaultdict(list)
for a, b in sorted(edges):
    succ[a].append(b)

# Tarjan: strongly connected components, each before the components that
# reach it (callees first).
index, low, onstack, stack, sccs = {}, {}, set(), [], []
def strongconnect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    onstack.add(v)
    for w in succ[v]:
        if w not in index:
            strongconnect(w)
            low[v] = min(low[v], low[w])
        elif w in onstack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            onstack.discard(w)
            comp.append(w)
            if w == v:
                break
        sccs.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in sorted(objs):
    if v not in index:
        strongconnect(v)

def syms(a, b):
    return ", ".join(sorted(edges[(a, b)]))

def module(obj):                        # daemon/conn.c.o -> daemon/conn
    return os.path.splitext(obj[:-2] if obj.endswith(".o") else obj)[0]

if mode == "suggest":
    short = {v: module(v).split("/")[-1] for v in objs}
    nshort = collections.Counter(short.values())
    # Height: the longest path down to an object that calls none of the
    # others; a cycle counts as one node. The highest first.
    comp_of = {v: i for i, c in enumerate(sccs) for v in c}
    height = {}
    for i, c in enumerate(sccs):
        below = [height[comp_of[w]] for v in c for w in succ[v] if comp_of[w] != i]
        height[i] = 1 + max(below, default=-1)
    print("# The layers the objects in %s have now: top first. Generated by" % label)
    print("# scripts/check-layers.sh --suggest; a line marked CYCLE is not a layer yet.")
    for h in sorted(set(height.values()), reverse=True):
        mods = []
        for i, c in enumerate(sccs):
            if height[i] != h:
                continue
            names = " ".join(short[v] if nshort[short[v]] == 1 else module(v) for v in c)
            mods.append(names + ("  # CYCLE" if len(c) > 1 else ""))
        # A cycle keeps its own line so that its mark stays on it.
        plain = [m for m in mods if "CYCLE" not in m]
        if plain:
            print(" ".join(plain))
        for m in mods:
            if "CYCLE" in m:
                print(m)
    sys.exit(0)

cycles = [c for c in sccs if len(c) > 1]
for n, c in enumerate(cycles, 1):
    print("cycle %d: %d objects: %s" % (n, len(c), " ".join(c)))
    members = set(c)
    for a in c:
        for b in succ[a]:
            if b in members:
                print("  %s -> %s: %s" % (a, b, syms(a, b)))

layer_errors = back_up = 0
nlayers = 0
if layers_path:
    layer_of = {}                       # object -> (layer, line number)
    entries = []                        # (line number, layer, entry)
    with open(layers_path) as f:
        for lineno, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if words:
                entries += [(lineno, nlayers, w) for w in words]
                nlayers += 1
    def lerror(msg):
        global layer_errors
        layer_errors += 1
        print("%s: %s" % (layers_path, msg))
    for lineno, layer, entry in entries:
        hits = [o for o in objs
                if fnmatch.fnmatchcase(module(o), entry)
                or fnmatch.fnmatchcase(module(o).split("/")[-1], entry)]
        if not hits:
            lerror("%d: %s names no object (a module that is gone?)" % (lineno, entry))
        elif len(hits) > 1 and not any(ch in entry for ch in "*?["):
            lerror("%d: %s names %d objects (%s): write it with its directory"
                   % (lineno, entry, len(hits), " ".join(hits)))
        for o in hits:
            if o in layer_of and layer_of[o][0] != layer:
                lerror("%d: %s is already in the layer of line %d" % (lineno, o, layer_of[o][1]))
            else:
                layer_of[o] = (layer, lineno)
    for o in sorted(objs):
        if o not in layer_of:
            lerror("%s is in no layer: add its module (%s)" % (o, module(o)))
    for (a, b) in sorted(edges):
        if a in layer_of and b in layer_of and layer_of[a][0] > layer_of[b][0]:
            back_up += 1
            print("call back up: %s (line %d) -> %s (line %d): %s"
                  % (a, layer_of[a][1], b, layer_of[b][1], syms(a, b)))

stats = "%s: %d objects, %d edges" % (label, len(objs), len(edges))
if layers_path:
    stats += ", %d layers in %s" % (nlayers, layers_path)
if cycles or back_up or layer_errors:
    def count(n, what, whats):
        return "%d %s" % (n, what if n == 1 else whats)
    print("check-layers: FAIL: %s: %s, %s, %s" % (stats, count(len(cycles), "cycle", "cycles"),
          count(back_up, "call back up", "calls back up"),
          count(layer_errors, "layer file error", "layer file errors")))
    sys.exit(1)
print("check-layers: OK: %s: no cycle%s" % (stats, ", no call back up" if layers_path else ""))
'

# check BUILD_DIR LAYERS_FILE MODE: find the objects, list their symbols,
# judge the graph.
check()
{
	local build="$1" layers="$2" mode="$3"
	local src t dir obj rel srel source listing rc
	local -a objects=() outdated=()
	local -A seen=() sources=()

	[ -f "$build/CMakeCache.txt" ] || die "$build is not a CMake build tree (no CMakeCache.txt)"
	src="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")"
	[ -n "$src" ] || die "$build/CMakeCache.txt names no source directory"
	if [ -n "$layers" ] && [ ! -f "$layers" ]; then
		die "no layer file $layers"
	fi

	for t in "${BB_LAYER_TARGETS[@]}"; do
		dir="$build/CMakeFiles/$t.dir"
		[ -d "$dir" ] || die "$dir is missing: build $build first (or BB_LAYER_TARGETS in $self is out of date)"
		while IFS= read -r -d '' obj; do
			rel="${obj#"$dir"/}"
			srel="${rel%.o}"
			if [ -f "$src/$srel" ]; then
				source="$src/$srel"
			elif [ -f "$build/$srel" ]; then
				source="$build/$srel"
			else
				printf 'check-layers: note: skipping %s: its source %s is gone\n' "$obj" "$srel" >&2
				continue
			fi
			# A file that moved from one target to another leaves its old
			# object behind: the newer one is the one built now.
			if [ -n "${seen[$rel]:-}" ]; then
				if [ "$obj" -nt "${seen[$rel]}" ]; then
					printf 'check-layers: note: skipping %s: %s is newer\n' "${seen[$rel]}" "$obj" >&2
					seen[$rel]="$obj"
				else
					printf 'check-layers: note: skipping %s: %s is newer\n' "$obj" "${seen[$rel]}" >&2
				fi
				continue
			fi
			seen[$rel]="$obj"
			sources[$rel]="$source"
		done < <(find "$dir" -type f -name '*.o' -print0 | sort -z)
	done
	[ "${#seen[@]}" -gt 0 ] || die "no objects of ${BB_LAYER_TARGETS[*]} in $build: build it first"
	# Every source of the daemon and of common/ must be among them: a
	# module that moved into a target not named above would otherwise
	# leave the graph without a word.
	for source in "$src"/daemon/*.c "$src"/common/*.c; do
		[ -f "$source" ] || continue
		srel="${source#"$src"/}"
		[ -n "${seen[$srel.o]:-}" ] ||
			die "$srel has no object in the targets ${BB_LAYER_TARGETS[*]} of $build: build it, or add its target to BB_LAYER_TARGETS in $self"
	done
	mapfile -t objects < <(printf '%s\n' "${!seen[@]}" | sort)
	for rel in "${objects[@]}"; do
		if [ "${sources[$rel]}" -nt "${seen[$rel]}" ]; then
			outdated+=("$rel")
		fi
	done
	if [ "${#outdated[@]}" -gt 0 ]; then
		die "older than their sources: ${outdated[*]}: build $build first"
	fi

	listing="$(mktemp /tmp/bb-layers.XXXXXX)"
	# shellcheck disable=SC2064 # expand now: the local is gone at exit
	trap "rm -f '$listing'" EXIT
	for rel in "${objects[@]}"; do
		printf '@ %s\n' "$rel"
		nm -P "${seen[$rel]}"
	done >"$listing"
	rc=0
	bb_python -c "$graph_py" "$listing" "$layers" "$build" "$mode" || rc=$?
	rm -f "$listing"
	return "$rc"
}

# ---- self-test ---------------------------------------------------------------
# A fake build tree: top -> mid -> low -> util, in the three target
# directories, and variants of it with a cycle and with wrong layer files.

st_pass=0
st_fail=0

# st_expect NAME RC PATTERN... -- ARGS...: run this script with ARGS and
# check its exit status and that its output holds each PATTERN (fixed
# strings; "!PATTERN": must not hold it).
st_expect()
{
	local name="$1" want="$2" out rc=0 p bad=""
	shift 2
	local -a patterns=()
	while [ "$1" != -- ]; do
		patterns+=("$1")
		shift
	done
	shift
	out="$(bash "$self" "$@" 2>&1)" || rc=$?
	[ "$rc" -eq "$want" ] || bad="exit $rc, want $want"
	for p in "${patterns[@]}"; do
		if [ "${p:0:1}" = "!" ]; then
			if grep -qF -- "${p:1}" <<<"$out"; then
				bad="${bad:+$bad; }output holds '${p:1}'"
			fi
		elif ! grep -qF -- "$p" <<<"$out"; then
			bad="${bad:+$bad; }output lacks '$p'"
		fi
	done
	if [ -z "$bad" ]; then
		st_pass=$((st_pass + 1))
		printf 'ok - %s\n' "$name"
	else
		st_fail=$((st_fail + 1))
		printf 'not ok - %s: %s\n' "$name" "$bad"
		printf '%s\n' "$out" | sed 's/^/    | /'
	fi
}

# st_source TREE TARGET REL TEXT: write TREE/src/REL and compile it into
# TREE/build/CMakeFiles/TARGET.dir/REL.o, as CMake would.
st_source()
{
	local tree="$1" target="$2" rel="$3" text="$4"
	local obj="$tree/build/CMakeFiles/$target.dir/$rel.o"
	mkdir -p "$(dirname "$tree/src/$rel")" "$(dirname "$obj")"
	printf '%s\n' "$text" >"$tree/src/$rel"
	"${CC:-cc}" -c -O1 -fPIC -o "$obj" "$tree/src/$rel"
}

self_test()
{
	local tmp t b
	tmp="$(mktemp -d /tmp/bb-layers-test.XXXXXX)"
	# shellcheck disable=SC2064 # expand now
	trap "rm -rf '$tmp'" EXIT
	t="$tmp/tree"
	b="$t/build"
	mkdir -p "$b"
	printf 'CMAKE_HOME_DIRECTORY:INTERNAL=%s\n' "$t/src" >"$b/CMakeCache.txt"

	st_source "$t" bbcommon common/util.c 'int util_add(int a, int b) { return a + b; }'
	st_source "$t" bbbroker daemon/low.c 'int util_add(int, int);
int low_get(int x) { return util_add(x, 1); }'
	st_source "$t" bufbrokerd daemon/mid.c 'int low_get(int);
int mid_count;
const int mid_limit = 3;
int mid_run(int x) { mid_count++; return low_get(x) + mid_limit; }'
	st_source "$t" bufbrokerd daemon/top.c 'int mid_run(int);
int top_main(void) { return mid_run(2); }'

	st_expect "a chain is acyclic" 0 "check-layers: OK: $b: 4 objects, 3 edges: no cycle" \
		-- "$b"
	printf 'top\nmid\nlow\ncommon/*\n' >"$tmp/LAYERS.ok"
	st_expect "a chain in its own order passes its layer file" 0 "no call back up" "4 layers" \
		-- --layers "$tmp/LAYERS.ok" "$b"
	printf '# comment\ntop mid  # one layer\n\ndaemon/low util\n' >"$tmp/LAYERS.same"
	st_expect "calls within one layer are allowed" 0 "no call back up" "2 layers" \
		-- --layers "$tmp/LAYERS.same" "$b"
	printf 'top\nlow\nmid\nutil\n' >"$tmp/LAYERS.swapped"
	st_expect "a call to a higher layer is a call back up" 1 \
		"call back up: daemon/mid.c.o (line 3) -> daemon/low.c.o (line 2): low_get" \
		"1 call back up" "!cycle 1" \
		-- --layers "$tmp/LAYERS.swapped" "$b"
	printf 'top\nmid\nutil\n' >"$tmp/LAYERS.short"
	st_expect "an object the layer file does not name is an error" 1 \
		"daemon/low.c.o is in no layer: add its module (daemon/low)" "1 layer file error" \
		-- --layers "$tmp/LAYERS.short" "$b"
	printf 'top\nmid\nlow\nutil\ngone\n' >"$tmp/LAYERS.stale"
	st_expect "an entry that names no object is an error" 1 "5: gone names no object" \
		-- --layers "$tmp/LAYERS.stale" "$b"
	printf 'top\nmid\nlow\nutil low\n' >"$tmp/LAYERS.twice"
	st_expect "an object on two lines is an error" 1 \
		"4: daemon/low.c.o is already in the layer of line 3" \
		-- --layers "$tmp/LAYERS.twice" "$b"
	st_expect "a missing layer file is a usage error" 2 "no layer file" \
		-- --layers "$tmp/LAYERS.none" "$b"
	st_expect "suggest prints the layers as they are" 0 "# The layers the objects" -- --suggest "$b"
	if [ "$(bash "$self" --suggest "$b" | grep -v '^#' | paste -sd'|')" = 'top|mid|low|util' ]; then
		st_pass=$((st_pass + 1))
		printf 'ok - suggest orders the chain top first\n'
	else
		st_fail=$((st_fail + 1))
		printf 'not ok - suggest orders the chain top first\n'
		bash "$self" --suggest "$b" | sed 's/^/    | /'
	fi

	# A file that moved between targets leaves its old object behind.
	mkdir -p "$b/CMakeFiles/bbbroker.dir/daemon"
	cp "$b/CMakeFiles/bufbrokerd.dir/daemon/mid.c.o" "$b/CMakeFiles/bbbroker.dir/daemon/mid.c.o"
	touch -d '2000-01-01' "$b/CMakeFiles/bbbroker.dir/daemon/mid.c.o"
	st_expect "of two objects of one source the newer counts" 0 \
		"skipping $b/CMakeFiles/bbbroker.dir/daemon/mid.c.o" "4 objects, 3 edges: no cycle" \
		-- "$b"
	rm "$b/CMakeFiles/bbbroker.dir/daemon/mid.c.o"

	# An object whose source is gone is a stale leftover, not a module.
	mkdir -p "$b/CMakeFiles/bufbrokerd.dir/daemon"
	cp "$b/CMakeFiles/bbbroker.dir/daemon/low.c.o" "$b/CMakeFiles/bufbrokerd.dir/daemon/old.c.o"
	st_expect "an object without a source is skipped" 0 "skipping" "4 objects, 3 edges: no cycle" \
		-- "$b"
	rm "$b/CMakeFiles/bufbrokerd.dir/daemon/old.c.o"

	# low uses mid's data: a B (bss) and an R (read-only) symbol.
	st_source "$t" bbbroker daemon/low.c 'int util_add(int, int);
extern int mid_count;
extern const int mid_limit;
int low_get(int x) { return util_add(x, mid_count + mid_limit); }'
	st_expect "a use of data back up is a cycle" 1 \
		"cycle 1: 2 objects: daemon/low.c.o daemon/mid.c.o" \
		"  daemon/low.c.o -> daemon/mid.c.o: mid_count, mid_limit" \
		"  daemon/mid.c.o -> daemon/low.c.o: low_get" \
		"1 cycle, 0 calls back up" "!top.c.o ->" \
		-- "$b"
	st_expect "suggest marks the cycle" 0 "low mid  # CYCLE" -- --suggest "$b"
	printf 'top\nmid low\nutil\n' >"$tmp/LAYERS.midlow"
	st_expect "a cycle inside one layer is still a cycle" 1 "1 cycle, 0 calls back up" \
		-- --layers "$tmp/LAYERS.midlow" "$b"

	# A function call back up through a third object: top -> mid -> low -> top.
	st_source "$t" bbbroker daemon/low.c 'int util_add(int, int);
int top_hook(int);
int low_get(int x) { return util_add(x, top_hook(x)); }'
	st_source "$t" bufbrokerd daemon/top.c 'int mid_run(int);
int top_hook(int x) { return x; }
int top_main(void) { return mid_run(2); }'
	st_expect "a cycle through three objects is one cycle" 1 \
		"cycle 1: 3 objects: daemon/low.c.o daemon/mid.c.o daemon/top.c.o" \
		"  daemon/low.c.o -> daemon/top.c.o: top_hook" "!util.c.o ->" "1 cycle," \
		-- "$b"

	# Two sources of one name: the name alone is ambiguous.
	st_source "$t" bbcommon common/mid.c 'int common_mid;'
	printf 'top\nmid low\nutil\n' >"$tmp/LAYERS.ambiguous"
	st_expect "a name that names two objects is an error" 1 \
		"2: mid names 2 objects (common/mid.c.o daemon/mid.c.o): write it with its directory" \
		-- --layers "$tmp/LAYERS.ambiguous" "$b"
	st_expect "suggest writes an ambiguous name with its directory" 0 "common/mid" \
		-- --suggest "$b"

	printf 'int orphan;\n' >"$t/src/daemon/orphan.c"
	st_expect "a daemon source without an object is refused" 2 \
		"daemon/orphan.c has no object in the targets bufbrokerd bbbroker bbcommon" \
		-- "$b"
	rm "$t/src/daemon/orphan.c"

	touch -d '2099-01-01' "$t/src/daemon/mid.c"
	st_expect "an object older than its source is refused" 2 "older than their sources: daemon/mid.c.o" \
		-- "$b"

	printf 'self-test: %d passed, %d failed\n' "$st_pass" "$st_fail"
	rm -rf "$tmp"
	[ "$st_fail" -eq 0 ]
}

# ---- main --------------------------------------------------------------------
layers=""
mode=check
while [ $# -gt 0 ]; do
	case "$1" in
	--self-test)
		self_test
		exit
		;;
	--layers)
		[ $# -ge 2 ] || die "--layers needs a file"
		layers="$2"
		shift 2
		;;
	--suggest)
		mode=suggest
		shift
		;;
	-h | --help)
		usage
		exit 0
		;;
	-*)
		usage >&2
		exit 2
		;;
	*) break ;;
	esac
done
if [ $# -ne 1 ]; then
	usage >&2
	exit 2
fi
check "$1" "$layers" "$mode"
