/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The text rule of the wire: every string is UTF-8 (proto3 says so, and
 * parsers that check it, Python's protobuf among them, refuse a whole
 * message over one bad string). protobuf-c does not check it, so the
 * daemon does: what it accepts (names, client names, SetError messages)
 * and what it cuts to a length stay UTF-8 for every other client.
 *
 * UTF-8 here is RFC 3629's: no overlong forms, no surrogates (U+D800 to
 * U+DFFF), nothing above U+10FFFF. U+0000 is valid UTF-8; callers that
 * keep C strings refuse it themselves.
 */
#ifndef BB_UTF8_H
#define BB_UTF8_H

#include <stddef.h>

/* The offset of the first byte of the n bytes at p that does not belong to
 * a valid UTF-8 sequence (a sequence cut short by the end counts as
 * invalid), or n when they all do. */
size_t bb_utf8_invalid_at(const char *p, size_t n);

/* The length of the longest prefix of the NUL-terminated s that is at most
 * max bytes long and does not end inside a character: strlen(s) when that
 * is at most max. For cutting valid UTF-8 to a length. */
size_t bb_utf8_prefix(const char *s, size_t max);

/* Replace, in place, every byte of the NUL-terminated s that does not
 * belong to a valid UTF-8 sequence with '?'. Returns s. */
char *bb_utf8_scrub(char *s);

#endif /* BB_UTF8_H */
