/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bb_map: host buffers are mapped here from the memfd their grant carried;
 * CUDA buffers go to the allocation cache (cuda_map.c).
 */
#include "cuda_map.h"
#include "handle.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/mman.h>
#include <unistd.h>

/* Host mappings from 2 MiB up ask for transparent huge pages over their
 * whole 2 MiB extents. Where the kernel lets shmem use them
 * (/sys/kernel/mm/transparent_hugepage/shmem_enabled advise, within_size
 * or always), the first touch of a buffer costs one fault per 2 MiB instead
 * of one per 4 KiB page: the cost of a consumer's first read of a buffer it
 * has never mapped. Elsewhere the advice is kept and does nothing. The
 * partial tail is left out, so a huge page never holds memory past the
 * buffer's end. Where it may use huge pages, shmem places mappings
 * this large on a 2 MiB boundary. */
#define THP_BYTES ((size_t)2 << 20)

static void *map_host(int fd, size_t size)
{
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	size_t huge = size & ~(THP_BYTES - 1);

	/* Advice only: a kernel without THP says EINVAL and maps as before. */
	if (p != MAP_FAILED && huge)
		(void)madvise(p, huge, MADV_HUGEPAGE);
	return p;
}

BB_EXPORT int bb_map(bb_buf *b, void **ptr_out)
{
	void *p;
	int rc = 0;

	if (!b || !ptr_out)
		return bbc_fail(BB_ERR_INVALID, "bb_map: buffer and ptr_out are required");
	*ptr_out = NULL;
	if (b->kind == BB_CUDA)
		return bbc_cuda_map(b, ptr_out);
	p = atomic_load_explicit(&b->map, memory_order_acquire);
	if (p) {
		*ptr_out = p;
		return 0;
	}
	pthread_mutex_lock(&b->map_mu);
	p = atomic_load_explicit(&b->map, memory_order_relaxed);
	if (!p) {
		if (b->fd < 0) {
			rc = bbc_fail(BB_ERR_SYSTEM, "buffer %" PRIu64 " has no memory to map",
				      b->id);
		} else {
			p = map_host(b->fd, b->size);
			if (p == MAP_FAILED) {
				int e = errno;
				char eb[128];

				p = NULL;
				rc = bbc_fail(e == ENOMEM ? BB_ERR_NO_MEMORY : BB_ERR_SYSTEM,
					      "mapping buffer %" PRIu64 " (%zu bytes) failed: %s",
					      b->id, b->size, bbc_errstr(e, eb, sizeof(eb)));
			} else {
				/* The mapping keeps the file; the fd is no longer needed. */
				close(b->fd);
				b->fd = -1;
				atomic_store_explicit(&b->map, p, memory_order_release);
			}
		}
	}
	pthread_mutex_unlock(&b->map_mu);
	*ptr_out = p;
	return rc;
}
