/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The host backend: every buffer is its own memfd, sealed so that no
 * client can shrink or grow it under another's mapping (SIGBUS) or add a
 * write seal that locks the others out.
 *
 * Freed memfds may be kept for reuse (backend_host_pool turns it on):
 * memfd_create, ftruncate and F_ADD_SEALS cost more than one fallocate,
 * and a sealed memfd's size never changes, so its page-rounded size is an
 * exact size class. The rules that keep this safe:
 *
 * - Memory is returned when the buffer is freed: the pooled memfd's pages
 *   are punched out (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE) before
 *   it enters the pool, and a memfd that cannot be punched is closed.
 * - A client that was sent the fd may keep it (or its mapping) forever
 *   and still read and write the file. So a memfd is reused only for a
 *   buffer of the uid it was made for (processes of one uid can already
 *   read each other's memory), and never once it was sent to a process of
 *   another uid: the request layer reports those sends with
 *   backend_host_exposed, and an exposed memfd is closed when freed.
 * - A memfd from import_fd is never pooled: its maker has it.
 * - A reused memfd is punched again, so the new buffer reads zeros even
 *   if a stale holder wrote to it after the free.
 * - The pool is bounded in all and per (uid, size class); beyond a bound
 *   the oldest pooled memfd is closed. destroy closes every pooled memfd.
 *   Pooled memfds are not live: usage does not count them.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "bufbroker/bufbroker.h"

#define HOST_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

#define WORD_BITS 64

/* A freed memfd kept for reuse. */
typedef struct host_pooled {
	int fd;         /* sealed memfd, its pages punched out */
	uint32_t uid;   /* the uid it was made for */
	uint64_t bytes; /* its file size: the size class */
} host_pooled;

/* The backend's own books. */
typedef struct host_backend {
	backend be;                    /* be.ctx points here */
	uint64_t live;                 /* memfds handed to the broker and not yet freed */
	uint64_t live_bytes;           /* their sizes as asked for */
	uint64_t page;                 /* sizes round up to this */
	host_pooled *pool;             /* pooled memfds, oldest first */
	unsigned pool_n;               /* entries used in pool */
	unsigned pool_max;             /* room in pool; 0: pooling off */
	unsigned pool_per_class;       /* the most of one (uid, bytes) */
	uint64_t *exposed;             /* bit per fd number: close that memfd on free */
	size_t exposed_words;          /* words in exposed */
	backend_host_pool_stats stats; /* pooled is pool_n, filled in on request */
} host_backend;

/* One memory more (delta 1) or fewer (delta -1). */
static void host_count(backend *be, int delta, uint64_t size)
{
	host_backend *hb = be->ctx;
	if (delta > 0) {
		hb->live++;
		hb->live_bytes += size;
	} else {
		hb->live--;
		hb->live_bytes -= size;
	}
}

/* Hand fd out as the memory of a buffer of size bytes made for uid. */
static void host_give(backend *be, int fd, uint32_t uid, uint64_t size, backend_mem *out)
{
	out->fd = fd;
	out->uid = uid;
	out->size = size;
	out->priv = NULL;
	host_count(be, 1, size);
}

static int sys_fail(char *err, size_t errlen, const char *what)
{
	int e = errno;
	snprintf(err, errlen, "%s: %s", what, strerror(e));
	return (e == ENOMEM || e == EMFILE || e == ENFILE || e == ENOSPC) ? BB_ERR_NO_MEMORY
									  : BB_ERR_SYSTEM;
}

/* The file size for a buffer of size bytes: whole pages. A size too large
 * to round stays as it is (ftruncate refuses it). */
static uint64_t host_class(const host_backend *hb, uint64_t size)
{
	if (size > UINT64_MAX - (hb->page - 1))
		return size;
	return (size + hb->page - 1) / hb->page * hb->page;
}

/* Return the pages of fd's first bytes to the system; they read as zeros
 * afterwards, in every mapping. */
static int host_punch(int fd, uint64_t bytes)
{
	return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)bytes);
}

/* ---- exposure: one bit per fd number ------------------------------------- */

/* Make the exposed bits cover fd and set its bit to on: every memfd the
 * backend hands out goes through here, so a bit never outlives its memfd
 * into another. -1 when the bits cannot grow. */
