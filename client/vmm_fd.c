/* SPDX-License-Identifier: Apache-2.0 */
/*
 * VMM CUDA allocations' file descriptors per connection (vmm_fd.h), the
 * AllocationFd request that fetches one again, and bb_cuda_vmm_of and
 * bb_cuda_handle_of.
 */
#include "vmm_fd.h"
#include "cuda_map.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void bbc_vmm_fd_add_locked(bb_client *c, bb_buf *b, int fd)
{
	struct vmm_fd *e;

	HASH_FIND(hh, c->vmm_fds, &b->allocation, sizeof(b->allocation), e);
	if (!e) {
		e = calloc(1, sizeof(*e));
		if (!e)
			goto uncounted;
		e->allocation = b->allocation;
		e->fd = -1;
		e->listed = 1;
		HASH_ADD(hh, c->vmm_fds, allocation, sizeof(e->allocation), e);
		if (!e->listed) {
			free(e);
			goto uncounted;
		}
	}
	e->users++;
	b->vmm_counted = 1;
	bbc_vmm_fd_offer_locked(c, b->allocation, fd);
	return;

uncounted:
	/* Out of memory: the handle works, it fetches the fd when it needs
	 * it (bbc_vmm_fd_get) and closes it after. */
	if (fd >= 0)
		close(fd);
}

void bbc_vmm_fd_offer_locked(bb_client *c, uint64_t allocation, int fd)
{
	struct vmm_fd *e;

	if (fd < 0)
		return;
	HASH_FIND(hh, c->vmm_fds, &allocation, sizeof(allocation), e);
	if (e && e->fd < 0)
		e->fd = fd;
	else
		close(fd); /* a duplicate, or nobody to keep it */
}

void bbc_vmm_fd_drop(bb_buf *b)
{
	bb_client *c = b->client;
	struct vmm_fd *e;
	int fd = -1;

	if (!b->vmm_counted)
		return;
	b->vmm_counted = 0;
	pthread_mutex_lock(&c->mu);
	HASH_FIND(hh, c->vmm_fds, &b->allocation, sizeof(b->allocation), e);
	if (e && --e->users == 0) {
		HASH_DEL(c->vmm_fds, e);
		fd = e->fd;
		free(e);
	}
	pthread_mutex_unlock(&c->mu);
	if (fd >= 0)
		close(fd);
}

void bbc_vmm_fd_clear(bb_client *c)
{
	struct vmm_fd *e, *tmp;

	HASH_ITER (hh, c->vmm_fds, e, tmp) {
		HASH_DEL(c->vmm_fds, e);
		if (e->fd >= 0)
			close(e->fd);
		free(e);
	}
}

/* AllocationFd for b's allocation: 0 with *fd_out the fd, or BB_ERR_*. */
static int vmm_fd_fetch(bb_buf *b, int *fd_out)
{
	Bufbroker__AllocationFd af = BUFBROKER__ALLOCATION_FD__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	const Bufbroker__AllocationFdReply *ar;
	Bufbroker__Response *r;
	int fd, rc = 0;

	af.allocation = b->allocation;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOCATION_FD;
	req.allocation_fd = &af;
	rc = bbc_rpc(b->client, &req, -1, BUFBROKER__RESPONSE__RESULT_ALLOCATION_FD, &r, &fd);
	if (rc)
		return rc;
	ar = r->allocation_fd;
	if (fd < 0)
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "bufbrokerd answered AllocationFd for allocation %" PRIu64
			      " without the file descriptor",
			      b->allocation);
	else if (ar->allocation != b->allocation || ar->allocation_size != b->allocation_size)
		rc = bbc_fail(BB_ERR_PROTOCOL,
			      "bufbrokerd answered AllocationFd for allocation %" PRIu64
			      " with allocation %" PRIu64 " of %" PRIu64 " bytes",
			      b->allocation, ar->allocation, ar->allocation_size);
	bbc_response_free(r);
	if (rc) {
		if (fd >= 0)
			close(fd);
		return rc;
	}
	*fd_out = fd;
	return 0;
}

int bbc_vmm_fd_get(bb_buf *b, int *fd_out, int *owned)
{
	bb_client *c = b->client;
	struct vmm_fd *e = NULL;
	int fd, rc;

	pthread_mutex_lock(&c->mu);
	if (b->vmm_counted)
		HASH_FIND(hh, c->vmm_fds, &b->allocation, sizeof(b->allocation), e);
	if (e && e->fd >= 0) {
		*fd_out = e->fd;
		*owned = 0;
		pthread_mutex_unlock(&c->mu);
		return 0;
	}
	pthread_mutex_unlock(&c->mu);

	/* The grant came without the fd (the connection held a buffer of
	 * the allocation then, and has let it go since), or it was not
	 * kept: ask again. b's count is what the daemon wants to see. */
	rc = vmm_fd_fetch(b, &fd);
	if (rc)
		return rc;
	*fd_out = fd;
	*owned = 1;
	pthread_mutex_lock(&c->mu);
	e = NULL;
	if (b->vmm_counted)
		HASH_FIND(hh, c->vmm_fds, &b->allocation, sizeof(b->allocation), e);
	if (e) {
		*owned = 0;
		if (e->fd < 0) {
			e->fd = fd;
		} else {
			close(fd); /* another thread fetched it meanwhile */
			*fd_out = e->fd;
		}
	}
	pthread_mutex_unlock(&c->mu);
	return 0;
}

BB_EXPORT bb_cuda_handle bb_cuda_handle_of(const bb_buf *b)
{
	return b ? b->handle : BB_CUDA_HANDLE_DEFAULT;
}

BB_EXPORT int bb_cuda_vmm_of(bb_buf *b, bb_cuda_vmm *out)
{
	int fd, owned, nfd, rc;

	if (!b || !out)
		return bbc_fail(BB_ERR_INVALID, "bb_cuda_vmm_of: buffer and out are required");
	rc = bbc_cuda_handle_check(b, BB_CUDA_HANDLE_VMM);
	if (rc)
		return rc;
	rc = bbc_vmm_fd_get(b, &fd, &owned);
	if (rc)
		return rc;
	nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (nfd < 0) {
		char eb[128];

		rc = bbc_fail(BB_ERR_SYSTEM,
			      "duplicating the file descriptor of allocation %" PRIu64
			      " failed: %s",
			      b->allocation, bbc_errstr(errno, eb, sizeof(eb)));
	}
	if (owned)
		close(fd);
	if (rc)
		return rc;
	memset(out, 0, sizeof(*out));
	out->fd = nfd;
	out->allocation = b->allocation;
	out->allocation_size = (size_t)b->allocation_size;
	out->offset = b->ipc_offset;
	out->size = b->size;
	memcpy(out->device_uuid, b->device_uuid, sizeof(out->device_uuid));
	return 0;
}
