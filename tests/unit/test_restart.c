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
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../bundle_peek.h"
#include "backend.h"
#include "broker.h"
#include "journal.h"
#include "msgio.h"
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

static void kept_state_close(kept_state *k)
{
	close(k->journal);
	for (int i = 0; i < 4; i++)
		close(k->fds[i]);
	close(k->wrong);
	close(k->unknown);
}

/* The fd store's side of a notify socket, as systemd keeps it: FDSTORE=1
 * keeps the fd under FDNAME, FDSTOREREMOVE=1 removes and closes every fd of
 * that name; every message is logged in text as "[line line ...]". */
typedef struct store {
	int sock;
	char dir[32];
	char path[64];
	int n;
	char names[64][32];
	int fds[64];
	char text[16384];
	size_t used;
} store;

static void store_open(store *s)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->dir, sizeof(s->dir), "/tmp/bbt-restart-XXXXXX");
	cr_assert(mkdtemp(s->dir));
	snprintf(s->path, sizeof(s->path), "%s/notify", s->dir);
	s->sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->path);
	cr_assert_eq(bind(s->sock, (struct sockaddr *)&sa, sizeof(sa)), 0);
}

static void store_close(store *s)
{
	for (int i = 0; i < s->n; i++)
		close(s->fds[i]);
	close(s->sock);
	unlink(s->path);
	rmdir(s->dir);
}

/* The fd stored under name, or -1. */
static int store_fd(const store *s, const char *name)
{
	for (int i = 0; i < s->n; i++)
		if (!strcmp(s->names[i], name))
			return s->fds[i];
	return -1;
}

/* Take every message queued. */
static void store_pump(store *s)
{
	char buf[512];
	int fd;
	ssize_t n;
	while ((n = msgio_recv(s->sock, buf, sizeof(buf) - 1, &fd, &(int){0})) > 0) {
		buf[n] = '\0';
		char *name = strstr(buf, "FDNAME=");
		char nm[32] = "";
		if (name)
			snprintf(nm, sizeof(nm), "%.*s", (int)strcspn(name + 7, "\n"), name + 7);
		if (strstr(buf, "FDSTOREREMOVE=1"))
			for (int i = s->n - 1; i >= 0; i--)
				if (!strcmp(s->names[i], nm)) {
					close(s->fds[i]);
					s->fds[i] = s->fds[--s->n];
					memcpy(s->names[i], s->names[s->n], sizeof(s->names[i]));
				}
		if (fd >= 0 && strstr(buf, "FDSTORE=1\n") && s->n < 64) {
			snprintf(s->names[s->n], sizeof(s->names[0]), "%s", nm);
			s->fds[s->n++] = fd;
		} else if (fd >= 0) {
			close(fd);
		}
		for (char *c = buf; *c; c++)
			if (*c == '\n')
				*c = ' ';
		s->used +=
			(size_t)snprintf(s->text + s->used, sizeof(s->text) - s->used, "[%s]", buf);
	}
}

/* Reap the child, taking what it sends meanwhile (a notify socket holds
 * few messages); its exit status. */
static int store_wait(store *s, pid_t pid)
{
	int status = 0;
	while (waitpid(pid, &status, WNOHANG) == 0) {
		store_pump(s);
		poll(&(struct pollfd){.fd = s->sock, .events = POLLIN}, 1, 10);
	}
	store_pump(s);
	return status;
}

/* Where text has what, or -1. */
static long text_at(const store *s, const char *what)
{
	const char *p = strstr(s->text, what);
	return p ? p - s->text : -1;
}

typedef struct peeked {
	char (*names)[32];
	ino_t *inos;
	int n, cap;
} peeked;

static void peeked_add(void *ctx, const char *name, ino_t ino)
{
	peeked *p = ctx;
	if (p->n < p->cap) {
		snprintf(p->names[p->n], 32, "%s", name);
		p->inos[p->n] = ino;
	}
	p->n++;
}

