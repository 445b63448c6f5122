/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The broker with its state journal on (docs/RESTART.md, "Wiring the
 * journal into the daemon"): a broker driven by a random workload (sessions
 * open and close, alloc, open, retain, release, take, adopt, settle, token
 * expiry) rebuilds from its journal (broker_restore) equal to itself, and
 * from a copy of the journal taken after any store of a call equal to
 * itself before or after that call, never anything else. Host buffers on a
 * counting backend: every restored buffer gets memory, and none is left
 * when the brokers are freed.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "broker.h"
#include "journal.h"

/* ---- a counting host backend ---------------------------------------------- */

static int live_mems; /* memory the backend handed out and did not get back */
static int grow_next; /* allocs that answer BACKEND_GROW first */

static int count_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		       backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	if (grow_next > 0) {
		grow_next--;
		return BACKEND_GROW;
	}
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	live_mems++;
	return 0;
}

static void count_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	live_mems--;
}

static int count_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
			size_t errlen)
{
	(void)be, (void)mem, (void)err, (void)errlen;
	out->fd = -1;
	return 0;
}

static int count_import(backend *be, int fd, uint64_t size, backend_mem *out, char *err,
			size_t errlen)
{
	(void)fd;
	return count_alloc(be, size, 0, 0, 0, NULL, out, err, errlen);
}

static void count_expose(backend *be, const backend_mem *mem)
{
	(void)be, (void)mem;
}

static backend host = {
	.name = "counting",
	.alloc = count_alloc,
	.import_fd = count_import,
	.free = count_free,
	.export_mem = count_export,
	.expose = count_expose,
};

/* broker_restore's memory: a fresh block of the record's size. */
static int restore_mem(void *ctx, backend *be, const journal_buffer *rec, backend_mem *out,
		       char *err, size_t len)
{
	(void)ctx;
	return count_alloc(be, rec->size, rec->device, rec->owner_uid, (int)rec->share, NULL, out,
			   err, len);
}

/* ---- the brokers ---------------------------------------------------------- */

static uint64_t clock_ms = 1000;

static uint64_t fake_now(void *ctx)
{
	(void)ctx;
	return clock_ms;
}

static void fake_random(void *ctx, unsigned char *buf, size_t n)
{
	(void)ctx;
	for (size_t i = 0; i < n; i++)
		buf[i] = (unsigned char)rand();
}

static broker *broker_with(journal *j)
{
	broker_config cfg = {.now_ms = fake_now, .random = fake_random, .journal = j};
	broker_limits_default(&cfg.limits);
	cfg.limits.token_ttl_ms = 50;
	broker *b = broker_new(&cfg);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &host, NULL);
	return b;
}

/* A journal of file layout version (0: the current one). */
static journal *new_journal_of(uint32_t version)
{
	journal *j = NULL;
	char why[256];
	/* Small first extents: the file grows while the workload runs. */
	journal_config jc = {.big_slots = 4, .small_slots = 8, .version = version};
	cr_assert_eq(journal_create(&jc, &j, why, sizeof(why)), 0, "%s", why);
	return j;
}

static journal *new_journal(void)
{
	return new_journal_of(0);
}

/* ---- what a broker looks like from outside ---------------------------------- */

typedef struct view {
	char *text;
	size_t len, cap;
} view;

