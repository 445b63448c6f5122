/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA buffers' device pointers, through one process-wide cache of opened
 * allocations shared by every bb_client (cuda_map.c). Not installed.
 */
#ifndef BB_CLIENT_CUDA_MAP_H
#define BB_CLIENT_CUDA_MAP_H

#include "bufbroker/bufbroker.h"

struct cuda_alloc;
struct vmm_slab;

/* bb_map of a CUDA buffer b: 0 with *ptr_out its device pointer, valid in
 * this process's primary context of the device with b's UUID; or BB_ERR_*
 * with the last error set and *ptr_out unchanged. The first map of b opens
 * b's allocation (legacy) or imports and maps it (VMM), or takes one more
 * use of it from the cache, and records it in b->cmap or b->vmap; later
 * ones answer from b->map. Safe from any thread. */
int bbc_cuda_map(bb_buf *b, void **ptr_out);

/* Drop one use of a (a handle's b->cmap, once per handle); the last one
 * closes the allocation in its device's context and forgets it, so that the
 * caller may then send the Release that lets the daemon free it. */
void bbc_cuda_unuse(struct cuda_alloc *a);

/* 0 when b is a CUDA buffer of handle kind want whose grant said where it
 * lives; else BB_ERR_INVALID (not CUDA), BB_ERR_UNSUPPORTED (the other
 * kind, naming its accessor) or BB_ERR_PROTOCOL, with the last error set:
 * what bb_cuda_ipc_of and bb_cuda_vmm_of answer first. */
int bbc_cuda_handle_check(const bb_buf *b, bb_cuda_handle want);

/* Drop one use of s (a VMM handle's b->vmap, once per handle); the last
 * one unmaps the allocation, frees its address range and releases its
 * handle in this process. */
void bbc_cuda_vmm_unuse(struct vmm_slab *s);

#endif /* BB_CLIENT_CUDA_MAP_H */
