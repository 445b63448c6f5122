/*
 * The host backend: every buffer is its own memfd, sealed so that no
 * client can shrink or grow it under another's mapping (SIGBUS) or add a
 * write seal that locks the others out.
 */
#include <errno.h>
#include <fcntl.h>
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

/* The backend's own books, for the invariant check. */
typedef struct host_backend {
	backend be;          /* be.ctx points here */
	uint64_t live;       /* memfds handed to the broker and not yet freed */
	uint64_t live_bytes; /* their sizes as asked for */
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

static int sys_fail(char *err, size_t errlen, const char *what)
{
	int e = errno;
	snprintf(err, errlen, "%s: %s", what, strerror(e));
	return (e == ENOMEM || e == EMFILE || e == ENFILE || e == ENOSPC) ? BB_ERR_NO_MEMORY
									 : BB_ERR_SYSTEM;
}

static int host_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share,
		      backend_mem *out, char *err, size_t errlen)
{
	(void)device;
	(void)uid;
	(void)share;
	int fd = memfd_create("bufbroker", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return sys_fail(err, errlen, "memfd_create");
	if (ftruncate(fd, (off_t)size) < 0) {
		int rc = sys_fail(err, errlen, "ftruncate of a new memfd");
		close(fd);
		return rc;
	}
	if (fcntl(fd, F_ADD_SEALS, HOST_SEALS) < 0) {
		int rc = sys_fail(err, errlen, "sealing a new memfd");
		close(fd);
		return rc;
	}
	out->fd = fd;
	out->size = size;
	out->priv = NULL;
	host_count(be, 1, size);
	return 0;
}

static int host_import(backend *be, int fd, uint64_t size, backend_mem *out, char *err,
		       size_t errlen)
{
	struct stat st;
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		snprintf(err, errlen, "the fd is not a memfd that allows sealing "
				      "(create it with memfd_create(..., MFD_ALLOW_SEALING))");
		return BB_ERR_INVALID;
	}
	if (seals & F_SEAL_SEAL) {
		snprintf(err, errlen, "the memfd does not accept new seals (F_SEAL_SEAL is set, "
				      "or it was made without MFD_ALLOW_SEALING)");
		return BB_ERR_INVALID;
	}
	if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
		snprintf(err, errlen, "the memfd carries a write seal; others could not map it writable");
		return BB_ERR_INVALID;
	}
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0 || (fl & O_ACCMODE) != O_RDWR) {
		snprintf(err, errlen, "the fd must be open for reading and writing");
		return BB_ERR_INVALID;
	}
	/* Refuse a short file before sealing it: a refused import leaves the
	 * caller's memfd as it was. */
	if (fstat(fd, &st) < 0)
		return sys_fail(err, errlen, "fstat of the imported memfd");
	if ((uint64_t)st.st_size < size) {
		snprintf(err, errlen, "the memfd has %lld bytes; %llu were asked for",
			 (long long)st.st_size, (unsigned long long)size);
		return BB_ERR_INVALID;
	}
	int mine = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	if (mine < 0)
		return sys_fail(err, errlen, "duplicating the imported fd");
	if (fcntl(mine, F_ADD_SEALS, HOST_SEALS) < 0) {
		snprintf(err, errlen, "could not seal the memfd: %s", strerror(errno));
		close(mine);
		return BB_ERR_INVALID;
	}
	/* And again after sealing: before it, the sender could still shrink
	 * the file between the first check and the seal. */
	if (fstat(mine, &st) < 0) {
		int rc = sys_fail(err, errlen, "fstat of the imported memfd");
		close(mine);
		return rc;
	}
	if ((uint64_t)st.st_size < size) {
		snprintf(err, errlen, "the memfd has %lld bytes; %llu were asked for",
			 (long long)st.st_size, (unsigned long long)size);
		close(mine);
		return BB_ERR_INVALID;
	}
	out->fd = mine;
	out->size = size;
	out->priv = NULL;
	host_count(be, 1, size);
	return 0;
}

static void host_free(backend *be, backend_mem *mem)
{
	if (mem->fd >= 0) {
		close(mem->fd);
		host_count(be, -1, mem->size);
	}
	mem->fd = -1;
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
	free(be->ctx);
}

backend *backend_host_new(void)
{
	host_backend *hb = calloc(1, sizeof(*hb));
	if (!hb)
		return NULL;
	backend *be = &hb->be;
	be->ctx = hb;
	be->name = "host";
	be->alloc = host_alloc;
	be->import_fd = host_import;
	be->free = host_free;
	be->export_mem = host_export;
	be->destroy = host_destroy;
	be->usage = host_usage;
	return be;
}
