/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Byte counts for people: "512 B", "4.0 KiB", "9.0 GiB". One formatter for
 * the daemon's limit messages and the CLI's tables, so both read alike.
 */
#ifndef BB_SIZE_H
#define BB_SIZE_H

#include <stddef.h>
#include <stdint.h>

#define BB_SIZE_TEXT 32 /* enough for any uint64_t */

/* n bytes as text into out (cap bytes): exact below 1 KiB, else one decimal
 * in binary units. Returns out. */
const char *bb_size_format(uint64_t n, char *out, size_t cap);

#endif /* BB_SIZE_H */
