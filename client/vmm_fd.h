/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The file descriptors of VMM CUDA allocations as one connection holds
 * them (vmm_fd.c). The daemon attaches an allocation's fd to a grant
 * exactly when the connection held no count on any buffer of that
 * allocation just before; the connection keeps that fd while it has a
 * handle in the allocation, and asks for it again (AllocationFd) when it
 * needs one it no longer has. Not installed.
 */
#ifndef BB_CLIENT_VMM_FD_H
#define BB_CLIENT_VMM_FD_H

#include "handle.h"

/* One allocation's fd on one connection. */
struct vmm_fd {
	uint64_t allocation; /* the hash key: Grant.allocation */
	int fd;              /* the allocation's fd, or -1 until asked for again */
	unsigned long users; /* handles of the connection in the allocation */
	int listed;          /* in client->vmm_fds (uthash's out-of-memory flag) */
	UT_hash_handle hh;   /* client->vmm_fds */
};

/* Count b, a new VMM handle of c that carries its allocation (has_vmm),
 * and keep fd (the grant's, or -1) for that allocation unless c keeps one
 * already (then fd is closed). Consumes fd. c->mu held. */
void bbc_vmm_fd_add_locked(bb_client *c, bb_buf *b, int fd);
/* Offer fd (a grant's, or -1) for allocation to c, which keeps it when
 * it has handles in that allocation and no fd for it yet; else it is
 * closed. Consumes fd. c->mu held. */
void bbc_vmm_fd_offer_locked(bb_client *c, uint64_t allocation, int fd);
/* Give up b's use of its connection's fd: the last handle of an
 * allocation closes it. Call before the Release that may free it. */
void bbc_vmm_fd_drop(bb_buf *b);
/* Close every fd c keeps (c is being freed). */
void bbc_vmm_fd_clear(bb_client *c);
/* An fd for b's allocation: the connection's (borrowed: valid while b
 * lives; *owned 0), or a fresh one from the daemon (AllocationFd) that the
 * connection keeps or, when it cannot, that the caller closes (*owned 1).
 * 0, or BB_ERR_* with the last error set. */
int bbc_vmm_fd_get(bb_buf *b, int *fd_out, int *owned);

#endif /* BB_CLIENT_VMM_FD_H */
