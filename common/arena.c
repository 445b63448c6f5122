/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Bump allocator behind protobuf-c (see arena.h).
 */
#include "arena.h"

#include <stdalign.h>
#include <stdint.h>
#include <stdlib.h>

static void *arena_alloc(void *data, size_t size)
{
	bb_arena *a = data;
	/* Aligned for anything protobuf-c stores (uint64_t, double, pointers). */
	size_t at = (a->used + alignof(max_align_t) - 1) & ~(alignof(max_align_t) - 1);
	if (at <= a->cap && size <= a->cap - at) {
		a->used = at + size;
		return a->base + at;
	}
	void *p = malloc(size);
	if (p)
		a->spilled++;
	return p;
}

static void arena_free(void *data, void *p)
{
	bb_arena *a = data;
	uintptr_t u = (uintptr_t)p, lo = (uintptr_t)a->base;
	if (!p || (u >= lo && u < lo + a->cap))
		return;
	free(p);
	a->spilled--;
}

void bb_arena_init(bb_arena *a, void *buf, size_t cap)
{
	a->pc.alloc = arena_alloc;
	a->pc.free = arena_free;
	a->pc.allocator_data = a;
	a->base = buf;
	a->cap = cap;
	a->used = 0;
	a->spilled = 0;
}

void bb_arena_reset(bb_arena *a)
{
	a->used = 0;
}
