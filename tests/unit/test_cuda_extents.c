/*
 * The CUDA backend's extents inside a slab: after every alloc and free the
 * extents tile the slab with no gap, no overlap and no two free ranges side
 * by side; freeing merges a buffer with its free neighbours without walking
 * any list; an emptied slab is one free range, then cached or released.
 *
 * The backend runs on tests/fakecuda's driver ($BB_FAKECUDA, else the
 * libfakecuda.so built next to this binary: ctest gives unit tests no
 * environment). Jobs queue and run when the test says, as the server runs
 * them. Unit tests link only the broker core, so this file includes the
 * backend itself, and before that redefines utlist's walks to count their
 * steps: that is how a test tells a search from no search without a clock.
 */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <utlist.h>

/* Steps of every DL_FOREACH / DL_FOREACH_SAFE in the backend. */
static unsigned long long walk_steps;
#undef DL_FOREACH
#define DL_FOREACH(head, el) for ((el) = (head); (el) && (++walk_steps, 1); (el) = (el)->next)
#undef DL_FOREACH_SAFE
#define DL_FOREACH_SAFE(head, el, tmp) \
	for ((el) = (head); (el) && (++walk_steps, (tmp) = (el)->next, 1); (el) = (tmp))

#include "../../daemon/backend_cuda.c"
#include "../../daemon/log.c"
#include "cuda_fixture.h"

#define UID 1000
#define MiB (1024ull * 1024)
#define ALIGN BACKEND_CUDA_ALIGN

static void setup(void)
{
	fake_setup("cuda-extents");
}

/* A backend with slabs of slab_bytes that caches cache_bytes of them. */
static void start(uint64_t slab_bytes, uint64_t cache_bytes)
{
	backend_cuda_config cfg;
	backend_cuda_config_default(&cfg);
	cfg.slab_bytes = slab_bytes;
	cfg.cache_bytes = cache_bytes;
	be = backend_cuda_new(&cfg, err, sizeof(err));
	cr_assert_not_null(be, "backend_cuda_new: %s", err);
	be->submit = queue_job;
}

TestSuite(cuda_extents, .init = setup, .fini = teardown);

static cuda_dev *dev0(void)
{
	return &((cuda_backend *)be->ctx)->devs[0];
}

/* Alloc size bytes, running jobs while the backend grows. */
static backend_mem alloc_mem(uint64_t size)
{
	backend_mem m;
	int rc;
	memset(&m, 0, sizeof(m));
	while ((rc = be->alloc(be, size, 0, UID, BB_SHARE_UID, &(int){BB_CUDA_HANDLE_DEFAULT}, &m,
			       err, sizeof(err))) == BACKEND_GROW)
		cr_assert(run_one(), "alloc waits for a grow but no job is queued");
	cr_assert_eq(rc, 0, "alloc of %llu bytes: %s", (unsigned long long)size, err);
	cr_assert_not_null(m.priv);
	return m;
}

static slab *slab_of(const backend_mem *m)
{
	return ((const extent *)m->priv)->slab;
}

/* ---- the books of a slab ------------------------------------------------------- */

/* Check that the extents of s tile [0, size) in address order, aligned, no
 * two free ones side by side; that the live ones number s->live and the
 * free list holds exactly the free ones, each linked where it lies.
 * Returns the number of free extents. */
