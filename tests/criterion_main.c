/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The main of every Criterion test program (tests/unit, tests/integration):
 * Criterion's own run, then a verdict on the tests that skipped themselves
 * (cr_skip_test). Criterion counts those as neither passed nor failed and
 * exits 0, so a program whose every test skipped looked like a pass. Here
 * each skip is named on stderr ("SKIP: suite::test: why"), and the exit
 * status says what happened:
 *
 *   0   every test that ran passed, and none skipped;
 *   1   a test failed, or (under CI) one skipped: CI=true, 1 or yes, as
 *       scripts/lib.sh's bb_ci reads it, allows no skip;
 *   77  the others passed but some skipped: ctest's SKIP_RETURN_CODE
 *       (CMakeLists.txt), so ctest reports the program as Skipped.
 *
 * Tests that --filter leaves out, and .disabled ones, are not skips: nobody
 * asked for them. --always-succeed keeps its meaning (exit 0).
 */
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <criterion/options.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define EXIT_SKIPPED 77

static size_t g_skipped; /* tests that called cr_skip_test */

/* Runs in the runner process once each test has ended. */
ReportHook(POST_TEST)(struct criterion_test_stats *stats)
{
	if (stats->test_status != CR_STATUS_SKIPPED || stats->test->data->disabled)
		return;
	g_skipped++;
	fprintf(stderr, "SKIP: %s::%s: %s\n", stats->test->category, stats->test->name,
		stats->message && stats->message[0] ? stats->message : "(no reason given)");
}

static bool under_ci(void)
{
	const char *ci = getenv("CI");
	return ci && (!strcasecmp(ci, "true") || !strcmp(ci, "1") || !strcasecmp(ci, "yes"));
}

int main(int argc, char *argv[])
{
	struct criterion_test_set *tests = criterion_initialize();
	int rc = 0;

	if (criterion_handle_args(argc, argv, true))
		rc = !criterion_run_all_tests(tests);
	criterion_finalize(tests);
	if (rc != 0 || g_skipped == 0 || criterion_options.always_succeed)
		return rc;
	if (under_ci()) {
		fprintf(stderr, "FAIL: %zu test(s) skipped themselves, and CI=%s allows no skip\n",
			g_skipped, getenv("CI"));
		return 1;
	}
	fprintf(stderr, "SKIP: %zu test(s) skipped themselves (named above): not a pass\n",
		g_skipped);
	return EXIT_SKIPPED;
}
