/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The handle (struct bb_buf) as the library's files share it: handle.c
 * makes, counts and frees handles; map_host.c and cuda_map.c map them;
 * connect.c frees those a disconnect leaves. Not installed.
 */
#ifndef BB_CLIENT_HANDLE_H
#define BB_CLIENT_HANDLE_H

#include "rpc.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* A handle the table cannot take (out of memory) stays unlisted: it works,
 * it just is not coalesced with later opens of the same id. A CUDA
 * allocation the cache cannot list is closed again (cuda_open in
 * cuda_map.c). Every file of the library that uses uthash gets it from
 * here, so that these two come before uthash.h. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) ((obj)->listed = 0)
#include <uthash.h>

struct cuda_alloc;
struct vmm_slab;

struct bb_buf {
	bb_client *client;
	uint64_t id;
	size_t size;
	bb_kind kind;
	int device;
	_Atomic uint64_t count;     /* local counts; reaches 0 only under client->mu */
	pthread_mutex_t map_mu;     /* serializes the first bb_map */
	int fd;                     /* host memfd until mapped, else -1 (map_mu) */
	_Atomic(void *) map;        /* host mapping or CUDA device pointer, once made */
	struct cuda_alloc *cmap;    /* legacy CUDA: the opened allocation, once mapped (map_mu) */
	struct vmm_slab *vmap;      /* VMM CUDA: the imported allocation, once mapped (map_mu) */
	int listed;                 /* in client->bufs (client->mu) */
	UT_hash_handle hh;          /* client->bufs, keyed by id */
	struct bb_buf *prev, *next; /* client->all (client->mu) */
	/* CUDA: where the buffer lives, from the grant; fixed once made. */
	bb_cuda_handle handle;                        /* LEGACY or VMM; DEFAULT for host */
	int has_ipc;                                  /* LEGACY: the grant carried these fields */
	int has_vmm;                                  /* VMM: the grant carried these fields */
	int vmm_counted;                              /* VMM: counted in client->vmm_fds */
	uint64_t allocation_size;                     /* VMM: bytes of the allocation */
	unsigned char ipc_handle[BB_IPC_HANDLE_SIZE]; /* the allocation's IPC handle */
	uint64_t ipc_offset;           /* buffer start inside the allocation (both) */
	uint64_t allocation;           /* the daemon's id of the allocation */
	unsigned char device_uuid[16]; /* the device it lives on */
};

/* Unmap, close and free b, which is off every list of its client. A CUDA
 * handle gives up its use of the allocation, which closes the allocation
 * when it was the last: callers free before they send the Release that
 * could let the daemon free the memory. */
void bbc_buf_free(bb_buf *b);

#endif /* BB_CLIENT_HANDLE_H */
