/* SPDX-License-Identifier: Apache-2.0 */
/*
 * daemon/restart.c with real memfds and a real notify socket: the names it
 * reads from LISTEN_FDNAMES, and the start from passed fds (docs/RESTART.md,
 * "Starting from a kept state"): the journal rebuilds the broker with each
 * host buffer's memfd adopted; a buffer whose fd is missing or is not its
 * memfd becomes FAILED and the rest is served; fds no buffer names
 * (orphans, unknown names) and the old journal are removed from the store
 * and closed; the new journal generation is stored.
 *
 * The start runs in a child process: LISTEN_FDS wants the fds at 3.., where
 * the test runner keeps its own.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "broker.h"
#include "journal.h"
#include "restart.h"

Test(restart, names)
{
	uint64_t id = 0;
	cr_assert_eq(restart_name_parse("journal-3", &id), RESTART_NAME_JOURNAL);
	cr_assert_eq(id, 3);
	cr_assert_eq(restart_name_parse("b12", &id), RESTART_NAME_BUFFER);
	cr_assert_eq(id, 12);
	cr_assert_eq(restart_name_parse("a7", &id), RESTART_NAME_ALLOCATION);
	cr_assert_eq(id, 7);
	cr_assert_eq(restart_name_parse("b18446744073709551615", &id), RESTART_NAME_BUFFER);
	cr_assert_eq(id, UINT64_MAX);
	const char *other[] = {"b0",
			       "b012",
			       "b",
			       "bx",
			       "b1x",
			       "b-1",
			       "journal-",
			       "journal-0",
			       "journal-1a",
			       "journal",
			       "bufbrokerd.socket",
			       "a",
			       "c5",
			       "",
			       "b18446744073709551616",
			       "journal-+1"};
	for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++)
		cr_assert_eq(restart_name_parse(other[i], &id), RESTART_NAME_OTHER, "\"%s\"",
			     other[i]);
	cr_assert_eq(restart_name_parse(NULL, &id), RESTART_NAME_OTHER);
}

/* ---- the start from passed fds ------------------------------------------------ */

typedef struct each_seen {
	int n;
	char first[32];
} each_seen;

static int each_fn(void *ctx, const char *name, int fd)
{
	each_seen *e = ctx;
	if (e->n++ == 0)
		snprintf(e->first, sizeof(e->first), "%s", name);
	return fd < 0;
}

#define CHECK(cond)                                                               \
	do {                                                                      \
		if (!(cond)) {                                                    \
			fprintf(stderr, "child: line %d: %s\n", __LINE__, #cond); \
			_exit(__LINE__ % 250 + 1);                                \
		}                                                                 \
	} while (0)

typedef struct kept_state {
	int journal; /* journal-1 */
	int fds[4];  /* memfds of buffers 1..3, then an orphan */
	uint64_t ids[3];
	int wrong;   /* a memfd that is not buffer 3's */
	int unknown; /* a passed fd of a name the daemon does not make */
} kept_state;

/* A broker on the real host backend with its journal on: three buffers,
 * the first READY with bytes in it. The memfds and the journal are
 * duplicated as the fd store would keep them; the broker is then dropped
 * without a word to the journal, as a crash drops it. */
static void make_state(kept_state *k)
{
	journal *j = NULL;
	char why[256];
	cr_assert_eq(journal_create(NULL, &j, why, sizeof(why)), 0, "%s", why);
	backend *host = backend_host_new();
	broker_config cfg = {.journal = j};
	broker_limits_default(&cfg.limits);
	broker *b = broker_new(&cfg);
	broker_set_backend(b, BB_HOST, host, NULL);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 1, &err);
	for (int i = 0; i < 3; i++) {
		broker_alloc_req req = {
			.size = 4096u * (unsigned)(i + 1), .kind = BB_HOST, .import_fd = -1};
		broker_buf *buf;
		cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
		broker_info info;
		broker_buf_info(b, buf, c, &info);
		k->ids[i] = info.id;
		backend_export ex;
		cr_assert_eq(broker_buf_export(b, buf, &ex, &err), 0);
		k->fds[i] = fcntl(ex.fd, F_DUPFD_CLOEXEC, 3);
	}
	cr_assert_eq(broker_set_ready(b, c, k->ids[0], &err), 0);
	char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, k->fds[0], 0);
	cr_assert_neq(p, MAP_FAILED);
	strcpy(p, "kept bytes");
	munmap(p, 4096);
	k->journal = fcntl(journal_fd(j), F_DUPFD_CLOEXEC, 3);
	k->fds[3] = memfd_create("orphan", MFD_CLOEXEC);
	k->wrong = memfd_create("wrong", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	cr_assert_eq(ftruncate(k->wrong, 12288), 0); /* its size, but not sealed */
	k->unknown = memfd_create("unknown", MFD_CLOEXEC);
	/* The crash: the broker's memory goes, the journal says what it was. */
	broker_free(b);
	host->destroy(host);
	journal_free(j);
}

