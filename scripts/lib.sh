# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Shared by scripts/test.sh and scripts/demo.sh: find the repository, install
# the Debian packages the build needs, configure and build a tree.
# Source it from bash; it defines functions and variables only.

# The repository root (this file lives in ROOT/scripts).
BB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Everything the build, the tests and the demo need on Debian 12.
# systemd provides systemd-analyze and systemd-socket-activate, and strace
# records the system calls the daemon makes in the unit's sandbox
# (tests/integration/service_sandbox.sh); yamllint and python3-kubernetes
# (the Kubernetes API's schema, offline) check deploy/kubernetes; clang builds
# the fuzz target and libclang-rt-dev holds its libFuzzer runtime; python3,
# python3-pytest and python3-numpy run the Python binding's tests; mypy
# checks its type hints, and python3-pip, -venv, -build, -installer,
# -setuptools and -wheel install it as users and Debian's pybuild do
# (tests/integration/python_types.sh, python_package.sh);
# redis-server, libhiredis-dev and gnuplot-nox are the benchmark's Redis
# baseline and plots (bench/run.sh); libmicrohttpd serves the metrics
# endpoint and curl scrapes it in its test; dpkg-dev (dpkg-shlibdeps) and
# file compute the .deb packages' Depends, debhelper, dh-python and lintian
# build and check them (scripts/package-test.sh); strace watches what
# `cmake --install` writes (tests/integration/install_prefix.sh);
# valgrind runs the integration tests under memcheck (scripts/valgrind.sh);
# clang-format (version 14 on Debian 12, the one .clang-format names) checks
# the formatting (scripts/check-format.sh); prometheus provides promtool,
# which checks the metrics (tests/integration/metrics.sh) and the alert
# rules in deploy/prometheus (tests/integration/monitoring.sh).
BB_PACKAGES=(
	build-essential cmake pkg-config
	libuv1-dev libprotobuf-c-dev protobuf-c-compiler
	libcriterion-dev libsystemd-dev uthash-dev libinih-dev
	libmicrohttpd-dev curl
	systemd strace clang libclang-rt-dev
	yamllint python3-kubernetes python3-yaml
	python3 python3-pytest python3-numpy
	mypy python3-pip python3-venv python3-build python3-installer python3-setuptools python3-wheel
	redis-server libhiredis-dev gnuplot-nox
	dpkg-dev file
	debhelper dh-python lintian strace
	valgrind
	clang-format
	prometheus
)

bb_log()
{
	printf '==> %s\n' "$*"
}

bb_warn()
{
	printf '==> warning: %s\n' "$*" >&2
}

# True under continuous integration (CI=true, as GitHub Actions, GitLab CI
# and most others set it): a check whose tool is missing fails there
# instead of skipping.
bb_ci()
{
	case "${CI:-}" in
	[Tt][Rr][Uu][Ee] | 1 | [Yy][Ee][Ss]) return 0 ;;
	*) return 1 ;;
	esac
}

# The summary scripts/test.sh prints, one line per step (bb_step), and
# whether a step failed or skipped.
BB_SUMMARY=()
BB_FAILED=0
BB_SKIPPED=0

# bb_step LABEL RC [FAIL_DETAIL [SKIP_DETAIL]]: the summary line of a step
# that exited RC. 0: PASS. 77 (the step printed why on a SKIP line): SKIP,
# never PASS; under CI (bb_ci) nothing may skip, so FAIL. Anything else:
# FAIL. The details go in parentheses ("see above" and "see the SKIP line
# above" unless given). Sets BB_FAILED=1 or BB_SKIPPED=1 accordingly.
# shellcheck disable=SC2034 # scripts/test.sh reads what it sets
bb_step()
{
	local label="$1" rc="$2" fail_detail="${3:-see above}"
	local skip_detail="${4:-see the SKIP line above}"

	case "$rc" in
	0) BB_SUMMARY+=("$label: PASS") ;;
	77)
		if bb_ci; then
			BB_SUMMARY+=("$label: FAIL (skipped: $skip_detail; CI=$CI allows no skip)")
			BB_FAILED=1
		else
			BB_SUMMARY+=("$label: SKIP ($skip_detail)")
			BB_SKIPPED=1
		fi
		;;
	*)
		BB_SUMMARY+=("$label: FAIL ($fail_detail)")
		BB_FAILED=1
		;;
	esac
}

# bb_ctest_skipped OUTPUT: the names of the tests that ctest reported as
# Skipped (SKIP_RETURN_CODE) in OUTPUT, a file holding what it printed, one
# a line; nothing when none skipped.
bb_ctest_skipped()
{
	sed -n '/^The following tests did not run:/,/^$/ s/^[[:space:]]*[0-9][0-9]* - \(.*\) (Skipped)$/\1/p' "$1"
}

# Prints the packages of BB_PACKAGES that are not installed, one a line.
bb_missing_packages()
{
	local p st
	for p in "${BB_PACKAGES[@]}"; do
		st="$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)"
		[ "$st" = installed ] || printf '%s\n' "$p"
	done
}

# Installs what is missing with apt-get (as root, or through sudo). Does
# nothing, quickly, when everything is there. Returns non-zero, naming the
# packages, when it cannot install them.
bb_ensure_packages()
{
	local -a missing sudo_cmd=()

	if ! command -v dpkg-query >/dev/null 2>&1; then
		bb_warn "not a Debian system: make sure these (or their equivalents) are installed: ${BB_PACKAGES[*]}"
		return 0
	fi
	mapfile -t missing < <(bb_missing_packages)
	if [ "${#missing[@]}" -eq 0 ]; then
		bb_log "build dependencies: all installed"
		return 0
	fi
	if [ "$(id -u)" -ne 0 ]; then
		if command -v sudo >/dev/null 2>&1; then
			sudo_cmd=(sudo)
		else
			printf 'error: missing packages: %s\n' "${missing[*]}" >&2
			printf 'install them as root: apt-get install %s\n' "${missing[*]}" >&2
			return 1
		fi
	fi
	bb_log "installing: ${missing[*]}"
	"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q || return 1
	"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends "${missing[@]}" || return 1
}

# bb_build DIR BUILD_TYPE [CMAKE_ARGS...]: configure and build ROOT/DIR.
bb_build()
{
	local dir="$1" type="$2"
	shift 2
	bb_log "configuring $dir ($type${*:+ $*})"
	cmake -S "$BB_ROOT" -B "$BB_ROOT/$dir" -DCMAKE_BUILD_TYPE="$type" "$@" || return 1
	bb_log "building $dir"
	cmake --build "$BB_ROOT/$dir" -j "$(nproc)" || return 1
}

# The build tree the scripts use (relative to the root). Override with
# BUFBROKER_BUILD_DIR to keep a separate tree.
# shellcheck disable=SC2034 # used by the scripts that source this file
BB_BUILD_DIR="${BUFBROKER_BUILD_DIR:-build}"
