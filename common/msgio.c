/* SPDX-License-Identifier: Apache-2.0 */
/*
 * SOCK_SEQPACKET datagrams with an optional SCM_RIGHTS fd.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "msgio.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

ssize_t msgio_send_fds(int sock, const void *buf, size_t len, const int *fds, size_t nfds)
{
	/* SCM_MAX_FD: the most one datagram carries. */
	enum { MAX_FDS = 253 };
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	union {
		char buf[CMSG_SPACE(MAX_FDS * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};

	if (nfds > 0) {
		if (len == 0 || nfds > MAX_FDS)
			return -EINVAL;
		memset(&ctl, 0, CMSG_SPACE(nfds * sizeof(int)));
		msg.msg_control = ctl.buf;
		msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	for (;;) {
		ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
		if (n >= 0)
			return n;
		if (errno != EINTR)
			return -errno;
	}
}

ssize_t msgio_send(int sock, const void *buf, size_t len, int fd)
{
	return msgio_send_fds(sock, buf, len, &fd, fd >= 0 ? 1 : 0);
}

size_t msgio_fds(struct msghdr *msg, int *fds, size_t max)
{
	size_t n = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < k; i++, n++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
			if (n < max)
				fds[n] = fd;
			else
				close(fd);
		}
	}
	return n;
}

/* Take the fds attached to msg: the first into *fd_out, the rest closed
 * (and *truncated set). */
static void take_fds(struct msghdr *msg, int *fd_out, int *truncated)
{
	size_t n = msgio_fds(msg, fd_out, 1);
	if (n > 1 || (msg->msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
		*truncated = 1;
}

/* One recvmsg into buf with flags (MSG_CMSG_CLOEXEC added), retried on
 * EINTR: msgio_recv, and msgio_recv_batch for a single slot. */
static ssize_t recv_one(int sock, void *buf, size_t cap, int flags, int *fd_out, int *truncated)
{
	struct iovec iov = {.iov_base = buf, .iov_len = cap};
	/* Room for a few fds so that a peer sending several is detected and
	 * none leaks into this process unclosed. */
	union {
		char buf[CMSG_SPACE(8 * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct msghdr msg = {
		.msg_iov = &iov,
		.msg_iovlen = 1,
		.msg_control = ctl.buf,
		.msg_controllen = sizeof(ctl.buf),
	};
	ssize_t n;

	*fd_out = -1;
	*truncated = 0;
	do
		n = recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	take_fds(&msg, fd_out, truncated);
	return n;
}

ssize_t msgio_recv(int sock, void *buf, size_t cap, int *fd_out, int *truncated)
{
	return recv_one(sock, buf, cap, 0, fd_out, truncated);
}

int msgio_recv_batch(int sock, msgio_slot *slots, unsigned n)
{
	struct mmsghdr mm[MSGIO_BATCH_MAX];
	struct iovec iov[MSGIO_BATCH_MAX];
	/* As msgio_recv: room for a few fds per datagram, so that extra ones
	 * are seen and closed. */
	union {
		char buf[CMSG_SPACE(8 * sizeof(int))];
		struct cmsghdr align;
	} ctl[MSGIO_BATCH_MAX];
	int got;

	if (n == 0 || n > MSGIO_BATCH_MAX)
		return -EINVAL;
	if (n == 1) {
		/* recvmsg: the same datagram as a recvmmsg of one, for less work
		 * in the kernel and none setting up the vector. */
		ssize_t len = recv_one(sock, slots[0].buf, slots[0].cap, MSG_DONTWAIT, &slots[0].fd,
				       &slots[0].truncated);
		if (len < 0)
			return (int)len;
		slots[0].len = (size_t)len;
		return 1;
	}
	memset(mm, 0, n * sizeof(mm[0]));
	for (unsigned i = 0; i < n; i++) {
		iov[i].iov_base = slots[i].buf;
		iov[i].iov_len = slots[i].cap;
		mm[i].msg_hdr.msg_iov = &iov[i];
		mm[i].msg_hdr.msg_iovlen = 1;
		mm[i].msg_hdr.msg_control = ctl[i].buf;
		mm[i].msg_hdr.msg_controllen = sizeof(ctl[i].buf);
	}
	do
		got = recvmmsg(sock, mm, n, MSG_CMSG_CLOEXEC | MSG_DONTWAIT, NULL);
	while (got < 0 && errno == EINTR);
	if (got < 0)
		return -errno;
	for (int i = 0; i < got; i++) {
		slots[i].len = mm[i].msg_len;
		slots[i].fd = -1;
		slots[i].truncated = 0;
		take_fds(&mm[i].msg_hdr, &slots[i].fd, &slots[i].truncated);
	}
	return got;
}