/* A bundle's messages (fd: its receiving end), peeked as the daemon does
 * (bundle_peek): their names into names, their fds' inodes into inos (cap
 * entries); the count. */
static int peek(int fd, char (*names)[32], ino_t *inos, int cap)
{
	peeked p = {names, inos, 0, cap};
	cr_assert_geq(bundle_peek(fd, peeked_add, &p), 0);
	return p.n;
}

static ino_t ino_of(int fd)
{
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	return st.st_ino;
}

/* In the child: the n fds of src (at most 8) passed as systemd passes
 * them (at 3.., LISTEN_FDNAMES names), the store at notify; the restart
 * made from them with the journal on (generation 2), and a broker on the
 * real host backend started from it. */
static broker *child_start_n(const int *src, int n, const char *names, const char *notify,
			     restart **out)
{
	int moved[8];
	for (int i = 0; i < n; i++)
		moved[i] = fcntl(src[i], F_DUPFD, 100);
	for (int i = 0; i < n; i++)
		CHECK(dup2(moved[i], 3 + i) == 3 + i);
	char num[32];
	setenv("LISTEN_FDNAMES", names, 1);
	snprintf(num, sizeof(num), "%d", n);
	setenv("LISTEN_FDS", num, 1);
	snprintf(num, sizeof(num), "%d", (int)getpid());
	setenv("LISTEN_PID", num, 1);
	setenv("NOTIFY_SOCKET", notify, 1);
	restart *r = NULL;
	char why[256];
	restart_config rc = {.journal = true};
	CHECK(restart_new(&r, &rc, why, sizeof(why)) == 0);
	CHECK(restart_generation(r) == 2);
	CHECK(!getenv("LISTEN_FDS"));
	backend *host = backend_host_new();
	broker_config cfg = {.journal = restart_journal(r), .keep = restart_keep, .keep_ctx = r};
	broker_limits_default(&cfg.limits);
	broker *b = broker_new(&cfg);
	broker_set_backend(b, BB_HOST, host, NULL);
	int listen_fd = 0;
	CHECK(restart_start(r, b, host, NULL, &listen_fd, why, sizeof(why)) == 0);
	CHECK(listen_fd == -1);
	*out = r;
	return b;
}

static broker *child_start(const int src[5], const char *names, const char *notify, restart **out)
{
	return child_start_n(src, 5, names, notify, out);
}

Test(restart, a_start_adopts_what_was_kept_fails_what_was_not_and_drops_orphans)
{
	kept_state k;
	make_state(&k);
	store s;
	store_open(&s);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		/* Passed as systemd passes them: journal-1, b<1> (its memfd),
		 * b<3> (the wrong memfd), b99 (no such buffer), "xyz"; b<2>
		 * missing. */
		int src[5] = {k.journal, k.fds[0], k.wrong, k.fds[3], k.unknown};
		char names[256];
		snprintf(names, sizeof(names), "journal-1:b%llu:b%llu:b99:xyz",
			 (unsigned long long)k.ids[0], (unsigned long long)k.ids[2]);
		restart *r;
		broker *b = child_start(src, names, s.path, &r);
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
		/* What a new image needs: the journal first, then the bundle
		 * that holds the one live host memfd (the FAILED buffers have
		 * none). */
		each_seen e = {0};
		CHECK(restart_each_fd(r, each_fn, &e) == 2);
		CHECK(strcmp(e.first, "journal-2") == 0);
		char report[1024];
		CHECK(broker_check(b, report, sizeof(report)) == 0);
		_exit(0);
	}
	int status = store_wait(&s, pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)",
		  status);
	char want[128];
	cr_assert(strstr(s.text, "[FDSTORE=1 FDNAME=journal-2]"), "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=journal-1]"), "%s", s.text);
	snprintf(want, sizeof(want), "[FDSTOREREMOVE=1 FDNAME=b%llu]",
		 (unsigned long long)k.ids[2]);
	cr_assert(strstr(s.text, want), "the wrong memfd stays stored: %s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=b99]"), "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=xyz]"), "%s", s.text);
	/* The adopted memfd, passed by its own name (an older daemon's
	 * store), is in a bundle now, and only then out under its name. */
	long bundled = text_at(&s, "[FDSTORE=1 FDNAME=k1 FDPOLL=0]");
	snprintf(want, sizeof(want), "[FDSTOREREMOVE=1 FDNAME=b%llu]",
		 (unsigned long long)k.ids[0]);
	cr_assert(bundled >= 0 && text_at(&s, want) > bundled, "%s", s.text);
	cr_assert_eq(s.n, 2, "the store: journal-2 and k1: %s", s.text);
	char names[4][32];
	ino_t inos[4];
	cr_assert_eq(peek(store_fd(&s, "k1"), names, inos, 4), 1);
	snprintf(want, sizeof(want), "b%llu", (unsigned long long)k.ids[0]);
	cr_assert_str_eq(names[0], want);
	cr_assert_eq(inos[0], ino_of(k.fds[0]));
	cr_assert_geq(store_fd(&s, "journal-2"), 0);
	store_close(&s);
	kept_state_close(&k);
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

