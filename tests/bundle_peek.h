/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Tests only: what a bundle of the daemon's fd store holds (docs/RESTART.md,
 * "Bundles"), peeked as a starting daemon peeks it. Shared by
 * tests/integration/harness.c and tests/unit/test_restart.c.
 */
#ifndef BB_TESTS_BUNDLE_PEEK_H
#define BB_TESTS_BUNDLE_PEEK_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* Peek every message of a bundle (fd: its receiving end): SO_PEEK_OFF 0,
 * each message peeked and its fds closed, SO_PEEK_OFF -1; nothing is
 * taken. A message is 1 to 64 records of 16 bytes with as many fds, in
 * order. fn gets each record's name, "b<id>" or "a<id>" for a well-formed
 * record of a well-formed message, "?" for any other (one for a message
 * with no whole record), and the inode of its fd, 0 for none. The records
 * seen, or -errno. */
static inline int bundle_peek(int fd, void (*fn)(void *ctx, const char *name, ino_t ino), void *ctx)
{
	enum { MAX = 64 };
	int off = 0, n = 0;
	if (setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off)) < 0)
		return -errno;
	for (;;) {
		struct {
			uint8_t magic[2], version, letter;
			uint32_t zero;
			uint64_t id;
		} rec[MAX];
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(int) * MAX)];
		} ctl;
		struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.b,
				    .msg_controllen = sizeof(ctl.b)};
		ssize_t got = recvmsg(fd, &mh, MSG_PEEK | MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (got < 0)
			break;
		size_t fds = 0;
		ino_t ino[MAX] = {0};
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
			for (size_t i = 0; c->cmsg_type == SCM_RIGHTS &&
					   i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			     i++, fds++) {
				int x;
				struct stat st = {0};
				memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof(x));
				if (fds < MAX && fstat(x, &st) == 0)
					ino[fds] = st.st_ino;
				close(x);
			}
		size_t nrec = (size_t)got / sizeof(rec[0]);
		int whole = got > 0 && (size_t)got % sizeof(rec[0]) == 0 && fds == nrec &&
			    !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC));
		for (size_t i = 0; i < (nrec ? nrec : 1); i++, n++) {
			char name[32] = "?";
			if (whole && !memcmp(rec[i].magic, "bk", 2) && rec[i].version == 1 &&
			    !rec[i].zero && (rec[i].letter == 'b' || rec[i].letter == 'a'))
				snprintf(name, sizeof(name), "%c%llu", rec[i].letter,
					 (unsigned long long)rec[i].id);
			fn(ctx, name, i < MAX ? ino[i] : 0);
		}
	}
	off = -1;
	setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off));
	return n;
}

#endif /* BB_TESTS_BUNDLE_PEEK_H */
