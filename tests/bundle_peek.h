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
 * taken. fn gets each message's name, "b<id>" or "a<id>" for a
 * well-formed record with one fd, "?" for any other, and the inode of
 * its (first) fd, 0 for none. The count, or -errno. */
static inline int bundle_peek(int fd, void (*fn)(void *ctx, const char *name, ino_t ino), void *ctx)
{
	int off = 0, n = 0;
	if (setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off)) < 0)
		return -errno;
	for (;; n++) {
		struct {
			uint8_t magic[2], version, letter;
			uint32_t zero;
			uint64_t id;
		} rec;
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(int) * 4)];
		} ctl;
		struct iovec iov = {.iov_base = &rec, .iov_len = sizeof(rec)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.b,
				    .msg_controllen = sizeof(ctl.b)};
		ssize_t got = recvmsg(fd, &mh, MSG_PEEK | MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (got < 0)
			break;
		int fds = 0;
		struct stat st = {0};
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
			for (size_t i = 0; c->cmsg_type == SCM_RIGHTS &&
					   i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			     i++, fds++) {
				int x;
				memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof(x));
				if (!fds)
					fstat(x, &st);
				close(x);
			}
		char name[32] = "?";
		if (got == (ssize_t)sizeof(rec) && fds == 1 && !memcmp(rec.magic, "bk", 2) &&
		    rec.version == 1 && !rec.zero && (rec.letter == 'b' || rec.letter == 'a'))
			snprintf(name, sizeof(name), "%c%llu", rec.letter,
				 (unsigned long long)rec.id);
		fn(ctx, name, st.st_ino);
	}
	off = -1;
	setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &off, sizeof(off));
	return n;
}

#endif /* BB_TESTS_BUNDLE_PEEK_H */