/* ---- bundles (docs/RESTART.md, "Bundles") ------------------------------------- */

/* A restart with the journal on that nothing was passed to, its store s. */
static restart *start_empty(store *s)
{
	store_open(s);
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	setenv("NOTIFY_SOCKET", s->path, 1);
	restart *r = NULL;
	char why[256];
	restart_config rc = {.journal = true};
	cr_assert_eq(restart_new(&r, &rc, why, sizeof(why)), 0, "%s", why);
	return r;
}

/* Buffers from..to kept, each with a memfd of its own (mem[id]). */
static void keep_buffers(restart *r, int *mem, uint64_t from, uint64_t to)
{
	for (uint64_t id = from; id <= to; id++) {
		mem[id] = memfd_create("kept", MFD_CLOEXEC);
		restart_store_buffer(r, id, mem[id]);
	}
}

/* The bundle stored as name holds exactly buffers from..to in order, but
 * skip (0: none), each the memfd it was kept with. */
static void bundle_holds(const store *s, const char *name, const int *mem, uint64_t from,
			 uint64_t to, uint64_t skip)
{
	char names[80][32], want[32];
	ino_t inos[80];
	int fd = store_fd(s, name);
	cr_assert_geq(fd, 0, "%s is not stored: %s", name, s->text);
	int n = peek(fd, names, inos, 80), i = 0;
	for (uint64_t id = from; id <= to; id++) {
		if (id == skip)
			continue;
		snprintf(want, sizeof(want), "b%llu", (unsigned long long)id);
		cr_assert(i < n, "%s: %d messages, %s missing", name, n, want);
		cr_assert_str_eq(names[i], want, "%s, message %d", name, i);
		cr_assert_eq(inos[i], ino_of(mem[id]), "%s: %s is another file", name, want);
		i++;
	}
	cr_assert_eq(n, i, "%s: %d messages, want %d", name, n, i);
}

/* The length of the first message in the bundle stored as name. */
static ssize_t first_message(const store *s, const char *name)
{
	int fd = store_fd(s, name);
	cr_assert_geq(fd, 0, "%s is not stored: %s", name, s->text);
	char b[16];
	return recv(fd, b, sizeof(b), MSG_PEEK | MSG_TRUNC | MSG_DONTWAIT);
}