static void view_add(view *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void view_add(view *v, const char *fmt, ...)
{
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	cr_assert(n > 0 && (size_t)n < sizeof(line));
	if (v->len + (size_t)n + 1 > v->cap) {
		v->cap = 2 * (v->len + (size_t)n + 1);
		v->text = realloc(v->text, v->cap);
		cr_assert_not_null(v->text);
	}
	memcpy(v->text + v->len, line, (size_t)n + 1);
	v->len += (size_t)n;
}

static int view_buffer(const broker_info *i, void *arg)
{
	view_add(arg,
		 "buffer %" PRIu64 " size %" PRIu64 " kind %d state %d refs %" PRIu64
		 " tokens %u name \"%s\" error \"%s\" owner %u:%u share %d\n",
		 i->id, i->size, (int)i->kind, (int)i->state, i->refs, i->tokens, i->name, i->error,
		 i->owner_uid, i->owner_gid, i->share);
	return 0;
}

/* Every buffer as root lists it, and the totals; extra_conns: connections
 * the caller opened only to look (not counted). root: a root connection of
 * b that holds nothing. */
static char *view_of(broker *b, broker_conn *root, uint32_t extra_conns)
{
	char report[4096];
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
	view v = {0};
	broker_list(b, root, view_buffer, &v);
	broker_totals t;
	broker_totals_get(b, &t);
	view_add(&v,
		 "host buffers %" PRIu64 " bytes %" PRIu64 " connections %u tokens %" PRIu64 "\n",
		 t.buffers[BB_HOST], t.bytes[BB_HOST], t.connections - extra_conns, t.tokens);
	if (!v.text)
		view_add(&v, "empty\n");
	return v.text;
}

/* The view of the broker journal file fd rebuilds, or NULL when refused. */
static char *view_restored(int fd)
{
	broker *r = broker_with(NULL);
	broker_error err;
	if (broker_restore(r, fd, restore_mem, NULL, &err)) {
		broker_free(r);
		return NULL;
	}
	broker_conn *root = broker_conn_open(r, 0, 0, 1, &err);
	cr_assert_not_null(root, "%s", err.msg);
	char *v = view_of(r, root, 1);
	broker_free(r);
	return v;
}

/* ---- the workload ------------------------------------------------------------ */

#define CONNS 5
#define TOKENS 16

typedef struct workload {
	broker *b;
	broker_conn *root;        /* uid 0, holds nothing: looks */
	broker_conn *conn[CONNS]; /* NULL: closed */
	unsigned char token[TOKENS][BB_TOKEN_SIZE];
	uint32_t ntokens;
	uint64_t next_request[CONNS];
} workload;

static const uint32_t uids[CONNS] = {1000, 1000, 1001, 1002, 0};

static uint64_t some_buffer(workload *w)
{
	/* Ids are handed out from 1: a few above the last one miss. */
	broker_totals t;
	broker_totals_get(w->b, &t);
	return 1 + (uint64_t)rand() % (t.buffers[BB_HOST] * 2 + 8);
}

static void step(workload *w)
{
	broker_error err;
	int i = rand() % CONNS;
	broker_conn *c = w->conn[i];
	if (!c) {
		w->conn[i] = broker_conn_open(w->b, uids[i], uids[i], 100 + (uint32_t)i, &err);
		cr_assert_not_null(w->conn[i], "%s", err.msg);
		return;
	}
	broker_conn_note_request(c, ++w->next_request[i]);
	broker_buf *buf;
	uint64_t id = some_buffer(w);
	switch (rand() % 12) {
	case 0:
		if (rand() % 4 == 0) {
			broker_conn_close(w->b, c);
			w->conn[i] = NULL;
			w->next_request[i] = 0;
			break;
		}
		/* fall through */
	case 1:
	case 2: {
		char name[32];
		snprintf(name, sizeof(name), "buf-%d", rand() % 20);
		broker_alloc_req req = {
			.size = 4096 * (1 + (uint64_t)(rand() % 4)),
			.kind = BB_HOST,
			.name = rand() % 3 == 0 ? name : NULL,
			.share = rand() % 3,
			.import_fd = -1,
		};
		broker_alloc(w->b, c, &req, &buf, &err);
		break;
	}
	case 3: broker_open_id(w->b, c, id, &buf, &err); break;
	case 4: broker_retain(w->b, c, id, 1 + (uint32_t)(rand() % 3), NULL, NULL, &err); break;
	case 5:
	case 6: broker_release(w->b, c, id, 1 + (uint32_t)(rand() % 2), NULL, NULL, &err); break;
	case 7:
		if (broker_take(w->b, c, id, rand() % 2, w->token[w->ntokens % TOKENS], &err) == 0)
			w->ntokens++;
		break;
	case 8:
		if (w->ntokens)
			broker_adopt(w->b, c, w->token[(uint32_t)rand() % TOKENS], &buf, &err);
		break;
	case 9: broker_set_ready(w->b, c, id, &err); break;
	case 10: broker_set_error(w->b, c, id, rand() % 2 ? "it broke" : "", &err); break;
	case 11:
		clock_ms += (uint64_t)(rand() % 30);
		broker_expire_tokens(w->b);
		break;
	}
}

static void workload_start(workload *w, journal *j)
{
	broker_error err;
	*w = (workload){.b = broker_with(j)};
	w->root = broker_conn_open(w->b, 0, 0, 1, &err);
	cr_assert_not_null(w->root, "%s", err.msg);
}

static void workload_end(workload *w)
{
	broker_free(w->b);
}

/* ---- tests ------------------------------------------------------------------- */

static void setup(void)
{
	srand(14);
	live_mems = 0;
	grow_next = 0;
	clock_ms = 1000;
}

static void teardown(void)
{
	cr_assert_eq(live_mems, 0, "%d buffers' memory was not given back", live_mems);
}

TestSuite(broker_journal, .init = setup, .fini = teardown);

Test(broker_journal, a_broker_rebuilds_from_its_journal_equal_to_itself)
{
	journal *j = new_journal();
	workload w;
	workload_start(&w, j);
	for (int round = 0; round < 40; round++) {
		for (int k = 0; k < 50; k++)
			step(&w);
		char *want = view_of(w.b, w.root, 0);
		char *got = view_restored(journal_fd(j));
		cr_assert_not_null(got, "round %d: the journal was refused", round);
		cr_assert_str_eq(got, want, "round %d", round);
		free(want);
		free(got);
	}
	cr_assert_eq(broker_journal_errors(w.b), 0);
	workload_end(&w);
	journal_free(j);
}

static int highest_id(const broker_info *i, void *arg)
{
	uint64_t *highest = arg;
	if (i->id > *highest)
		*highest = i->id;
	return 0;
}

Test(broker_journal, a_restored_broker_journals_itself_and_carries_on)
{
	journal *j = new_journal();
	workload w;
	workload_start(&w, j);
	for (int k = 0; k < 400; k++)
		step(&w);
	char *want = view_of(w.b, w.root, 0);

	/* Restore into a broker with a journal of its own: that journal holds
	 * the whole state at once, and rebuilds it again. */
	journal *j2 = new_journal();
	broker *r = broker_with(j2);
	broker_error err;
	cr_assert_eq(broker_restore(r, journal_fd(j), restore_mem, NULL, &err), 0, "%s", err.msg);
	char *again = view_restored(journal_fd(j2));
	cr_assert_not_null(again);
	cr_assert_str_eq(again, want);

	/* Ids are not reused: the next buffer's id is above every old one. */
	broker_conn *c = broker_conn_open(r, 1000, 1000, 7, &err);
	cr_assert_not_null(c, "%s", err.msg);
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	cr_assert_eq(broker_alloc(r, c, &req, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(r, buf, c, &info);
	uint64_t highest = 0;
	broker_list(w.b, w.root, highest_id, &highest);
	cr_assert_gt(info.id, highest, "buffer %" PRIu64 " is not above %" PRIu64, info.id,
		     highest);
	cr_assert_eq(broker_journal_errors(r), 0);

	free(want);
	free(again);
	broker_free(r);
	journal_free(j2);
	workload_end(&w);
	journal_free(j);
}

/* The layout version in a journal file's header. */
static uint32_t file_version(int fd)
{
	uint32_t v = 0;
	cr_assert_eq(pread(fd, &v, sizeof(v), 8), (ssize_t)sizeof(v));
	return v;
}

/* The daemon of the build before kept its state in layout 1: the upgraded
 * daemon's broker rebuilds from it equal to the broker that wrote it, and
 * journals itself in the current layout, which rebuilds it again. */
Test(broker_journal, a_layout_1_journal_rebuilds_the_broker_that_wrote_it)
{
	journal *j = new_journal_of(1);
	cr_assert_eq(file_version(journal_fd(j)), 1);
	workload w;
	workload_start(&w, j);
	for (int k = 0; k < 400; k++)
		step(&w);
	char *want = view_of(w.b, w.root, 0);
	char *got = view_restored(journal_fd(j));
	cr_assert_not_null(got, "the layout 1 journal was refused");
	cr_assert_str_eq(got, want);

	journal *j2 = new_journal();
	broker *r = broker_with(j2);
	broker_error err;
	cr_assert_eq(broker_restore(r, journal_fd(j), restore_mem, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(file_version(journal_fd(j2)), JOURNAL_VERSION);
	char *again = view_restored(journal_fd(j2));
	cr_assert_not_null(again);
	cr_assert_str_eq(again, want);
	cr_assert_eq(broker_journal_errors(w.b), 0);
	cr_assert_eq(broker_journal_errors(r), 0);

	free(want);
	free(got);
	free(again);
	broker_free(r);
	journal_free(j2);
	workload_end(&w);
	journal_free(j);
}

/* A copy of the journal file after every store of one call. */
typedef struct crash_copies {
	int fd;
	int copies[4096];
	size_t n;
} crash_copies;

static int copy_of(int fd)
{
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	int c = memfd_create("journal-copy", MFD_CLOEXEC);
	cr_assert_geq(c, 0);
	void *src = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	cr_assert_neq(src, MAP_FAILED);
	cr_assert_eq(write(c, src, (size_t)st.st_size), st.st_size);
	munmap(src, (size_t)st.st_size);
	return c;
}

static void copy_hook(void *ctx)
{
	crash_copies *cc = ctx;
	cr_assert_lt(cc->n, sizeof(cc->copies) / sizeof(cc->copies[0]));
	cc->copies[cc->n++] = copy_of(cc->fd);
}

Test(broker_journal, a_crash_at_any_store_rebuilds_the_broker_before_or_after_the_call)
{
	journal *j = new_journal();
	workload w;
	workload_start(&w, j);
	static crash_copies cc;
	size_t points = 0, afters = 0;
	for (int s = 0; s < 300; s++) {
		bool watch = s % 5 == 0;
		char *before = watch ? view_of(w.b, w.root, 0) : NULL;
		cc = (crash_copies){.fd = journal_fd(j)};
		if (watch)
			journal_set_store_hook(j, copy_hook, &cc);
		step(&w);
		journal_set_store_hook(j, NULL, NULL);
		if (!watch)
			continue;
		char *after = view_of(w.b, w.root, 0);
		bool went_after = false;
		for (size_t k = 0; k < cc.n; k++) {
			char *got = view_restored(cc.copies[k]);
			close(cc.copies[k]);
			cr_assert_not_null(got,
					   "step %d: a crash after store %zu of %zu is refused", s,
					   k + 1, cc.n);
			bool is_after = strcmp(got, after) == 0;
			bool is_before = strcmp(got, before) == 0;
			cr_assert(
				is_after || is_before,
				"step %d: a crash after store %zu of %zu rebuilds neither the "
				"broker before the call nor the one after:\n%s\nbefore:\n%s\nafter:\n%s",
				s, k + 1, cc.n, got, before, after);
			cr_assert(!went_after || is_after,
				  "step %d: store %zu of %zu goes back to the state before", s,
				  k + 1, cc.n);
			went_after = went_after || (is_after && !is_before);
			afters += is_after && !is_before;
			points++;
			free(got);
		}
		free(before);
		free(after);
	}
	cr_assert_gt(points, 500, "only %zu crash points", points);
	cr_assert_gt(afters, 0);
	workload_end(&w);
	journal_free(j);
}

Test(broker_journal, a_corrupted_state_is_refused_and_leaves_the_broker_empty)
{
	journal *j = new_journal();
	workload w;
	workload_start(&w, j);
	for (int k = 0; k < 200; k++)
		step(&w);
	/* A live buffer record's committed copy, flipped: the digest no longer
	 * sums, and nothing of the state is used. */
	int bad = copy_of(journal_fd(j));
	struct stat st;
	cr_assert_eq(fstat(bad, &st), 0);
	unsigned char *m =
		mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, bad, 0);
	cr_assert_neq(m, MAP_FAILED);
	/* Flip every byte of the first extent's slots: at least one live record's
	 * copies are in it. */
	for (size_t off = 4096; off < 4096 + 4 * 1024; off++)
		m[off] ^= 0x5a;
	munmap(m, (size_t)st.st_size);
	broker *r = broker_with(NULL);
	broker_error err;
	int rc = broker_restore(r, bad, restore_mem, NULL, &err);
	cr_assert(rc == BB_ERR_PROTOCOL || rc == BB_ERR_INVALID, "rc %d: %s", rc, err.msg);
	broker_totals t;
	broker_totals_get(r, &t);
	cr_assert_eq(t.buffers[BB_HOST], 0);
	cr_assert_eq(t.connections, 0);
	broker_free(r);
	close(bad);
	workload_end(&w);
	journal_free(j);
}

Test(broker_journal, off_writes_nothing_and_reports_no_errors)
{
	workload w;
	workload_start(&w, NULL);
	for (int k = 0; k < 200; k++)
		step(&w);
	cr_assert_eq(broker_journal_errors(w.b), 0);
	workload_end(&w);
}

/* The session record of the only uid-1000 connection in journal j. */
static journal_session session_of_1000(journal *j)
{
	journal_state s;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &s, why, sizeof(why)), 0, "%s", why);
	journal_session found = {0};
	for (size_t i = 0; i < s.n_sessions; i++)
		if (s.sessions[i].uid == 1000)
			found = s.sessions[i];
	journal_state_free(&s);
	cr_assert_neq(found.id, 0);
	return found;
}

Test(broker_journal, applied_request_ids_commit_with_their_effect)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	cr_assert_not_null(c);
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	broker_conn_note_request(c, 1);
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
	broker_info info;
	broker_buf_info(b, buf, c, &info);
	journal_session s = session_of_1000(j);
	cr_assert_eq(s.last_request, 1);
	cr_assert_eq(s.applied_mask, 0);

	/* Out of order: 3 before 2 (a threaded client). */
	broker_conn_note_request(c, 3);
	cr_assert_eq(broker_retain(b, c, info.id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	s = session_of_1000(j);
	cr_assert_eq(s.last_request, 1);
	cr_assert_eq(s.applied_mask, 2, "mask %" PRIx64, s.applied_mask);
	broker_conn_note_request(c, 2);
	cr_assert_eq(broker_release(b, c, info.id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	s = session_of_1000(j);
	cr_assert_eq(s.last_request, 3);
	cr_assert_eq(s.applied_mask, 0);
	broker_free(b);
	journal_free(j);
}

/* ---- sessions across a restart, flags, lost memory ------------------------- */

/* The buffer record of id in journal j. */
static journal_buffer buffer_record(journal *j, uint64_t id)
{
	journal_state s;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &s, why, sizeof(why)), 0, "%s", why);
	journal_buffer found = {0};
	for (size_t i = 0; i < s.n_buffers; i++)
		if (s.buffers[i].id == id)
			found = s.buffers[i];
	journal_state_free(&s);
	cr_assert_eq(found.id, id, "no record of buffer %" PRIu64, id);
	return found;
}

static broker *restored(journal *from, journal *own, uint64_t grace_ms, broker_restore_mem mem)
{
	broker *b = broker_with(own);
	broker_set_grace(b, grace_ms);
	broker_error err;
	cr_assert_eq(broker_restore(b, journal_fd(from), mem, NULL, &err), 0, "%s", err.msg);
	char report[1024];
	cr_assert_eq(broker_check(b, report, sizeof(report)), 0, "%s", report);
	return b;
}

Test(broker_journal, restored_sessions_are_absent_until_their_grace_deadline)
{
	journal *j1 = new_journal(), *j2 = new_journal(), *j3 = new_journal();
	broker *b1 = broker_with(j1);
	broker_error err;
	broker_conn *c = broker_conn_open(b1, 1000, 1000, 7, &err);
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *x, *y;
	cr_assert_eq(broker_alloc(b1, c, &req, &x, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_alloc(b1, c, &req, &y, &err), 0, "%s", err.msg);
	broker_info ix, iy;
	broker_buf_info(b1, x, c, &ix);
	broker_buf_info(b1, y, c, &iy);
	cr_assert_eq(broker_set_ready(b1, c, iy.id, &err), 0);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b1, c, ix.id, true, tok, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_absent_sessions(b1), 0, "a live connection is not absent");
	cr_assert_not(broker_conn_absent(c));
	uint64_t session = broker_conn_session(c);

	/* The crash: b1 is gone; b2 rebuilds from its journal. */
	broker *b2 = restored(j1, j2, 500, restore_mem);
	uint64_t deadline = clock_ms + 500;
	cr_assert_eq(broker_absent_sessions(b2), 1);
	cr_assert_eq(broker_next_grace(b2), deadline);
	cr_assert_eq(broker_release_absent(b2), 0, "released before its deadline");

	/* A second crash within the grace period keeps the deadline. */
	clock_ms += 300;
	broker *b3 = restored(j2, j3, 500, restore_mem);
	cr_assert_eq(broker_next_grace(b3), deadline, "the deadline moved: %" PRIu64,
		     broker_next_grace(b3));
	clock_ms += 199;
	cr_assert_eq(broker_release_absent(b3), 0);
	clock_ms += 1;
	broker_conn *root = broker_conn_open(b3, 0, 0, 1, &err);
	cr_assert_eq(broker_release_absent(b3), 1);
	cr_assert_eq(broker_absent_sessions(b3), 0);
	cr_assert_eq(broker_next_grace(b3), 0);
	/* As a disconnect: its count went (y with it), its PENDING buffer
	 * failed, its token lives on. */
	broker_info info;
	cr_assert_eq(broker_stat_id(b3, root, iy.id, &info, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(broker_stat_id(b3, root, ix.id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "producer disconnected");
	cr_assert_eq(info.refs, 1);
	char report[1024];
	cr_assert_eq(broker_check(b3, report, sizeof(report)), 0, "%s", report);
	/* The release is journaled: the session is gone from b3's journal. */
	journal_state s;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j3), &s, why, sizeof(why)), 0, "%s", why);
	for (size_t i = 0; i < s.n_sessions; i++)
		cr_assert_neq(s.sessions[i].id, session, "the released session is still journaled");
	journal_state_free(&s);
	broker_free(b1);
	broker_free(b2);
	broker_free(b3);
	journal_free(j1);
	journal_free(j2);
	journal_free(j3);
}

Test(broker_journal, imported_and_exposed_buffers_are_journaled_with_their_flags)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	broker_conn *d = broker_conn_open(b, 1001, 1001, 8, &err);
	broker_alloc_req req = {
		.size = 4096, .kind = BB_HOST, .import_fd = -1, .share = BB_SHARE_ANY};
	broker_buf *plain, *shown, *imported, *got;
	cr_assert_eq(broker_alloc(b, c, &req, &plain, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_alloc(b, c, &req, &shown, &err), 0, "%s", err.msg);
	req.import_fd = 0; /* the counting backend does not look at it */
	cr_assert_eq(broker_alloc(b, c, &req, &imported, &err), 0, "%s", err.msg);
	broker_info ip, is, ii;
	broker_buf_info(b, plain, c, &ip);
	broker_buf_info(b, shown, c, &is);
	broker_buf_info(b, imported, c, &ii);
	broker_granted g;
	/* Granted to its own uid: not exposed; to another uid: exposed. */
	cr_assert_eq(broker_open_id(b, c, ip.id, &got, &err), 0);
	cr_assert_eq(broker_grant(b, c, got, &g, &err), 0);
	cr_assert_eq(broker_open_id(b, d, is.id, &got, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_grant(b, d, got, &g, &err), 0);
	cr_assert(g.exposed);
	cr_assert_eq(buffer_record(j, ip.id).flags, 0);
	cr_assert_eq(buffer_record(j, is.id).flags, JOURNAL_BUF_EXPOSED);
	cr_assert_eq(buffer_record(j, ii.id).flags, JOURNAL_BUF_IMPORTED);

	/* And a restored broker keeps them. */
	journal *j2 = new_journal();
	broker *b2 = restored(j, j2, 1000, restore_mem);
	cr_assert_eq(buffer_record(j2, is.id).flags, JOURNAL_BUF_EXPOSED);
	cr_assert_eq(buffer_record(j2, ii.id).flags, JOURNAL_BUF_IMPORTED);
	broker_free(b);
	broker_free(b2);
	journal_free(j);
	journal_free(j2);
}

static int mem_calls;
static uint64_t lose_id;

/* restore_mem, but buffer lose_id's memory was not kept. */
static int restore_losing(void *ctx, backend *be, const journal_buffer *rec, backend_mem *out,
			  char *err, size_t len)
{
	mem_calls++;
	if (rec->id == lose_id) {
		snprintf(err, len, "gone with the process");
		return BROKER_RESTORE_LOST;
	}
	return restore_mem(ctx, be, rec, out, err, len);
}

Test(broker_journal, a_buffer_whose_memory_was_lost_is_failed_and_counted_nowhere)
{
	journal *j = new_journal(), *j2 = new_journal(), *j3 = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *keep, *lose;
	cr_assert_eq(broker_alloc(b, c, &req, &keep, &err), 0);
	req.size = 8192;
	cr_assert_eq(broker_alloc(b, c, &req, &lose, &err), 0);
	broker_info ik, il;
	broker_buf_info(b, keep, c, &ik);
	broker_buf_info(b, lose, c, &il);
	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, c, il.id, true, tok, &err), 0);
	broker_free(b); /* the crash (broker_free writes nothing to the journal) */

	lose_id = il.id;
	mem_calls = 0;
	broker *b2 = restored(j, j2, 1000, restore_losing);
	cr_assert_eq(mem_calls, 2);
	broker_conn *root = broker_conn_open(b2, 0, 0, 1, &err);
	broker_info info;
	cr_assert_eq(broker_stat_id(b2, root, il.id, &info, &err), 0);
	cr_assert_eq(info.state, BB_FAILED);
	cr_assert_str_eq(info.error, "gone with the process");
	cr_assert_eq(info.refs, 2, "its references are kept (a hold and a token)");
	broker_totals t;
	broker_totals_get(b2, &t);
	cr_assert_eq(t.buffers[BB_HOST], 1, "a lost buffer is in no total");
	cr_assert_eq(t.bytes[BB_HOST], 4096);
	uint64_t n, lost;
	broker_restored(b2, &n, &lost);
	cr_assert_eq(n, 2);
	cr_assert_eq(lost, 1);
	cr_assert(buffer_record(j2, il.id).flags & JOURNAL_BUF_LOST);
	/* Open of it is refused with why; adopt of its token too. */
	broker_buf *got;
	cr_assert_eq(broker_open_id(b2, root, il.id, &got, &err), 0);
	broker_granted g;
	cr_assert_eq(broker_grant(b2, root, got, &g, &err), BB_ERR_FAILED);

	/* A later start does not ask for its memory again. */
	mem_calls = 0;
	broker *b3 = restored(j2, j3, 1000, restore_losing);
	cr_assert_eq(mem_calls, 1);
	broker_conn *root3 = broker_conn_open(b3, 0, 0, 1, &err);
	cr_assert_eq(broker_stat_id(b3, root3, il.id, &info, &err), 0);
	cr_assert_str_eq(info.error, "gone with the process");
	/* Its last reference goes without the backend's free. */
	broker_free(b2);
	int before = live_mems;
	cr_assert_eq(broker_adopt(b3, root3, tok, &got, &err), 0, "%s", err.msg);
	clock_ms += 1000; /* the grace period of every restored session */
	cr_assert_gt(broker_release_absent(b3), 0);
	cr_assert_eq(broker_absent_sessions(b3), 0);
	cr_assert_eq(broker_release(b3, root3, il.id, 1, NULL, NULL, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_stat_id(b3, root3, il.id, &info, &err), BB_ERR_NOT_FOUND);
	cr_assert_eq(live_mems, before - 1, "only the kept buffer's memory was returned");
	char report[1024];
	cr_assert_eq(broker_check(b3, report, sizeof(report)), 0, "%s", report);
	broker_free(b3);
	journal_free(j);
	journal_free(j2);
	journal_free(j3);
}

/* ---- session resume and exactly once (docs/RESTART.md, "Clients: session
 * resume"): each session has a random secret, journaled with it; a restored
 * session resumes with its secret and uid only; a resumed session tells
 * which request ids it applied, with the answers of the result-bearing ones
 * in its ring, so that a request sent again is answered, not applied
 * twice. ------------------------------------------------------------------ */

/* A broker rebuilt from j, with a journal of its own (*jout). */
static broker *rebuilt(journal *j, journal **jout)
{
	*jout = new_journal();
	return restored(j, *jout, 10000, restore_mem);
}

static uint64_t buf_id(broker *b, const broker_buf *buf)
{
	broker_info info;
	broker_buf_info(b, buf, NULL, &info);
	return info.id;
}

static uint64_t alloc_host(broker *b, broker_conn *c, uint64_t request)
{
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	broker_error err;
	broker_conn_note_request(c, request);
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
	return buf_id(b, buf);
}

Test(broker_journal, each_session_has_its_own_secret_journaled_with_it)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c1 = broker_conn_open(b, 1000, 1000, 7, &err);
	broker_conn *c2 = broker_conn_open(b, 1000, 1000, 8, &err);
	cr_assert(c1 && c2);
	cr_assert(broker_keeps_state(b));
	unsigned char s1[BB_TOKEN_SIZE], s2[BB_TOKEN_SIZE], zero[BB_TOKEN_SIZE] = {0};
	broker_conn_secret(c1, s1);
	broker_conn_secret(c2, s2);
	cr_assert_neq(memcmp(s1, zero, sizeof(s1)), 0);
	cr_assert_neq(memcmp(s1, s2, sizeof(s1)), 0, "two sessions, one secret");

	journal_state st;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_sessions, 2);
	for (size_t i = 0; i < st.n_sessions; i++) {
		const unsigned char *want = st.sessions[i].id == broker_conn_session(c1) ? s1 : s2;
		cr_assert_eq(memcmp(st.sessions[i].secret, want, BB_TOKEN_SIZE), 0);
	}
	journal_state_free(&st);
	broker_free(b);
	journal_free(j);

	/* Off: no state is kept, and there is nothing to resume with. */
	b = broker_with(NULL);
	c1 = broker_conn_open(b, 1000, 1000, 7, &err);
	cr_assert_not(broker_keeps_state(b));
	broker_conn_secret(c1, s1);
	cr_assert_eq(memcmp(s1, zero, sizeof(s1)), 0);
	broker_free(b);
}

Test(broker_journal, a_restored_session_resumes_with_its_secret_and_uid_only)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	cr_assert_not_null(c);
	uint64_t id = alloc_host(b, c, 1);
	broker_conn_note_request(c, 2);
	cr_assert_eq(broker_retain(b, c, id, 2, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);

	/* While its connection lives, nobody else can take it. */
	broker_conn *out = NULL;
	uint64_t floor = 0, mask = 0;
	cr_assert_eq(broker_session_resume(b, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     BB_ERR_EXISTS, "%s", err.msg);

	journal *j2;
	broker *r = rebuilt(j, &j2);
	broker_free(b);
	journal_free(j);

	unsigned char wrong[BB_TOKEN_SIZE];
	memcpy(wrong, secret, sizeof(wrong));
	wrong[BB_TOKEN_SIZE - 1] ^= 1;
	cr_assert_eq(broker_session_resume(r, session, wrong, sizeof(wrong), 1000, &out, &floor,
					   &mask, &err),
		     BB_ERR_DENIED);
	cr_assert_eq(broker_session_resume(r, session, secret, 8, 1000, &out, &floor, &mask, &err),
		     BB_ERR_DENIED, "a short secret");
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1001, &out, &floor,
					   &mask, &err),
		     BB_ERR_DENIED, "another uid");
	cr_assert_eq(broker_session_resume(r, session + 1, secret, sizeof(secret), 1000, &out,
					   &floor, &mask, &err),
		     BB_ERR_NOT_FOUND);
	cr_assert(strstr(err.msg, "not known"), "%s", err.msg);

	/* Refusals leave it absent: the right secret still resumes it, with
	 * its counts, and tells which requests it applied. */
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_not_null(out);
	cr_assert_eq(broker_conn_session(out), session);
	cr_assert_eq(floor, 2);
	cr_assert_eq(mask, 0);
	broker_info info;
	cr_assert_eq(broker_stat_id(r, out, id, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 3);
	cr_assert_eq(info.refs, 3);
	/* Once: a second client cannot attach to it too. */
	broker_conn *again;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &again, &floor,
					   &mask, &err),
		     BB_ERR_EXISTS);

	/* The resumed session is journaled present, secret and all: a second
	 * restart finds it again. */
	journal *j3;
	broker *r2 = rebuilt(j2, &j3);
	cr_assert_eq(broker_session_resume(r2, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	broker_free(r2);
	journal_free(j3);
	broker_free(r);
	journal_free(j2);
}

Test(broker_journal, applied_requests_are_answered_from_the_ring_after_a_resume)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	uint64_t a = alloc_host(b, c, 1);
	unsigned char tok[BB_TOKEN_SIZE];
	broker_conn_note_request(c, 2);
	cr_assert_eq(broker_take(b, c, a, true, tok, &err), 0, "%s", err.msg);
	broker_alloc_req bad = {.size = 0, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	broker_conn_note_request(c, 3);
	cr_assert_neq(broker_alloc(b, c, &bad, &buf, &err), 0);
	broker_conn_note_request(c, 5); /* 4 is in flight */
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);

	/* A session never resumed answers every id as new: a client that
	 * reuses ids is served as before. */
	broker_applied done;
	cr_assert_not(broker_conn_applied(b, c, 1, &done));

	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);
	journal *j2;
	broker *r = rebuilt(j, &j2);
	broker_free(b);
	journal_free(j);
	broker_conn *out;
	uint64_t floor, mask;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 3);
	cr_assert_eq(mask, 2, "5 applied above the floor: mask %" PRIx64, mask);

	cr_assert(broker_conn_applied(r, out, 1, &done));
	cr_assert(done.found);
	cr_assert_eq(done.status, 0);
	cr_assert_not_null(done.buf);
	cr_assert_eq(buf_id(r, done.buf), a);
	cr_assert(broker_conn_applied(r, out, 2, &done));
	cr_assert(done.found);
	cr_assert_eq(memcmp(done.token, tok, sizeof(tok)), 0);
	cr_assert(broker_conn_applied(r, out, 3, &done));
	cr_assert(done.found);
	cr_assert_eq(done.status, BB_ERR_INVALID);
	cr_assert_not(broker_conn_applied(r, out, 4, &done), "4 was never applied");
	cr_assert(broker_conn_applied(r, out, 5, &done));
	cr_assert_not(done.found, "a Retain has no result: its answer is the counts");
	cr_assert_not(broker_conn_applied(r, out, 6, &done));

	/* The count the first Alloc gave is there once. */
	broker_info info;
	cr_assert_eq(broker_stat_id(r, out, a, &info, &err), 0, "%s", err.msg);
	cr_assert_eq(info.held, 2);
	cr_assert_eq(info.refs, 3, "two held, one token");
	broker_free(r);
	journal_free(j2);
}