static unsigned check_slab(const slab *s)
{
	const extent *e, *prev = NULL;
	uint64_t off = 0;
	unsigned nfree = 0, nlive = 0, onlist = 0;

	cr_assert_not_null(s->extents, "a slab without extents");
	for (e = s->extents; e; prev = e, e = e->anext) {
		if (e->slab != s || e->off != off || e->len == 0 || e->len % ALIGN ||
		    (prev && e->aprev != prev))
			cr_assert_fail("extent at %llu+%llu breaks the tiling at %llu",
				       (unsigned long long)e->off, (unsigned long long)e->len,
				       (unsigned long long)off);
		if (extent_is_free(e)) {
			if (prev && extent_is_free(prev))
				cr_assert_fail("free extents at %llu and %llu are not merged",
					       (unsigned long long)prev->off,
					       (unsigned long long)e->off);
			nfree++;
		} else {
			nlive++;
		}
		off += e->len;
	}
	cr_assert_eq(off, s->size, "the extents cover %llu of %llu bytes", (unsigned long long)off,
		     (unsigned long long)s->size);
	cr_assert_eq(s->extents->aprev, prev, "the head's aprev is not the tail");
	cr_assert_eq(nlive, s->live, "%u live extents, %u buffers", nlive, s->live);
	for (e = s->free; e && onlist <= nfree; e = e->next, onlist++) {
		if (e->slab != s || !extent_is_free(e) ||
		    (e != s->extents && e->aprev->anext != e) || (e->anext && e->anext->aprev != e))
			cr_assert_fail("free-list extent at %llu is not on the address list",
				       (unsigned long long)e->off);
	}
	cr_assert_eq(onlist, nfree, "%u extents on the free list, %u free by address", onlist,
		     nfree);
	return nfree;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static void shuffle(unsigned *a, unsigned n)
{
	for (unsigned i = n - 1; i > 0; i--) {
		unsigned j = (unsigned)(next_rand() % (i + 1));
		unsigned t = a[i];
		a[i] = a[j];
		a[j] = t;
	}
}

/* Fill a slab of slab_bytes with buffers of size bytes (a multiple of
 * ALIGN): n of them, all in one slab, in address order. The slab has no
 * free extent left. */
static backend_mem *fill(uint64_t slab_bytes, uint64_t size, unsigned *n)
{
	*n = (unsigned)(slab_bytes / size);
	backend_mem *m = calloc(*n, sizeof(*m));
	cr_assert_not_null(m);
	for (unsigned i = 0; i < *n; i++) {
		m[i] = alloc_mem(size);
		cr_assert_eq(slab_of(&m[i]), slab_of(&m[0]), "buffer %u left the slab", i);
		cr_assert_eq(((extent *)m[i].priv)->off, (uint64_t)i * size);
	}
	drain(); /* the grow's settle */
	const slab *s = slab_of(&m[0]);
	cr_assert_eq(s->size, slab_bytes);
	cr_assert_eq(check_slab(s), 0, "a full slab has a free extent");
	cr_assert_null(s->free);
	return m;
}

/* Free n equal buffers of a full slab in a shuffled order, checking the
 * books after each free. Returns the slab's pool. */
static pool *free_shuffled(backend_mem *m, unsigned n)
{
	slab *s = slab_of(&m[0]);
	pool *p = s->pool;
	unsigned *order = calloc(n, sizeof(*order));
	bool *freed = calloc(n, sizeof(*freed));
	unsigned runs = 0; /* maximal runs of freed buffers: the free extents due */
	cr_assert(order && freed);
	for (unsigned i = 0; i < n; i++)
		order[i] = i;
	shuffle(order, n);
	for (unsigned k = 0; k + 1 < n; k++) {
		unsigned i = order[k];
		be->free(be, &m[i]);
		cr_assert_null(m[i].priv);
		freed[i] = true;
		/* A new run, one grown, or two joined. */
		runs = runs + 1 - (i > 0 && freed[i - 1]) - (i + 1 < n && freed[i + 1]);
		unsigned nfree = check_slab(s);
		cr_assert_eq(nfree, runs, "after %u frees: %u free extents, %u free runs", k + 1,
			     nfree, runs);
	}
	be->free(be, &m[order[n - 1]]);
	free(order);
	free(freed);
	return p;
}

/* ---- tests ---------------------------------------------------------------- */

Test(cuda_extents, shuffled_frees_keep_the_slab_tiled_and_merged_then_cached)
{
	unsigned n;
	start(2 * MiB, 2 * MiB);
	backend_mem *m = fill(2 * MiB, ALIGN, &n);
	slab *s = slab_of(&m[0]);
	pool *p = free_shuffled(m, n);

	cr_assert_eq(p->slabs, s, "the emptied slab left its pool");
	cr_assert_null(s->next);
	cr_assert_eq(check_slab(s), 1);
	cr_assert_eq(s->free, s->extents, "the one free extent is the slab's only extent");
	cr_assert_eq(s->free->off, 0);
	cr_assert_eq(s->free->len, s->size);
	cr_assert(s->cached, "the emptied slab is not cached");
	cr_assert_eq(dev0()->cached, s->size);
	cr_assert_eq(dev0()->used, 0);
	cr_assert_eq(dev0()->reserved, s->size);
	cr_assert_eq(queued, 0, "a cached slab was freed");

	/* The cached slab serves the next buffer from its start. */
	backend_mem again = alloc_mem(ALIGN);
	cr_assert_eq(slab_of(&again), s);
	cr_assert_eq(((extent *)again.priv)->off, 0);
	cr_assert(!s->cached);
	be->free(be, &again);
	free(m);
}

Test(cuda_extents, shuffled_frees_release_the_slab_when_nothing_is_cached)
{
	unsigned n;
	start(2 * MiB, 0);
	backend_mem *m = fill(2 * MiB, 4 * ALIGN, &n);
	pool *p = free_shuffled(m, n);

	cr_assert_null(p->slabs, "the emptied slab stayed with nothing cached");
	cr_assert_eq(dev0()->cached, 0);
	cr_assert_eq(dev0()->freeing, 2 * MiB, "the slab's free job is not in flight");
	drain();
	cr_assert_eq(dev0()->freeing, 0);
	cr_assert_eq(dev0()->reserved, 0, "the slab's memory was not given back");
	cr_assert_eq(dev0()->used, 0);
	free(m);
}

/* The old free walked the free list from the lowest offset to find its
 * neighbours: about n*n/8 steps for n shuffled frees. */
Test(cuda_extents, freeing_walks_no_list)
{
	unsigned n;
	start(4 * MiB, 4 * MiB);
	backend_mem *m = fill(4 * MiB, ALIGN, &n);
	slab *s = slab_of(&m[0]);
	unsigned *order = calloc(n, sizeof(*order));
	cr_assert_not_null(order);
	for (unsigned i = 0; i < n; i++)
		order[i] = i;
	shuffle(order, n);

	walk_steps = 0;
	for (unsigned k = 0; k < n; k++)
		be->free(be, &m[order[k]]);
	/* The last free caches the slab; nothing else may walk. */
	cr_assert_leq(walk_steps, 16, "%u shuffled frees took %llu list steps", n, walk_steps);
	cr_assert_eq(check_slab(s), 1);
	cr_assert(s->cached);
	free(order);
	free(m);
}

Test(cuda_extents, mixed_sizes_split_and_merge_in_place)
{
	enum { MAX = 2048 };
	backend_mem *m = calloc(MAX, sizeof(*m));
	cr_assert_not_null(m);
	unsigned n = 0;
	start(2 * MiB, 2 * MiB);

	/* Fill the slab with sizes of 1 byte to 8 KiB. */
	m[n++] = alloc_mem(1);
	slab *s = slab_of(&m[0]);
	drain();
	uint64_t used = ALIGN;
	for (;;) {
		uint64_t size = 1 + next_rand() % (8 * 1024);
		if (used + align_up(size, ALIGN) > s->size)
			break;
		m[n++] = alloc_mem(size);
		cr_assert_eq(slab_of(&m[n - 1]), s);
		used += align_up(size, ALIGN);
	}
	check_slab(s);

	for (int round = 0; round < 40; round++) {
		/* Free about half, in a random order. */
		for (unsigned k = 0; k < n;) {
			if (next_rand() % 2) {
				be->free(be, &m[k]);
				m[k] = m[--n];
				check_slab(s);
			} else {
				k++;
			}
		}
		/* Allocate into the holes while one fits (never grow). */
		for (;;) {
			uint64_t size = 1 + next_rand() % (8 * 1024);
			const extent *e;
			for (e = s->free; e && e->len < align_up(size, ALIGN); e = e->next)
				;
			if (!e || n == MAX)
				break;
			uint64_t at = e->off;
			m[n++] = alloc_mem(size);
			const extent *x = m[n - 1].priv;
			cr_assert_eq(x->slab, s);
			cr_assert_eq(x->off, at, "first fit took %llu, not the free range at %llu",
				     (unsigned long long)x->off, (unsigned long long)at);
			cr_assert_eq(x->len, align_up(size, ALIGN));
			check_slab(s);
		}
	}
	while (n > 0) {
		be->free(be, &m[--n]);
		check_slab(s);
	}
	cr_assert_eq(check_slab(s), 1);
	cr_assert_eq(s->free->len, s->size);
	cr_assert(s->cached);
	cr_assert_null(s->next, "a second slab was made");
	free(m);
}

Test(cuda_extents, dedicated_allocation_is_one_live_extent_then_released)
{
	start(2 * MiB, 2 * MiB);
	uint64_t size = 3 * MiB + 100;
	backend_mem m = alloc_mem(size);
	slab *s = slab_of(&m);
	pool *p = s->pool;
	drain();
	cr_assert(s->dedicated);
	cr_assert_eq(s->size, align_up(size, ALIGN));
	cr_assert_eq(check_slab(s), 0);
	cr_assert_eq(s->extents, m.priv, "the buffer is not the slab's only extent");
	cr_assert_null(s->free);

	be->free(be, &m);
	cr_assert_null(p->slabs, "the dedicated slab stayed");
	drain();
	cr_assert_eq(dev0()->reserved, 0);
	cr_assert_eq(dev0()->cached, 0);
}

Test(cuda_extents, extent_fits_a_64_byte_malloc_chunk)
{
	/* A daemon holds one extent per CUDA buffer: calloc(56) and less
	 * take a 64-byte chunk on glibc, 57 to 72 take 80. */
	cr_assert_leq(sizeof(extent), 56);
}