Test(restart, a_bundle_holds_64_kept_fds_then_the_next_ones_go_to_a_new_one, .timeout = 30)
{
	store s;
	restart *r = start_empty(&s);
	int mem[80];
	keep_buffers(r, mem, 1, 64);
	store_pump(&s);
	/* Each new fd is its own message, sent at once. */
	bundle_holds(&s, "k1", mem, 1, 64, 0);
	cr_assert_eq(first_message(&s, "k1"), 16);
	keep_buffers(r, mem, 65, 65);
	int alloc = memfd_create("allocation", MFD_CLOEXEC);
	restart_store_allocation(r, 7, alloc);
	/* At the end of the turn the full fresh bundle k1 is repacked: its
	 * 64 fds in one message of the tenured bundle k3, then k1 out. */
	restart_flush(r);
	store_pump(&s);
	cr_assert(strstr(s.text, "[FDSTORE=1 FDNAME=k1 FDPOLL=0]"), "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTORE=1 FDNAME=k2 FDPOLL=0]"), "%s", s.text);
	long repacked = text_at(&s, "[FDSTORE=1 FDNAME=k3 FDPOLL=0]");
	cr_assert(repacked >= 0 && text_at(&s, "[FDSTOREREMOVE=1 FDNAME=k1]") > repacked, "%s",
		  s.text);
	cr_assert_eq(s.n, 2, "one stored fd a bundle: %s", s.text);
	bundle_holds(&s, "k3", mem, 1, 64, 0);
	cr_assert_eq(first_message(&s, "k3"), 64 * 16, "one message for the 64");
	char names[4][32];
	ino_t inos[4];
	cr_assert_eq(peek(store_fd(&s, "k2"), names, inos, 4), 2);
	cr_assert_str_eq(names[0], "b65");
	cr_assert_str_eq(names[1], "a7");
	cr_assert_eq(inos[1], ino_of(alloc));
	const restart_stats *st = restart_get_stats(r);
	cr_assert_eq(st->bundles, 2);
	cr_assert_eq(st->names_bytes, 6); /* "k1:" and "k2:" */
	cr_assert_eq(st->unprotected, 0);
	cr_assert_eq(restart_held_fds(r), 3); /* k3's stored end (full); k2's two, open */
	restart_free(r);
	store_close(&s);
}

/* Buffers 1..65 kept (k1 full, repacked as k3; k2 holding 65), then
 * buffer 10 freed. */
static restart *rebuilt_after_a_free(store *s, int *mem)
{
	restart *r = start_empty(s);
	keep_buffers(r, mem, 1, 65);
	restart_flush(r);
	store_pump(s);
	size_t seen = strlen(s->text);
	restart_unstore_buffer(r, 10);
	store_pump(s);
	/* Until the end of the turn, the message stays, and so does k3. */
	bundle_holds(s, "k3", mem, 1, 64, 0);
	cr_assert_eq(strlen(s->text), seen, "%s", s->text);
	restart_flush(r);
	store_pump(s);
	return r;
}

Test(restart, a_freed_member_makes_its_bundle_rebuilt_at_the_end_of_the_turn, .timeout = 30)
{
	store s;
	int mem[80];
	restart *r = rebuilt_after_a_free(&s, mem);
	/* Its live members in a new bundle first (one message), then the
	 * old one out. */
	long moved = text_at(&s, "[FDSTORE=1 FDNAME=k4 FDPOLL=0]");
	cr_assert(moved >= 0 && text_at(&s, "[FDSTOREREMOVE=1 FDNAME=k3]") > moved, "%s", s.text);
	cr_assert_lt(store_fd(&s, "k3"), 0);
	bundle_holds(&s, "k4", mem, 1, 64, 10);
	cr_assert_eq(first_message(&s, "k4"), 63 * 16);
	bundle_holds(&s, "k2", mem, 65, 65, 0);
	const restart_stats *st = restart_get_stats(r);
	cr_assert_eq(st->bundles, 2);
	cr_assert_eq(st->names_bytes, 6);
	cr_assert_eq(st->store_errors, 0);
	restart_free(r);
	store_close(&s);
}

