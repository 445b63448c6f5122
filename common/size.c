/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Byte counts for people.
 */
#include "size.h"

#include <inttypes.h>
#include <stdio.h>

const char *bb_size_format(uint64_t n, char *out, size_t cap)
{
	static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
	const int last = (int)(sizeof(units) / sizeof(units[0])) - 1;
	double v = (double)n;
	int u = 0;

	if (n < 1024) {
		snprintf(out, cap, "%" PRIu64 " B", n);
		return out;
	}
	while (v >= 1024.0 && u < last) {
		v /= 1024.0;
		u++;
	}
	/* 1023.97 KiB would round to "1024.0 KiB"; say "1.0 MiB" instead. */
	if (v >= 1023.95 && u < last) {
		v /= 1024.0;
		u++;
	}
	snprintf(out, cap, "%.1f %s", v, units[u]);
	return out;
}