/* The store's side: read what the child sent until it exits. */
static size_t drain(int sock, char *text, size_t cap)
{
	size_t used = 0;
	char buf[512];
	union {
		struct cmsghdr h;
		char c[CMSG_SPACE(sizeof(int) * 8)];
	} cm;
	for (;;) {
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf) - 1};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = cm.c,
				    .msg_controllen = sizeof(cm.c)};
		ssize_t n = recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n < 0)
			break;
		buf[n] = '\0';
		for (struct cmsghdr *h = CMSG_FIRSTHDR(&mh); h; h = CMSG_NXTHDR(&mh, h))
			if (h->cmsg_type == SCM_RIGHTS)
				for (size_t i = 0; i < (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
				     i++)
					close(((int *)CMSG_DATA(h))[i]);
		for (char *s = buf; *s; s++)
			if (*s == '\n')
				*s = ' ';
		used += (size_t)snprintf(text + used, cap - used, "[%s]", buf);
	}
	return used;
}

Test(restart, a_start_adopts_what_was_kept_fails_what_was_not_and_drops_orphans)
{
	kept_state k;
	make_state(&k);
	char dir[] = "/tmp/bbt-restart-XXXXXX";
	cr_assert(mkdtemp(dir));
	char path[128];
	snprintf(path, sizeof(path), "%s/notify", dir);
	int sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
	cr_assert_eq(bind(sock, (struct sockaddr *)&sa, sizeof(sa)), 0);

	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		/* Passed as systemd passes them: journal-1, b<1> (its memfd),
		 * b<3> (the wrong memfd), b99 (no such buffer), "xyz"; b<2>
		 * missing. */
		int src[5] = {k.journal, k.fds[0], k.wrong, k.fds[3], k.unknown};
		int moved[5];
		for (int i = 0; i < 5; i++)
			moved[i] = fcntl(src[i], F_DUPFD, 100);
		for (int i = 0; i < 5; i++)
			CHECK(dup2(moved[i], 3 + i) == 3 + i);
		char names[256], num[32];
		snprintf(names, sizeof(names), "journal-1:b%llu:b%llu:b99:xyz",
			 (unsigned long long)k.ids[0], (unsigned long long)k.ids[2]);
		setenv("LISTEN_FDNAMES", names, 1);
		setenv("LISTEN_FDS", "5", 1);
		snprintf(num, sizeof(num), "%d", (int)getpid());
		setenv("LISTEN_PID", num, 1);
		setenv("NOTIFY_SOCKET", path, 1);

		restart *r = NULL;
		char why[256];
		restart_config rc = {.journal = true};
		CHECK(restart_new(&r, &rc, why, sizeof(why)) == 0);
		CHECK(restart_generation(r) == 2);
		CHECK(!getenv("LISTEN_FDS"));
		backend *host = backend_host_new();
		broker_config cfg = {
			.journal = restart_journal(r), .keep = restart_keep, .keep_ctx = r};
		broker_limits_default(&cfg.limits);
		broker *b = broker_new(&cfg);
		broker_set_backend(b, BB_HOST, host, NULL);
		int listen_fd = 0;
		CHECK(restart_start(r, b, host, NULL, &listen_fd, why, sizeof(why)) == 0);
		CHECK(listen_fd == -1);
		const restart_stats *st = restart_get_stats(r);
		CHECK(st->restored_buffers == 3);
		CHECK(st->failed_missing == 2);
		CHECK(st->orphans_closed == 3); /* the wrong memfd, b99, xyz */
		CHECK(!st->refused);
		CHECK(st->restarts == 1);
		broker_error err;
		broker_conn *root = broker_conn_open(b, 0, 0, 1, &err);
		broker_info info;
		CHECK(broker_stat_id(b, root, k.ids[0], &info, &err) == 0);
		CHECK(info.state == BB_READY);
		broker_buf *got;
		CHECK(broker_open_id(b, root, k.ids[0], &got, &err) == 0);
		backend_export ex;
		CHECK(broker_buf_export(b, got, &ex, &err) == 0);
		char *p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, ex.fd, 0);
		CHECK(p != MAP_FAILED && strcmp(p, "kept bytes") == 0);
		for (int i = 1; i < 3; i++) {
			CHECK(broker_stat_id(b, root, k.ids[i], &info, &err) == 0);
			CHECK(info.state == BB_FAILED);
			CHECK(strstr(info.error, "its memory was not kept across the restart"));
		}
		CHECK(broker_absent_sessions(b) == 1);
		/* Orphans are closed: fds 5..7 (the wrong memfd, b99, xyz). */
		for (int fd = 5; fd <= 7; fd++)
			CHECK(fcntl(fd, F_GETFD) < 0);
		CHECK(fcntl(3, F_GETFD) < 0); /* the old journal too */
		/* What a new image needs: the journal first, then the one
		 * live host memfd (the FAILED buffers have none). */
		each_seen e = {0};
		CHECK(restart_each_fd(r, each_fn, &e) == 2);
		CHECK(strcmp(e.first, "journal-2") == 0);
		char report[1024];
		CHECK(broker_check(b, report, sizeof(report)) == 0);
		_exit(0);
	}
	int status = 0;
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)",
		  status);
	char text[4096] = "";
	drain(sock, text, sizeof(text));
	char want[128];
	cr_assert(strstr(text, "[FDSTORE=1 FDNAME=journal-2]"), "%s", text);
	cr_assert(strstr(text, "[FDSTOREREMOVE=1 FDNAME=journal-1]"), "%s", text);
	snprintf(want, sizeof(want), "[FDSTOREREMOVE=1 FDNAME=b%llu]",
		 (unsigned long long)k.ids[2]);
	cr_assert(strstr(text, want), "the wrong memfd stays stored: %s", text);
	cr_assert(strstr(text, "[FDSTOREREMOVE=1 FDNAME=b99]"), "%s", text);
	cr_assert(strstr(text, "[FDSTOREREMOVE=1 FDNAME=xyz]"), "%s", text);
	snprintf(want, sizeof(want), "FDNAME=b%llu]", (unsigned long long)k.ids[0]);
	cr_assert_null(strstr(text, want), "the adopted memfd was touched in the store: %s", text);
	close(sock);
	unlink(path);
	rmdir(dir);
	close(k.journal);
	for (int i = 0; i < 4; i++)
		close(k.fds[i]);
	close(k.wrong);
	close(k.unknown);
}

