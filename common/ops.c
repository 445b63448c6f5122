/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Op names from the Request descriptor, looked up once: the daemon names
 * the op of every request it handles, so a name costs an array read rather
 * than a descriptor search each time.
 */
#include <pthread.h>
#include <stddef.h>

#include "bufbroker.pb-c.h"
#include "ops.h"

#define OPS_CACHED 64 /* op numbers below this are named from the cache */

static const char *cached[OPS_CACHED]; /* by op number; NULL: not an op */
static pthread_once_t cached_once = PTHREAD_ONCE_INIT;

/* The name of field op of Request if it belongs to the op oneof, else NULL. */
static const char *op_field_name(int op)
{
	const ProtobufCFieldDescriptor *f =
		op > 0 ? protobuf_c_message_descriptor_get_field(&bufbroker__request__descriptor,
								 (unsigned)op)
		       : NULL;
	if (!f || !(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ||
	    f->quantifier_offset != offsetof(Bufbroker__Request, op_case))
		return NULL;
	return f->name;
}

static void cache_fill(void)
{
	for (int op = 0; op < OPS_CACHED; op++)
		cached[op] = op_field_name(op);
}

const char *bb_op_name(int op)
{
	const char *name;
	if (op >= 0 && op < OPS_CACHED) {
		pthread_once(&cached_once, cache_fill);
		name = cached[op];
	} else {
		name = op_field_name(op);
	}
	return name ? name : "unknown";
}