Test(restart, what_survives_a_rebuild_goes_to_the_tenured_bundle, .timeout = 30)
{
	store s;
	int mem[80];
	restart *r = rebuilt_after_a_free(&s, mem);
	/* k4 (tenured) holds the 63 that were moved; new ones go to the
	 * fresh bundle k2. */
	keep_buffers(r, mem, 66, 66);
	restart_flush(r);
	store_pump(&s);
	bundle_holds(&s, "k2", mem, 65, 66, 0);
	/* k2 loses 65: 66 is moved to k4, k2 goes; the next new one opens
	 * a fresh bundle, k5. */
	restart_unstore_buffer(r, 65);
	restart_flush(r);
	keep_buffers(r, mem, 67, 67);
	store_pump(&s);
	cr_assert_lt(store_fd(&s, "k2"), 0, "%s", s.text);
	char names[80][32];
	ino_t inos[80];
	cr_assert_eq(peek(store_fd(&s, "k4"), names, inos, 80), 64);
	cr_assert_str_eq(names[63], "b66");
	bundle_holds(&s, "k5", mem, 67, 67, 0);
	/* A bundle with no member left goes, and nothing is made for it. */
	restart_unstore_buffer(r, 67);
	restart_flush(r);
	store_pump(&s);
	cr_assert_lt(store_fd(&s, "k5"), 0, "%s", s.text);
	cr_assert_null(strstr(s.text, "FDNAME=k6"), "%s", s.text);
	cr_assert_eq(s.n, 1);
	cr_assert_eq(restart_get_stats(r)->bundles, 1);
	restart_free(r);
	store_close(&s);
}

/* The bundles' names are bounded so that LISTEN_FDNAMES stays within the
 * kernel's bound on one environment string: past the bound (a test's
 * small one here) a buffer is served unprotected; a rebuild that finds no
 * room keeps the bundle as it is (and the loop turn ends); a dropped
 * bundle gives its name's bytes back. */
Test(restart, the_stored_names_stay_within_what_listen_fdnames_can_pass, .timeout = 30)
{
	setenv("BUFBROKERD_TEST_FDNAMES_MAX", "6", 1); /* "k1:k2:" */
	store s;
	restart *r = start_empty(&s);
	const restart_stats *st = restart_get_stats(r);
	int mem[140];
	keep_buffers(r, mem, 1, 128);
	cr_assert(st->names_bytes == 6 && st->bundles == 2 && st->unprotected == 0);
	keep_buffers(r, mem, 129, 129); /* "k3:" would pass the bound */
	cr_assert(st->names_bytes == 6 && st->bundles == 2 && st->unprotected == 1);
	restart_store_allocation(r, 130, mem[129]); /* likewise */
	cr_assert_eq(st->unprotected, 2);
	restart_unstore_buffer(r, 129);
	restart_unstore_allocation(r, 130);
	cr_assert_eq(st->unprotected, 0);
	/* k1 loses a member, and no bundle can be made to move the rest
	 * to: k1 stays as it is. */
	restart_unstore_buffer(r, 1);
	restart_flush(r);
	store_pump(&s);
	cr_assert_null(strstr(s.text, "FDNAME=k3"), "past the bound, stored: %s", s.text);
	bundle_holds(&s, "k1", mem, 1, 64, 0);
	cr_assert_eq(st->unprotected, 0);
	/* k2 empties and goes: its name's bytes are free again, and the
	 * next rebuild of k1 has room. */
	for (uint64_t id = 65; id <= 128; id++)
		restart_unstore_buffer(r, id);
	restart_flush(r);
	cr_assert(st->names_bytes == 3 && st->bundles == 1);
	restart_unstore_buffer(r, 2);
	restart_flush(r);
	store_pump(&s);
	cr_assert_lt(store_fd(&s, "k1"), 0, "%s", s.text);
	cr_assert_lt(store_fd(&s, "k2"), 0, "%s", s.text);
	char names[80][32];
	ino_t inos[80];
	cr_assert_eq(peek(store_fd(&s, "k3"), names, inos, 80), 62); /* 3..64 */
	cr_assert(st->names_bytes == 3 && st->bundles == 1 && st->unprotected == 0);
	restart_free(r);
	store_close(&s);
}

/* A kept fd no bundle could take is tried again once there is room: at
 * the end of a turn that dropped a bundle (or a second after the last
 * try), it goes into a bundle and is protected again. */