Test(restart, without_the_journal_kept_fds_are_dropped_and_nothing_is_rebuilt)
{
	int mem = memfd_create("b", MFD_CLOEXEC);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		int m = fcntl(mem, F_DUPFD, 100);
		CHECK(dup2(m, 3) == 3);
		char num[32];
		setenv("LISTEN_FDNAMES", "b5", 1);
		setenv("LISTEN_FDS", "1", 1);
		snprintf(num, sizeof(num), "%d", (int)getpid());
		setenv("LISTEN_PID", num, 1);
		unsetenv("NOTIFY_SOCKET");
		restart *r = NULL;
		char why[256];
		restart_config rc = {.journal = false};
		CHECK(restart_new(&r, &rc, why, sizeof(why)) == 0);
		CHECK(restart_journal(r) == NULL);
		broker_config cfg = {0};
		broker_limits_default(&cfg.limits);
		broker *b = broker_new(&cfg);
		int listen_fd = 0;
		CHECK(restart_start(r, b, NULL, NULL, &listen_fd, why, sizeof(why)) == 0);
		CHECK(fcntl(3, F_GETFD) < 0);
		CHECK(restart_each_fd(r, NULL, NULL) == 0);
		_exit(0);
	}
	int status = 0;
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)",
		  status);
	close(mem);
}

