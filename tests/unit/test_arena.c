/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The protobuf-c bump allocator: aligned allocations from the block, a
 * spill to malloc for what does not fit (counted, freed through
 * free_unpacked), and messages unpacked through it equal to the ones
 * protobuf-c's own allocator makes.
 */
#include <criterion/criterion.h>
#include <stdalign.h>
#include <stdint.h>
#include <string.h>

#include "arena.h"
#include "bufbroker.pb-c.h"

Test(arena, allocations_are_aligned_and_inside_the_block)
{
	static unsigned char block[1024];
	bb_arena a;
	bb_arena_init(&a, block, sizeof(block));
	for (size_t size = 1; size < 40; size += 3) {
		unsigned char *p = a.pc.alloc(a.pc.allocator_data, size);
		cr_assert((uintptr_t)p % alignof(max_align_t) == 0, "size %zu misaligned", size);
		cr_assert(p >= block && p + size <= block + sizeof(block));
		memset(p, 0xab, size);
	}
	cr_assert_eq(a.spilled, 0);
	bb_arena_reset(&a);
	cr_assert_eq(a.used, 0);
	cr_assert_eq(a.pc.alloc(a.pc.allocator_data, 8), block, "a reset starts over");
}

Test(arena, what_does_not_fit_spills_to_malloc_and_is_freed)
{
	static unsigned char block[256];
	bb_arena a;
	bb_arena_init(&a, block, sizeof(block));
	void *in = a.pc.alloc(a.pc.allocator_data, 200);
	void *out = a.pc.alloc(a.pc.allocator_data, 200);
	cr_assert_not_null(out);
	cr_assert((unsigned char *)out < block || (unsigned char *)out >= block + sizeof(block));
	cr_assert_eq(a.spilled, 1);
	memset(out, 0, 200); /* ASan: a real allocation of that size */
	a.pc.free(a.pc.allocator_data, in);
	cr_assert_eq(a.spilled, 1, "freeing from the block changes nothing");
	a.pc.free(a.pc.allocator_data, out);
	cr_assert_eq(a.spilled, 0);
	a.pc.free(a.pc.allocator_data, NULL);
}

/* An Alloc with a name: the message, its sub-message and a string. */
static size_t pack_alloc(const char *name, uint8_t *out, size_t cap)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc al = BUFBROKER__ALLOC__INIT;
	al.size = 1 << 20;
	al.kind = BUFBROKER__KIND__KIND_HOST;
	al.name = (char *)name;
	req.id = 7;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &al;
	cr_assert_leq(bufbroker__request__get_packed_size(&req), cap);
	return bufbroker__request__pack(&req, out);
}

static void unpack_and_compare(bb_arena *a, const char *name, bool expect_spill)
{
	uint8_t wire[4096];
	size_t n = pack_alloc(name, wire, sizeof(wire));
	Bufbroker__Request *r = bufbroker__request__unpack(&a->pc, n, wire);
	cr_assert_not_null(r);
	cr_assert_eq(a->spilled > 0, expect_spill, "name of %zu bytes: spilled %zu", strlen(name),
		     a->spilled);
	cr_assert_eq(r->id, 7);
	cr_assert_eq(r->op_case, BUFBROKER__REQUEST__OP_ALLOC);
	cr_assert_eq(r->alloc->size, 1 << 20);
	cr_assert_str_eq(r->alloc->name, name);
	if (a->spilled)
		bufbroker__request__free_unpacked(r, &a->pc);
	cr_assert_eq(a->spilled, 0);
	bb_arena_reset(a);
}

Test(arena, protobuf_c_unpacks_into_it)
{
	static unsigned char block[512];
	char longname[2048];
	bb_arena a;
	bb_arena_init(&a, block, sizeof(block));
	memset(longname, 'n', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = 0;
	unpack_and_compare(&a, "weights", false);
	unpack_and_compare(&a, longname, true);
	unpack_and_compare(&a, "after a spill", false);
}
