/* SPDX-License-Identifier: Apache-2.0 */
/*
 * common/utf8.c: what counts as UTF-8 (RFC 3629), where a cut may fall,
 * and what scrubbing leaves.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "utf8.h"

/* bb_utf8_invalid_at over the whole of s (a literal, NULs allowed). */
#define INVALID_AT(s) bb_utf8_invalid_at(s, sizeof(s) - 1)

Test(utf8, accepts_every_length_of_sequence_and_the_edges_of_each)
{
	cr_assert_eq(INVALID_AT(""), 0);
	cr_assert_eq(INVALID_AT("plain ascii"), 11);
	cr_assert_eq(INVALID_AT("\x7f"), 1, "U+007F");
	cr_assert_eq(INVALID_AT("\xc2\x80"), 2, "U+0080");
	cr_assert_eq(INVALID_AT("\xdf\xbf"), 2, "U+07FF");
	cr_assert_eq(INVALID_AT("\xe0\xa0\x80"), 3, "U+0800");
	cr_assert_eq(INVALID_AT("\xed\x9f\xbf"), 3, "U+D7FF");
	cr_assert_eq(INVALID_AT("\xee\x80\x80"), 3, "U+E000");
	cr_assert_eq(INVALID_AT("\xef\xbf\xbf"), 3, "U+FFFF");
	cr_assert_eq(INVALID_AT("\xf0\x90\x80\x80"), 4, "U+10000");
	cr_assert_eq(INVALID_AT("\xf4\x8f\xbf\xbf"), 4, "U+10FFFF");
	cr_assert_eq(INVALID_AT("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), 14);
	cr_assert_eq(INVALID_AT("a\0b"), 3, "U+0000 is UTF-8 (callers refuse it themselves)");
}

Test(utf8, refuses_stray_overlong_surrogate_too_large_and_cut_sequences)
{
	cr_assert_eq(INVALID_AT("ab\x80"), 2, "a lone continuation byte");
	cr_assert_eq(INVALID_AT("\xc0\x80"), 0, "overlong U+0000");
	cr_assert_eq(INVALID_AT("\xc1\xbf"), 0, "overlong U+007F");
	cr_assert_eq(INVALID_AT("\xe0\x9f\xbf"), 0, "overlong U+07FF");
	cr_assert_eq(INVALID_AT("\xf0\x8f\xbf\xbf"), 0, "overlong U+FFFF");
	cr_assert_eq(INVALID_AT("x\xed\xa0\x80"), 1, "surrogate U+D800");
	cr_assert_eq(INVALID_AT("\xed\xbf\xbf"), 0, "surrogate U+DFFF");
	cr_assert_eq(INVALID_AT("\xf4\x90\x80\x80"), 0, "U+110000");
	cr_assert_eq(INVALID_AT("\xf5\x80\x80\x80"), 0, "0xf5");
	cr_assert_eq(INVALID_AT("\xff"), 0, "0xff");
	cr_assert_eq(INVALID_AT("ok\xc3"), 2, "cut after its first byte");
	cr_assert_eq(INVALID_AT("ok\xe2\x82"), 2, "cut after two of three");
	cr_assert_eq(INVALID_AT("ok\xf0\x9f\x98"), 2, "cut after three of four");
	cr_assert_eq(INVALID_AT("\xe2\x28\xa1"), 0, "a second byte that continues nothing");
	cr_assert_eq(INVALID_AT("\xf0\x9f\x28\x80"), 0, "a third byte that continues nothing");
}

Test(utf8, prefix_ends_between_characters)
{
	cr_assert_eq(bb_utf8_prefix("short", 10), 5);
	cr_assert_eq(bb_utf8_prefix("exact", 5), 5);
	cr_assert_eq(bb_utf8_prefix("longer", 3), 3);
	cr_assert_eq(bb_utf8_prefix("", 0), 0);
	/* "é" at bytes 2-3: a cut at 3 would split it. */
	cr_assert_eq(bb_utf8_prefix("ab\xc3\xa9z", 3), 2);
	cr_assert_eq(bb_utf8_prefix("ab\xc3\xa9z", 4), 4);
	/* "€" (3 bytes) at bytes 1-3. */
	cr_assert_eq(bb_utf8_prefix("a\xe2\x82\xac", 2), 1);
	cr_assert_eq(bb_utf8_prefix("a\xe2\x82\xac", 3), 1);
	cr_assert_eq(bb_utf8_prefix("a\xe2\x82\xac", 4), 4);
	/* U+1F600 (4 bytes) at bytes 0-3. */
	for (size_t max = 0; max < 4; max++)
		cr_assert_eq(bb_utf8_prefix("\xf0\x9f\x98\x80!", max), 0, "max %zu", max);
	cr_assert_eq(bb_utf8_prefix("\xf0\x9f\x98\x80!", 4), 4);
	/* What is cut from valid UTF-8 stays valid, at every length. */
	const char *s = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80z";
	for (size_t max = 0; max <= strlen(s); max++) {
		size_t n = bb_utf8_prefix(s, max);
		cr_assert_leq(n, max);
		cr_assert_eq(bb_utf8_invalid_at(s, n), n, "the cut at %zu (%zu bytes) splits", max,
			     n);
	}
}

Test(utf8, scrub_replaces_each_byte_that_is_not_utf8)
{
	char s[] = "ok\xff\xc3\xa9\xc3(\xe2\x82";
	cr_assert_str_eq(bb_utf8_scrub(s), "ok?\xc3\xa9?(??");
	char t[] = "caf\xc3\xa9";
	cr_assert_str_eq(bb_utf8_scrub(t), "caf\xc3\xa9", "valid text changed");
}
