#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The live-restart rows of bench/run.sh, but for a crash under systemd's
# fd store rather than the planned upgrade (docs/RESTART.md, "Bundles"):
# bufbrokerd --restart runs under tests/integration/fakesd (systemd's
# stand-in: a notify socket with an fd store, Restart=on-failure,
# LISTEN_FDS/LISTEN_FDNAMES), bufbroker-bench fills it (host buffers up to
# the open-file limit, then 256 B VMM CUDA buffers with the fake driver
# when there is no GPU), SIGKILLs it and measures restart_ready (from the
# kill to the first answer of the new process) and restart_stall.
#
# Usage: bench/restart-crash.sh [--build-dir DIR] [--quick]
#   --build-dir DIR  a build with bufbrokerd, bufbroker-bench, fakesd and
#                    libfakecuda.so (default: build)
#   --quick          10 000 buffers instead of 100 000
set -euo pipefail
BUILD=build
QUICK=()
while (($#)); do
	case $1 in
	--build-dir) BUILD=$2; shift ;;
	--quick) QUICK=(--quick) ;;
	*) echo "usage: $0 [--build-dir DIR] [--quick]" >&2; exit 2 ;;
	esac
	shift
done
BUILD=$(cd "$BUILD" && pwd)
for f in bufbrokerd bufbroker-bench fakesd; do
	[[ -x $BUILD/$f ]] || { echo "restart-crash.sh: $BUILD/$f is missing: build first" >&2; exit 1; }
done
# (the list read whole: grep -q on a pipe could SIGPIPE ldconfig under pipefail)
if [[ -z ${BUFBROKER_CUDA_LIBRARY:-} && $(/sbin/ldconfig -p 2>/dev/null) != *'libcuda.so.1 '* ]]; then
	export BUFBROKER_CUDA_LIBRARY=$BUILD/libfakecuda.so
fi
DIR=$(mktemp -d /tmp/bb-restart-crash-XXXXXX)
cleanup() {
	[[ -n ${EPID:-} ]] && kill "$EPID" 2>/dev/null
	[[ -n ${SD:-} ]] && kill "$SD" 2>/dev/null
	# fakesd's child: every daemon it started
	sed -n 's/^fakesd: started .* as pid \([0-9]*\) .*/\1/p' "$DIR/log" 2>/dev/null |
		while read -r p; do kill -9 "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$DIR"
}
trap cleanup EXIT
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
"$BUILD/fakesd" --dir "$DIR" --socket "$DIR/bb.sock" --store-max 65536 -- \
	"$BUILD/bufbrokerd" --restart --log-level info --max-connections 64 \
	--uid-buffers 300000 --uid-host-bytes 1T --uid-cuda-bytes 1T --cuda-handle vmm \
	>"$DIR/log" 2>&1 &
SD=$!
"$BUILD/bufbroker-bench" echo-server --socket "$DIR/echo.sock" >"$DIR/echo.log" 2>&1 &
EPID=$!
for _ in $(seq 1 100); do [[ -S $DIR/bb.sock && -S $DIR/echo.sock ]] && break; sleep 0.1; done
BB_BENCH_RESTART_BY="kill" "$BUILD/bufbroker-bench" run --bb-socket "$DIR/bb.sock" \
	--echo-socket "$DIR/echo.sock" \
	--journal-socket "$DIR/bb.sock" --only restart "${QUICK[@]}" --cuda
echo
grep -E 'fakesd: (started|main process)|event=(restart_restored|fdstore_|bundle_)' "$DIR/log" || true