Test(restart, an_unprotected_fd_is_bundled_once_a_bundle_makes_room, .timeout = 30)
{
	setenv("BUFBROKERD_TEST_FDNAMES_MAX", "3", 1); /* "k1:" only */
	store s;
	restart *r = start_empty(&s);
	unsetenv("BUFBROKERD_TEST_FDNAMES_MAX");
	const restart_stats *st = restart_get_stats(r);
	int mem[80];
	keep_buffers(r, mem, 1, 66); /* k1 full; 65 and 66: no room for "k2:" */
	restart_flush(r);            /* k1's repack has no room either */
	cr_assert(st->bundles == 1 && st->unprotected == 2, "%llu bundles, %llu unprotected",
		  (unsigned long long)st->bundles, (unsigned long long)st->unprotected);
	restart_flush(r); /* within the second: not tried again */
	cr_assert_eq(st->unprotected, 2);
	for (uint64_t id = 1; id <= 64; id++)
		restart_unstore_buffer(r, id);
	restart_flush(r); /* k1 goes: room for one bundle, and it is used */
	store_pump(&s);
	cr_assert_lt(store_fd(&s, "k1"), 0, "%s", s.text);
	bundle_holds(&s, "k2", mem, 65, 66, 0);
	cr_assert(st->bundles == 1 && st->unprotected == 0, "%llu bundles, %llu unprotected",
		  (unsigned long long)st->bundles, (unsigned long long)st->unprotected);
	restart_free(r);
	store_close(&s);
}

/* A bundle as a daemon stores it: a datagram socketpair whose queue holds
 * one message per fd; its receiving end. letter '?' sends a malformed
 * record (a wrong magic), fd -1 a record without an fd. */
static int make_bundle(const char *letters, const uint64_t *ids, const int *fds, int n)
{
	int sv[2];
	cr_assert_eq(socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv), 0);
	for (int i = 0; i < n; i++) {
		struct {
			uint8_t magic[2], version, letter;
			uint32_t zero;
			uint64_t id;
		} rec = {{'b', letters[i] == '?' ? 'x' : 'k'}, 1, (uint8_t)letters[i], 0, ids[i]};
		cr_assert_eq(msgio_send(sv[0], &rec, sizeof(rec), fds[i]), (ssize_t)sizeof(rec));
	}
	close(sv[0]);
	return sv[1];
}

/* A bundle whose queue holds one message of n records with the first
 * nfds of fds (a daemon's repacked bundle when nfds == n). */
static int make_bundle_one(const uint64_t *ids, const int *fds, int n, int nfds)
{
	int sv[2];
	cr_assert_eq(socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv), 0);
	struct {
		uint8_t magic[2], version, letter;
		uint32_t zero;
		uint64_t id;
	} rec[8];
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(8 * sizeof(int))];
	} ctl;
	memset(&ctl, 0, sizeof(ctl));
	for (int i = 0; i < n; i++)
		rec[i] = (__typeof__(rec[0])){{'b', 'k'}, 1, 'b', 0, ids[i]};
	struct iovec iov = {.iov_base = rec, .iov_len = (size_t)n * sizeof(rec[0])};
	struct msghdr m = {.msg_iov = &iov,
			   .msg_iovlen = 1,
			   .msg_control = ctl.b,
			   .msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int))};
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
	memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
	cr_assert_eq(sendmsg(sv[0], &m, 0), (ssize_t)iov.iov_len);
	close(sv[0]);
	return sv[1];
}

/* Passed bundles (an id found in two of them, an orphan, malformed
 * messages, an empty bundle): every buffer is adopted from them, an id
 * found twice is kept once; a bundle whose every message names a live
 * buffer stays as it is; one with an orphan or a malformed message is
 * rebuilt (its live members in a new bundle first, then it is removed);
 * an empty one is removed; no passed bundle is drained. */