static int host_track(host_backend *hb, int fd, bool on)
{
	size_t w = (size_t)fd / WORD_BITS;
	if (w >= hb->exposed_words) {
		size_t n = hb->exposed_words ? hb->exposed_words : 16;
		while (n <= w)
			n *= 2;
		uint64_t *bits = realloc(hb->exposed, n * sizeof(*bits));
		if (!bits)
			return -1;
		memset(bits + hb->exposed_words, 0, (n - hb->exposed_words) * sizeof(*bits));
		hb->exposed = bits;
		hb->exposed_words = n;
	}
	uint64_t bit = UINT64_C(1) << ((unsigned)fd % WORD_BITS);
	if (on)
		hb->exposed[w] |= bit;
	else
		hb->exposed[w] &= ~bit;
	return 0;
}

/* Whether fd's memfd was exposed; clears the bit (the memfd is being freed). */
static bool host_untrack(host_backend *hb, int fd)
{
	size_t w = (size_t)fd / WORD_BITS;
	if (w >= hb->exposed_words)
		return true; /* not ours: never pool it */
	uint64_t bit = UINT64_C(1) << ((unsigned)fd % WORD_BITS);
	bool was = hb->exposed[w] & bit;
	hb->exposed[w] &= ~bit;
	return was;
}

void backend_host_exposed(backend *be, int fd)
{
	host_backend *hb = be->ctx;
	/* Within the bits, host_track cannot fail; beyond them fd is not ours. */
	if (fd >= 0 && (size_t)fd / WORD_BITS < hb->exposed_words)
		host_track(hb, fd, true);
}

/* ---- the pool: an array, oldest first ------------------------------------ */

/* Take entry i out of the pool; its fd is the caller's. */
static int pool_remove(host_backend *hb, unsigned i)
{
	int fd = hb->pool[i].fd;
	memmove(&hb->pool[i], &hb->pool[i + 1], (hb->pool_n - i - 1) * sizeof(hb->pool[0]));
	hb->pool_n--;
	return fd;
}

/* Close every pooled memfd. */
static void pool_drain(host_backend *hb)
{
	while (hb->pool_n > 0) {
		close(pool_remove(hb, hb->pool_n - 1));
		hb->stats.evicted++;
	}
}

/* The newest pooled memfd of (uid, bytes), punched again, or -1. */
static int pool_take(host_backend *hb, uint32_t uid, uint64_t bytes)
{
	for (unsigned i = hb->pool_n; i-- > 0;) {
		const host_pooled *p = &hb->pool[i];
		if (p->uid != uid || p->bytes != bytes)
			continue;
		int fd = pool_remove(hb, i);
		/* Zeros even if a stale holder wrote after the free. */
		if (host_punch(fd, bytes) < 0) {
			close(fd);
			hb->stats.evicted++;
			return -1;
		}
		return fd;
	}
	return -1;
}

/* Keep fd (pages punched) for a later alloc of (uid, bytes), closing the
 * oldest of its class or of all to make room. false: not pooled, the
 * caller closes fd. */
static bool pool_put(host_backend *hb, int fd, uint32_t uid, uint64_t bytes)
{
	if (hb->pool_max == 0)
		return false;
	if (host_punch(fd, bytes) < 0)
		return false;
	unsigned same = 0, oldest_same = 0;
	for (unsigned i = 0; i < hb->pool_n; i++) {
		if (hb->pool[i].uid == uid && hb->pool[i].bytes == bytes && same++ == 0)
			oldest_same = i;
	}
	if (same >= hb->pool_per_class) {
		close(pool_remove(hb, oldest_same));
		hb->stats.evicted++;
	} else if (hb->pool_n >= hb->pool_max) {
		close(pool_remove(hb, 0));
		hb->stats.evicted++;
	}
	hb->pool[hb->pool_n++] = (host_pooled){.fd = fd, .uid = uid, .bytes = bytes};
	return true;
}