Test(broker_journal, ids_far_ahead_move_the_floor_and_reads_count_as_seen)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	uint64_t a = alloc_host(b, c, 1);
	/* Requests 2..99 change nothing (Stat, Wait ...): seen, in order. */
	for (uint64_t id = 2; id < 100; id++)
		broker_conn_seen(c, id);
	broker_conn_note_request(c, 100);
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);
	uint64_t session = broker_conn_session(c);
	unsigned char secret[BB_TOKEN_SIZE];
	broker_conn_secret(c, secret);
	journal *j2;
	broker *r = rebuilt(j, &j2);
	broker_conn *out;
	uint64_t floor, mask;
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 100);
	cr_assert_eq(mask, 0);
	broker_free(r);
	journal_free(j2);

	/* Without the reads: 300 is more than 64 above the floor (100), which
	 * moves up to 236 rather than refusing it. */
	broker_conn_note_request(c, 300);
	cr_assert_eq(broker_retain(b, c, a, 1, NULL, NULL, &err), 0, "%s", err.msg);
	r = rebuilt(j, &j2);
	cr_assert_eq(broker_session_resume(r, session, secret, sizeof(secret), 1000, &out, &floor,
					   &mask, &err),
		     0, "%s", err.msg);
	cr_assert_eq(floor, 236);
	cr_assert_eq(mask, 1ull << 63);
	broker_free(r);
	journal_free(j2);
	broker_free(b);
	journal_free(j);
}

