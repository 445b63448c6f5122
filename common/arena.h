/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A bump allocator for protobuf-c: unpacking a message makes several small
 * allocations (the message, each sub-message, each string) that all die
 * together when the request is answered. Served from one fixed block they
 * cost a pointer bump each and nothing to free; what does not fit comes
 * from malloc, so no message is too large for it.
 */
#ifndef BB_ARENA_H
#define BB_ARENA_H

#include <stddef.h>

#include <protobuf-c/protobuf-c.h>

typedef struct bb_arena {
	ProtobufCAllocator pc; /* pass &pc to protobuf-c's unpack and free_unpacked */
	unsigned char *base;   /* the block */
	size_t cap;            /* its bytes */
	size_t used;           /* bytes handed out since the last reset */
	size_t spilled;        /* live allocations that came from malloc */
} bb_arena;

/* Serve allocations from the cap bytes at buf (the caller's, kept for the
 * arena's life). */
void bb_arena_init(bb_arena *a, void *buf, size_t cap);

/* Forget every allocation from the block. Allocations that spilled to
 * malloc must have been freed first (free_unpacked does it): spilled is 0
 * when none is live, and a message unpacked without a spill needs no
 * free_unpacked at all. */
void bb_arena_reset(bb_arena *a);

#endif /* BB_ARENA_H */
