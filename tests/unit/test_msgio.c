/* SPDX-License-Identifier: Apache-2.0 */
/*
 * SOCK_SEQPACKET datagrams through msgio on a real socket pair: one slot
 * (a recvmsg) and several (a recvmmsg) read the same datagrams the same
 * way: lengths, one fd each, extra fds closed and flagged, truncation, the
 * end of the stream, and -EAGAIN when nothing is queued.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "msgio.h"

static void pair(int sv[2])
{
	cr_assert_eq(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0, "socketpair: %s",
		     strerror(errno));
}

static int new_memfd(void)
{
	int fd = memfd_create("test_msgio", MFD_CLOEXEC);
	cr_assert_geq(fd, 0, "memfd_create: %s", strerror(errno));
	return fd;
}

/* Whether fd is open in this process. */
static int is_open(int fd)
{
	return fcntl(fd, F_GETFD) >= 0;
}

/* Send len bytes of `what` with nfds fresh memfds attached (closed here
 * once sent). */
static void send_with_fds(int sock, const char *what, size_t len, int nfds)
{
	int fds[4];
	union {
		char buf[CMSG_SPACE(sizeof(fds))];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = {.iov_base = (void *)what, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};

	cr_assert_leq(nfds, 4);
	if (nfds) {
		for (int i = 0; i < nfds; i++)
			fds[i] = new_memfd();
		memset(&ctl, 0, sizeof(ctl));
		msg.msg_control = ctl.buf;
		msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
	}
	cr_assert_eq(sendmsg(sock, &msg, MSG_NOSIGNAL), (ssize_t)len, "sendmsg: %s",
		     strerror(errno));
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
}

/* How many of the first 256 fds are open: extra fds that were received
 * and closed add nothing to it. */
static int fds_open(void)
{
	int n = 0;
	for (int fd = 0; fd < 256; fd++)
		n += is_open(fd);
	return n;
}

static void slots_of(msgio_slot *s, unsigned n, unsigned char (*bufs)[64], size_t cap)
{
	for (unsigned i = 0; i < n; i++) {
		s[i].buf = bufs[i];
		s[i].cap = cap;
	}
}

Test(msgio, nothing_queued_is_eagain_for_one_slot_and_for_several)
{
	int sv[2];
	unsigned char bufs[4][64];
	msgio_slot s[4];

	pair(sv);
	slots_of(s, 4, bufs, 64);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 1), -EAGAIN);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 4), -EAGAIN);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 0), -EINVAL);
	cr_assert_eq(msgio_recv_batch(sv[1], s, MSGIO_BATCH_MAX + 1), -EINVAL);
	close(sv[0]);
	close(sv[1]);
}

Test(msgio, one_slot_reads_one_datagram_and_leaves_the_rest_queued)
{
	int sv[2];
	unsigned char bufs[1][64];
	msgio_slot s[1];

	pair(sv);
	slots_of(s, 1, bufs, 64);
	send_with_fds(sv[0], "first", 5, 1);
	send_with_fds(sv[0], "second", 6, 0);

	cr_assert_eq(msgio_recv_batch(sv[1], s, 1), 1);
	cr_assert_eq(s[0].len, 5);
	cr_assert_eq(memcmp(bufs[0], "first", 5), 0);
	cr_assert_eq(s[0].truncated, 0);
	cr_assert_geq(s[0].fd, 0, "the attached fd did not arrive");
	cr_assert(fcntl(s[0].fd, F_GETFD) & FD_CLOEXEC, "a received fd is not close-on-exec");
	close(s[0].fd);

	cr_assert_eq(msgio_recv_batch(sv[1], s, 1), 1);
	cr_assert_eq(s[0].len, 6);
	cr_assert_eq(memcmp(bufs[0], "second", 6), 0);
	cr_assert_eq(s[0].fd, -1);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 1), -EAGAIN);
	close(sv[0]);
	close(sv[1]);
}

Test(msgio, several_slots_read_what_is_queued_in_order_with_an_fd_each)
{
	int sv[2];
	unsigned char bufs[8][64];
	msgio_slot s[8];

	pair(sv);
	slots_of(s, 8, bufs, 64);
	send_with_fds(sv[0], "a", 1, 0);
	send_with_fds(sv[0], "bb", 2, 1);
	send_with_fds(sv[0], "ccc", 3, 0);

	cr_assert_eq(msgio_recv_batch(sv[1], s, 8), 3, "a batch reads every queued datagram");
	for (int i = 0; i < 3; i++) {
		cr_assert_eq(s[i].len, (size_t)i + 1);
		cr_assert_eq(bufs[i][0], "abc"[i]);
		cr_assert_eq(s[i].truncated, 0);
	}
	cr_assert_eq(s[0].fd, -1);
	cr_assert_geq(s[1].fd, 0, "the second datagram's fd did not arrive");
	cr_assert_eq(s[2].fd, -1);
	close(s[1].fd);

	/* A batch smaller than the queue leaves the rest. */
	for (int i = 0; i < 5; i++)
		send_with_fds(sv[0], "x", 1, 0);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 2), 2);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 8), 3);
	cr_assert_eq(msgio_recv_batch(sv[1], s, 8), -EAGAIN);
	close(sv[0]);
	close(sv[1]);
}