int backend_host_pool(backend *be, unsigned max, unsigned per_class)
{
	host_backend *hb = be->ctx;
	pool_drain(hb);
	free(hb->pool);
	hb->pool = NULL;
	hb->pool_max = hb->pool_per_class = 0;
	if (max > BACKEND_HOST_POOL_MAX)
		max = BACKEND_HOST_POOL_MAX;
	if (per_class > max)
		per_class = max;
	if (max == 0 || per_class == 0)
		return 0;
	hb->pool = calloc(max, sizeof(*hb->pool));
	if (!hb->pool)
		return BB_ERR_NO_MEMORY;
	hb->pool_max = max;
	hb->pool_per_class = per_class;
	return 0;
}

void backend_host_pool_info(backend *be, backend_host_pool_stats *out)
{
	const host_backend *hb = be->ctx;
	*out = hb->stats;
	out->pooled = hb->pool_n;
}

/* ---- the backend --------------------------------------------------------- */

/* A new sealed memfd of bytes bytes, or a BB_ERR_* code. */
static int host_create(host_backend *hb, uint64_t bytes, int *fd_out, char *err, size_t errlen)
{
	int fd = memfd_create("bufbroker", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 && (errno == EMFILE || errno == ENFILE) && hb->pool_n > 0) {
		/* Pooled fds are a cache: live buffers come first. */
		pool_drain(hb);
		fd = memfd_create("bufbroker", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	}
	if (fd < 0)
		return sys_fail(err, errlen, "memfd_create");
	if (ftruncate(fd, (off_t)bytes) < 0) {
		int rc = sys_fail(err, errlen, "ftruncate of a new memfd");
		close(fd);
		return rc;
	}
	if (fcntl(fd, F_ADD_SEALS, HOST_SEALS) < 0) {
		int rc = sys_fail(err, errlen, "sealing a new memfd");
		close(fd);
		return rc;
	}
	*fd_out = fd;
	return 0;
}

static int host_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		      backend_mem *out, char *err, size_t errlen)
{
	host_backend *hb = be->ctx;
	(void)device;
	(void)share;
	(void)handle;
	uint64_t bytes = host_class(hb, size);
	int fd = pool_take(hb, uid, bytes);
	if (fd >= 0) {
		hb->stats.reused++;
	} else {
		int rc = host_create(hb, bytes, &fd, err, errlen);
		if (rc)
			return rc;
		if (host_track(hb, fd, false) < 0) {
			close(fd);
			snprintf(err, errlen, "daemon out of memory");
			return BB_ERR_NO_MEMORY;
		}
		hb->stats.created++;
	}
	host_give(be, fd, uid, size, out);
	return 0;
}

/* Whether the memfd behind fd may become a buffer of size bytes: no write
 * seal (others could not map it writable), at least size bytes, and at
 * most one page more (the rest of the file is memory the buffer's owner is
 * not charged for). 0, or a BB_ERR_* code with a sentence in err. */
static int import_check(const host_backend *hb, int fd, uint64_t size, char *err, size_t errlen)
{
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0)
		return sys_fail(err, errlen, "reading the seals of the imported memfd");
	if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
		snprintf(err, errlen,
			 "the memfd carries a write seal; others could not map it writable");
		return BB_ERR_INVALID;
	}
	if (fstat(fd, &st) < 0)
		return sys_fail(err, errlen, "fstat of the imported memfd");
	if ((uint64_t)st.st_size < size) {
		snprintf(err, errlen, "the memfd has %lld bytes; %llu were asked for",
			 (long long)st.st_size, (unsigned long long)size);
		return BB_ERR_INVALID;
	}
	if ((uint64_t)st.st_size - size > hb->page) {
		snprintf(err, errlen,
			 "the memfd has %lld bytes; %llu were asked for, and the file may be "
			 "at most one page (%llu bytes) larger",
			 (long long)st.st_size, (unsigned long long)size,
			 (unsigned long long)hb->page);
		return BB_ERR_INVALID;
	}
	return 0;
}