Test(restart, a_start_adopts_the_passed_bundles_and_rebuilds_those_with_strays)
{
	kept_state k;
	make_state(&k);
	store s;
	store_open(&s);
	int bundles[5];
	bundles[0] = make_bundle_one(k.ids, k.fds, 2, 2); /* k1: buffers 1, 2 in one message */
	bundles[1] =
		make_bundle("bbb", (uint64_t[]){k.ids[1], k.ids[2], 99},
			    (int[]){k.fds[1], k.fds[2], k.fds[3]}, 3); /* k5: 2 again, 3, b99 */
	bundles[2] = make_bundle("?b", (uint64_t[]){k.ids[0], k.ids[1]}, (int[]){k.unknown, -1},
				 2);                 /* k7: malformed */
	bundles[3] = make_bundle("", NULL, NULL, 0); /* k8: empty */
	/* k10, passed before k5: one message of two records with one fd (the
	 * wrong file for the first): malformed, neither is used */
	bundles[4] = make_bundle_one((uint64_t[]){k.ids[2], k.ids[0]}, k.fds, 2, 1);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		int src[6] = {k.journal,  bundles[0], bundles[4],
			      bundles[1], bundles[2], bundles[3]};
		restart *r;
		broker *b = child_start_n(src, 6, "journal-1:k1:k10:k5:k7:k8", s.path, &r);
		const restart_stats *st = restart_get_stats(r);
		CHECK(st->restored_buffers == 3);
		CHECK(st->failed_missing == 0);
		CHECK(st->orphans_closed == 1); /* b99 */
		CHECK(!st->refused);
		CHECK(st->bundles == 2); /* k1, and k11 with what k5 held of use */
		broker_error err;
		broker_conn *root = broker_conn_open(b, 0, 0, 1, &err);
		broker_info info;
		CHECK(broker_stat_id(b, root, k.ids[0], &info, &err) == 0);
		CHECK(info.state == BB_READY);
		char report[1024];
		CHECK(broker_check(b, report, sizeof(report)) == 0);
		each_seen e = {0};
		CHECK(restart_each_fd(r, each_fn, &e) == 3); /* journal-2, k1, k11 */
		_exit(0);
	}
	int status = store_wait(&s, pid);
	cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed (status %d)",
		  status);
	cr_assert(strstr(s.text, "[FDSTORE=1 FDNAME=journal-2]"), "%s", s.text);
	cr_assert_null(strstr(s.text, "FDNAME=k1]"), "a whole bundle was touched: %s", s.text);
	long moved = text_at(&s, "[FDSTORE=1 FDNAME=k11 FDPOLL=0]");
	cr_assert(moved >= 0 && text_at(&s, "[FDSTOREREMOVE=1 FDNAME=k5]") > moved, "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=k7]"), "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=k8]"), "%s", s.text);
	cr_assert(strstr(s.text, "[FDSTOREREMOVE=1 FDNAME=k10]"), "%s", s.text);
	cr_assert_eq(s.n, 2, "the store: journal-2 and k11: %s", s.text);
	char names[4][32], want[32];
	ino_t inos[4];
	cr_assert_eq(peek(store_fd(&s, "k11"), names, inos, 4), 1);
	snprintf(want, sizeof(want), "b%llu", (unsigned long long)k.ids[2]);
	cr_assert_str_eq(names[0], want);
	cr_assert_eq(inos[0], ino_of(k.fds[2]));
	/* Peeked, never taken: every passed bundle holds what it held. */
	cr_assert_eq(peek(bundles[0], names, inos, 4), 2);
	cr_assert_eq(peek(bundles[1], names, inos, 4), 3);
	cr_assert_eq(peek(bundles[2], names, inos, 4), 2);
	cr_assert_eq(peek(bundles[4], names, inos, 4), 2);
	cr_assert_str_eq(names[0], "?", "a message without all its fds is malformed");
	for (int i = 0; i < 5; i++)
		close(bundles[i]);
	store_close(&s);
	kept_state_close(&k);
}
