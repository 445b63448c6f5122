/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Message I/O on SOCK_SEQPACKET sockets: one datagram per call, with at
 * most one file descriptor attached through SCM_RIGHTS. Both the daemon and
 * the client library move every byte through here. (msgio_send_fds and
 * msgio_fds: several fds in one datagram, for the fd store's bundles.)
 */
#ifndef BB_MSGIO_H
#define BB_MSGIO_H

#include <stddef.h>
#include <sys/types.h>

/* Send one datagram of len bytes (len > 0 when fd >= 0: a 0-byte datagram
 * loses its fd) with fd attached unless fd < 0. Never raises SIGPIPE.
 * Returns len, or -errno (-EAGAIN on a full non-blocking socket). */
ssize_t msgio_send(int sock, const void *buf, size_t len, int fd);

/* The same with nfds fds attached, in order (nfds at most SCM_MAX_FD, 253;
 * len > 0 when nfds > 0). */
ssize_t msgio_send_fds(int sock, const void *buf, size_t len, const int *fds, size_t nfds);

/* The fds attached to a received msg, in order: the first max into fds,
 * the rest closed. Returns how many were attached (more than max: some
 * were closed). */
struct msghdr;
size_t msgio_fds(struct msghdr *msg, int *fds, size_t max);

/* Receive one datagram into buf (cap bytes). Returns its length (0 for an
 * empty datagram or end of stream), or -errno. *fd_out gets an attached fd
 * (close-on-exec) or -1; any further fds are closed. *truncated is set when
 * the datagram was longer than cap or carried more than one fd. */
ssize_t msgio_recv(int sock, void *buf, size_t cap, int *fd_out, int *truncated);

/* One datagram of a batch: buf and cap are the caller's; len, fd and
 * truncated are filled as msgio_recv fills its results. */
typedef struct msgio_slot {
	void *buf;     /* where the datagram goes */
	size_t cap;    /* bytes at buf */
	size_t len;    /* its length (0: empty datagram or end of stream) */
	int fd;        /* attached fd (close-on-exec) or -1 */
	int truncated; /* longer than cap, or more than one fd */
} msgio_slot;

/* Most slots one msgio_recv_batch call fills. */
#define MSGIO_BATCH_MAX 16

/* Receive the datagrams already queued on sock, up to n (at most
 * MSGIO_BATCH_MAX), with one recvmmsg (one slot: a recvmsg): pipelined
 * requests cost one system call together. Never waits. Returns how many
 * slots were filled (>= 1), or -errno (-EAGAIN: none queued). */
int msgio_recv_batch(int sock, msgio_slot *slots, unsigned n);

#endif /* BB_MSGIO_H */
