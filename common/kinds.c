/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The kind table: names of the bb_kind values for the daemon, the library
 * and the CLI.
 */
#include <string.h>

#include "bufbroker/bufbroker.h"
#include "bufbroker.pb-c.h"
#include "kinds.h"

/* Indexed by kind; [0] is no kind. */
static const char *const names[BB_KIND_COUNT + 1] = {
	[BB_HOST] = "host",
	[BB_CUDA] = "cuda",
};

_Static_assert(BB_HOST == 1 && BB_CUDA == BB_KIND_COUNT, "kinds run 1 .. BB_KIND_COUNT");
_Static_assert((int)BUFBROKER__KIND__KIND_HOST == BB_HOST &&
		       (int)BUFBROKER__KIND__KIND_CUDA == BB_CUDA,
	       "the wire's Kind values are the bb_kind values");

bool bb_kind_valid(int kind)
{
	return kind >= 1 && kind <= BB_KIND_COUNT;
}

const char *bb_kind_name(int kind)
{
	return bb_kind_valid(kind) ? names[kind] : "unknown";
}

int bb_kind_parse(const char *name)
{
	for (int k = 1; name && k <= BB_KIND_COUNT; k++)
		if (strcmp(name, names[k]) == 0)
			return k;
	return 0;
}
