/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Not a test of its own: the program tests/integration/skips.sh runs to
 * prove what tests/criterion_main.c promises. One test passes, one skips
 * itself, and one fails when $BB_SKIP_PROBE_FAIL is set.
 */
#include <criterion/criterion.h>
#include <stdlib.h>

Test(probe, passes)
{
	cr_assert(1);
}

Test(probe, skips_itself)
{
	cr_skip_test("the probe always skips this one");
}

Test(probe, fails_when_asked)
{
	cr_assert_null(getenv("BB_SKIP_PROBE_FAIL"), "BB_SKIP_PROBE_FAIL is set: failing");
}
