#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package's type hints: mypy --strict (Debian's mypy, which runs
# on /usr/bin/python3 and so sees Debian's numpy and its stubs) on the
# package python/bufbroker and on the example programs that use it
# (examples/python/*.py). Any error fails the test.
#
# ctest sets BB_SOURCE_DIR.
set -euo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
init_test python_types
need_vars -d "a directory" BB_SOURCE_DIR
command -v mypy >/dev/null || fail "mypy is needed: apt-get install mypy (scripts/lib.sh lists it)"
/usr/bin/python3 -c 'import numpy' 2>/dev/null ||
	fail "python3-numpy is needed: apt-get install python3-numpy (scripts/lib.sh lists it)"

STEP="mypy --strict"
cd "$BB_SOURCE_DIR"
# The package from the source tree, never one installed elsewhere; the
# cache in the test's directory, not in the tree.
MYPYPATH=$BB_SOURCE_DIR/python mypy --strict --no-incremental --cache-dir "$DIR/cache" \
	python/bufbroker examples/python/*.py | tee "$DIR/mypy.out" || fail "mypy found type errors (above)"
grep -q "^Success: no issues found" "$DIR/mypy.out" || fail "mypy did not report success"
finish python_types.sh