/* The stored names are bounded so that LISTEN_FDNAMES stays within the
 * kernel's bound on one environment string: past the bound (a test's
 * small one here) a buffer is served unprotected, and a removal gives its
 * name's bytes back. */
Test(restart, the_stored_names_stay_within_what_listen_fdnames_can_pass)
{
	char dir[] = "/tmp/bbt-restart-XXXXXX";
	cr_assert(mkdtemp(dir));
	char path[128];
	snprintf(path, sizeof(path), "%s/notify", dir);
	int sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%.100s", path);
	cr_assert_eq(bind(sock, (struct sockaddr *)&sa, sizeof(sa)), 0);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_FDNAMES");
		setenv("NOTIFY_SOCKET", path, 1);
		setenv("BUFBROKERD_TEST_FDNAMES_MAX", "20", 1);
		restart *r = NULL;
		char why[256];
		restart_config rc = {.journal = true};
		CHECK(restart_new(&r, &rc, why, sizeof(why)) == 0);
		const restart_stats *st = restart_get_stats(r);
		int fd = memfd_create("b", MFD_CLOEXEC);
		/* "b1".."b6" cost 3 bytes each ("b1:"): 18 of 20. */
		for (uint64_t id = 1; id <= 6; id++)
			restart_store_buffer(r, id, fd);
		CHECK(st->names_bytes == 18 && st->unprotected == 0);
		restart_store_buffer(r, 7, fd); /* 21: not stored */
		CHECK(st->names_bytes == 18 && st->unprotected == 1);
		restart_store_allocation(r, 8, fd); /* "a8": likewise */
		CHECK(st->names_bytes == 18 && st->unprotected == 2);
		restart_unstore_buffer(r, 7);
		restart_unstore_allocation(r, 8);
		CHECK(st->unprotected == 0);
		restart_unstore_buffer(r, 1); /* its 3 bytes are free again */
		CHECK(st->names_bytes == 15);
		restart_store_buffer(r, 10, fd); /* "b10:" 4: 19 */
		CHECK(st->names_bytes == 19 && st->unprotected == 0);
		restart_flush(r);
		restart_free(r);
		_exit(0);
	}
	int status = 0;
	cr_assert_eq(waitpid(pid, &status, 0), pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)",
		  status);
	char text[4096] = "";
	drain(sock, text, sizeof(text));
	cr_assert(strstr(text, "[FDSTORE=1 FDNAME=b6]"), "%s", text);
	cr_assert(strstr(text, "[FDSTORE=1 FDNAME=b10]"), "%s", text);
	cr_assert_null(strstr(text, "FDNAME=b7]"), "past the bound, stored: %s", text);
	cr_assert_null(strstr(text, "FDNAME=a8]"), "past the bound, stored: %s", text);
	close(sock);
	unlink(path);
	rmdir(dir);
}