Test(broker_journal, a_closed_session_takes_its_results_out_of_the_journal)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	alloc_host(b, c, 1);
	alloc_host(b, c, 2);
	journal_state st;
	char why[256];
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_results, 2);
	cr_assert_eq(st.results[1].request, 2);
	journal_state_free(&st);
	broker_conn_close(b, c);
	cr_assert_eq(journal_read(journal_fd(j), &st, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(st.n_results, 0);
	cr_assert_eq(st.n_sessions, 0);
	cr_assert_eq(journal_check(&st, why, sizeof(why)), 0, "%s", why);
	journal_state_free(&st);
	broker_free(b);
	journal_free(j);
}

Test(broker_journal, a_parked_alloc_is_applied_with_its_retry_not_before)
{
	journal *j = new_journal();
	broker *b = broker_with(j);
	broker_error err;
	broker_conn *c = broker_conn_open(b, 1000, 1000, 7, &err);
	broker_alloc_req req = {.size = 4096, .kind = BB_HOST, .import_fd = -1};
	broker_buf *buf;
	grow_next = 1;
	broker_conn_note_request(c, 1);
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), BACKEND_GROW);
	journal_session s = session_of_1000(j);
	cr_assert_eq(s.last_request, 0, "a parked alloc was recorded as applied");
	cr_assert_eq(s.applied_mask, 0);
	/* The retry (handler_retry_allocs) notes it again. */
	broker_conn_note_request(c, 1);
	cr_assert_eq(broker_alloc(b, c, &req, &buf, &err), 0, "%s", err.msg);
	s = session_of_1000(j);
	cr_assert_eq(s.last_request, 1);
	broker_free(b);
	journal_free(j);
}