static int host_import(backend *be, int fd, uint64_t size, backend_mem *out, char *err,
		       size_t errlen)
{
	host_backend *hb = be->ctx;
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		snprintf(err, errlen,
			 "the fd is not a memfd that allows sealing "
			 "(create it with memfd_create(..., MFD_ALLOW_SEALING))");
		return BB_ERR_INVALID;
	}
	if (seals & F_SEAL_SEAL) {
		snprintf(err, errlen,
			 "the memfd does not accept new seals (F_SEAL_SEAL is set, "
			 "or it was made without MFD_ALLOW_SEALING)");
		return BB_ERR_INVALID;
	}
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || (fl & O_ACCMODE) != O_RDWR) {
		snprintf(err, errlen, "the fd must be open for reading and writing");
		return BB_ERR_INVALID;
	}
	/* Refuse before sealing what is refused anyway: a refused import
	 * leaves the caller's memfd as it was. */
	int rc = import_check(hb, fd, size, err, errlen);
	if (rc)
		return rc;
	int mine = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	if (mine < 0)
		return sys_fail(err, errlen, "duplicating the imported fd");
	if (fcntl(mine, F_ADD_SEALS, HOST_SEALS) < 0) {
		snprintf(err, errlen, "could not seal the memfd: %s", strerror(errno));
		close(mine);
		return BB_ERR_INVALID;
	}
	/* And again, on the file the daemon will hand out, now that nobody
	 * can change its size or its seals: until the seal, the sender could
	 * still resize the file or add a write seal behind the first check. */
	if ((rc = import_check(hb, mine, size, err, errlen))) {
		close(mine);
		return rc;
	}
	/* Its maker holds the file: exposed from the start, never pooled. */
	if (host_track(hb, mine, true) < 0) {
		close(mine);
		snprintf(err, errlen, "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	host_give(be, mine, 0, size, out);
	return 0;
}

/* A memfd kept across a restart: sealed as this backend seals (size and
 * seals cannot change any more), and of the size a buffer of size bytes
 * has (page-rounded when allocated; up to one page more when imported). */
static int host_adopt(backend *be, int fd, uint64_t size, uint32_t uid, unsigned flags,
		      backend_mem *out, char *err, size_t errlen)
{
	host_backend *hb = be->ctx;
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || (seals & HOST_SEALS) != HOST_SEALS) {
		snprintf(err, errlen, "the kept fd is not a sealed memfd");
		return BB_ERR_INVALID;
	}
	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < size ||
	    (uint64_t)st.st_size - size > hb->page) {
		snprintf(err, errlen,
			 "the kept memfd has %lld bytes, not those of a %llu-byte buffer",
			 (long long)st.st_size, (unsigned long long)size);
		return BB_ERR_INVALID;
	}
	/* Imported or exposed: others have the file; never pool it. */
	if (host_track(hb, fd, flags != 0) < 0) {
		snprintf(err, errlen, "daemon out of memory");
		return BB_ERR_NO_MEMORY;
	}
	host_give(be, fd, uid, size, out);
	return 0;
}

static void host_free(backend *be, backend_mem *mem)
{
	host_backend *hb = be->ctx;
	int fd = mem->fd;
	if (fd < 0)
		return;
	mem->fd = -1;
	host_count(be, -1, mem->size);
	bool exposed = host_untrack(hb, fd);
	if (exposed || !pool_put(hb, fd, mem->uid, host_class(hb, mem->size))) {
		close(fd);
		hb->stats.closed++;
	}
}

static void host_expose(backend *be, const backend_mem *mem)
{
	backend_host_exposed(be, mem->fd);
}

static int host_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		       size_t errlen)
{
	(void)be;
	(void)err;
	(void)errlen;
	out->fd = mem->fd;
	return 0;
}

static void host_usage(backend *be, uint64_t *buffers, uint64_t *bytes)
{
	const host_backend *hb = be->ctx;
	*buffers = hb->live;
	*bytes = hb->live_bytes;
}

static void host_destroy(backend *be)
{
	host_backend *hb = be->ctx;
	pool_drain(hb);
	free(hb->pool);
	free(hb->exposed);
	free(hb);
}

backend *backend_host_new(void)
{
	host_backend *hb = calloc(1, sizeof(*hb));
	if (!hb)
		return NULL;
	long page = sysconf(_SC_PAGESIZE);
	hb->page = page > 0 ? (uint64_t)page : 4096;
	backend *be = &hb->be;
	be->ctx = hb;
	be->name = "host";
	be->alloc = host_alloc;
	be->import_fd = host_import;
	be->adopt = host_adopt;
	be->free = host_free;
	be->export_mem = host_export;
	be->expose = host_expose;
	be->destroy = host_destroy;
	be->usage = host_usage;
	return be;
}