/* Both paths: a datagram over cap and one with several fds are flagged
 * truncated, and only the first fd is kept. */
static void truncation_and_extra_fds(unsigned n)
{
	int sv[2];
	unsigned char bufs[2][64];
	msgio_slot s[2];
	int before;

	pair(sv);
	slots_of(s, n, bufs, 4);
	send_with_fds(sv[0], "0123456789", 10, 0);
	cr_assert_eq(msgio_recv_batch(sv[1], s, n), 1);
	cr_assert_eq(s[0].truncated, 1, "%u slot(s): a datagram over cap is not flagged", n);
	cr_assert_eq(memcmp(bufs[0], "0123", 4), 0);

	before = fds_open();
	send_with_fds(sv[0], "fds", 3, 3);
	cr_assert_eq(msgio_recv_batch(sv[1], s, n), 1);
	cr_assert_eq(s[0].truncated, 1, "%u slot(s): three fds are not flagged", n);
	cr_assert_geq(s[0].fd, 0);
	cr_assert_eq(fds_open(), before + 1, "%u slot(s): the extra fds were not closed", n);
	close(s[0].fd);
	close(sv[0]);
	close(sv[1]);
}

Test(msgio, one_slot_flags_truncation_and_closes_extra_fds)
{
	truncation_and_extra_fds(1);
}

Test(msgio, several_slots_flag_truncation_and_close_extra_fds)
{
	truncation_and_extra_fds(2);
}

/* recvmmsg reads the end of the stream into every slot it is given; the
 * daemon takes the first empty one as the peer gone either way. */
Test(msgio, the_end_of_the_stream_reads_as_empty_slots_for_one_slot_and_for_several)
{
	for (unsigned n = 1; n <= 2; n++) {
		int sv[2], got;
		unsigned char bufs[2][64];
		msgio_slot s[2];

		pair(sv);
		slots_of(s, n, bufs, 64);
		close(sv[0]);
		got = msgio_recv_batch(sv[1], s, n);
		cr_assert_geq(got, 1, "%u slot(s): no end of stream (%d)", n, got);
		for (int i = 0; i < got; i++) {
			cr_assert_eq(s[i].len, 0, "%u slot(s): slot %d holds %zu bytes", n, i,
				     s[i].len);
			cr_assert_eq(s[i].fd, -1);
		}
		close(sv[1]);
	}
}

/* Several fds in one datagram (the fd store's bundles): sent in order,
 * taken in order; past the caller's room they are counted and closed. */
Test(msgio, several_fds_travel_in_one_datagram_in_order)
{
	int sv[2];
	pair(sv);
	int fds[3] = {new_memfd(), new_memfd(), new_memfd()};
	struct stat want[3];
	for (int i = 0; i < 3; i++)
		cr_assert_eq(fstat(fds[i], &want[i]), 0);
	cr_assert_eq(msgio_send_fds(sv[0], "abc", 3, fds, 3), 3);
	cr_assert_eq(msgio_send_fds(sv[0], "", 0, fds, 1), -EINVAL,
		     "a 0-byte datagram loses its fds");
	char buf[8];
	union {
		char b[CMSG_SPACE(3 * sizeof(int))];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf)};
	struct msghdr m = {.msg_iov = &iov,
			   .msg_iovlen = 1,
			   .msg_control = ctl.b,
			   .msg_controllen = sizeof(ctl.b)};
	cr_assert_eq(recvmsg(sv[1], &m, MSG_CMSG_CLOEXEC), 3);
	int got[2] = {-1, -1};
	cr_assert_eq(msgio_fds(&m, got, 2), 3, "three attached");
	for (int i = 0; i < 2; i++) {
		struct stat st;
		cr_assert_eq(fstat(got[i], &st), 0);
		cr_assert_eq(st.st_ino, want[i].st_ino, "fd %d is another file", i);
		close(got[i]);
	}
	for (int i = 0; i < 3; i++)
		close(fds[i]);
	close(sv[0]);
	close(sv[1]);
}
