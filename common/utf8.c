/* SPDX-License-Identifier: Apache-2.0 */
/*
 * UTF-8 checks and cuts (utf8.h). Hand-written: none of the daemon's
 * libraries (libuv, protobuf-c, inih) offers a validator, and the rules fit
 * in one table-free function.
 */
#include "utf8.h"

#include <string.h>

/* The length of the valid UTF-8 sequence at p (n > 0 bytes left), or 0
 * when the bytes there are not one. */
static size_t sequence_len(const unsigned char *p, size_t n)
{
	unsigned char c = p[0];
	size_t len;
	unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */

	if (c < 0x80)
		return 1;
	if (c >= 0xc2 && c <= 0xdf) {
		len = 2;
	} else if (c >= 0xe0 && c <= 0xef) {
		len = 3;
		if (c == 0xe0)
			lo = 0xa0; /* overlong below U+0800 */
		else if (c == 0xed)
			hi = 0x9f; /* surrogates U+D800..U+DFFF */
	} else if (c >= 0xf0 && c <= 0xf4) {
		len = 4;
		if (c == 0xf0)
			lo = 0x90; /* overlong below U+10000 */
		else if (c == 0xf4)
			hi = 0x8f; /* above U+10FFFF */
	} else {
		return 0; /* a continuation byte, 0xc0, 0xc1 or 0xf5..0xff */
	}
	if (n < len || p[1] < lo || p[1] > hi)
		return 0;
	for (size_t i = 2; i < len; i++)
		if ((p[i] & 0xc0) != 0x80)
			return 0;
	return len;
}

size_t bb_utf8_invalid_at(const char *p, size_t n)
{
	const unsigned char *u = (const unsigned char *)p;
	size_t i = 0;
	while (i < n) {
		size_t len = sequence_len(u + i, n - i);
		if (!len)
			return i;
		i += len;
	}
	return n;
}

size_t bb_utf8_prefix(const char *s, size_t max)
{
	size_t n = strnlen(s, max + 1);
	if (n <= max)
		return n;
	/* s[max] is the first byte left out: when it continues a character,
	 * leave out that character's first bytes too (at most three). */
	n = max;
	while (n > 0 && max - n < 3 && ((unsigned char)s[n] & 0xc0) == 0x80)
		n--;
	return n;
}

char *bb_utf8_scrub(char *s)
{
	size_t n = strlen(s), i = 0;
	while (i < n) {
		size_t len = sequence_len((const unsigned char *)s + i, n - i);
		if (len) {
			i += len;
		} else {
			s[i++] = '?';
		}
	}
	return s;
}
