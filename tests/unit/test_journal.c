/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The state journal (daemon/journal.c): a rich state comes back from the
 * memfd as it was written; a crash after any store of a transaction reads
 * as the state before it or, after the commit's last store, the state after
 * it; memory corrupted at random is refused or reads as a committed state,
 * never as wrong counts; the checker refuses inconsistent states.
 *
 * A scripted workload drives the journal the way the broker will (sessions
 * open and close, buffers are allocated, retained, released, taken,
 * adopted, made READY or FAILED) and keeps a model of what it wrote, which
 * is the state a reader must rebuild.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "journal.h"

#define MAXREC 8192      /* records of each type a workload may make */
#define COMMIT_STORES 12 /* 8-byte stores of a commit record (96 bytes) */
/* A copy (layout 2) is its header and its record, nothing after it. */
#define COPY_HEAD_STORES 3 /* ... of a copy's header (seq, checksum, slot, type) */
#define HOLD_STORES 3      /* ... of a hold record (24 bytes) */
#define SESSION_STORES 8   /* ... of a session record (64 bytes) */

typedef struct mbuf {
	journal_buffer r;
	uint32_t slot;
	bool live;
} mbuf;

typedef struct mses {
	journal_session r;
	uint32_t slot;
	bool live;
} mses;

typedef struct mhold {
	journal_hold r;
	uint32_t slot;
	bool live;
} mhold;

typedef struct mtok {
	journal_token r;
	uint32_t slot;
	bool live;
} mtok;

/* What the workload wrote: every record it made, live or dropped. */
typedef struct model {
	journal *j;
	uint64_t rng;
	journal_ids ids;
	mbuf b[MAXREC];
	size_t nb;
	mses s[MAXREC];
	size_t ns;
	mhold h[MAXREC];
	size_t nh;
	mtok t[MAXREC];
	size_t nt;
	uint64_t request; /* the last request id, for sessions' last_request */
} model;

static uint64_t rnd(model *m)
{
	m->rng ^= m->rng << 13;
	m->rng ^= m->rng >> 7;
	m->rng ^= m->rng << 17;
	return m->rng;
}

/* The layout model_new's journals write (0: JOURNAL_VERSION); a test of
 * an older layout sets it first (each test runs in a process of its own). */
static uint32_t layout;

static model *model_new(uint64_t seed, uint32_t big_slots, uint32_t small_slots)
{
	model *m = calloc(1, sizeof(*m));
	cr_assert_not_null(m);
	m->rng = seed ? seed : 1;
	m->ids.next_buffer = 1;
	m->ids.next_session = 1;
	journal_config cfg = {
		.big_slots = big_slots, .small_slots = small_slots, .version = layout};
	char err[256];
	cr_assert_eq(journal_create(&cfg, &m->j, err, sizeof(err)), 0, "%s", err);
	return m;
}

static void model_free(model *m)
{
	journal_free(m->j);
	free(m);
}

/* The index of a random live record among n (live at offset live_off of
 * each of the n items of size sz), or -1 when none is live. */
static long pick(model *m, const void *items, size_t n, size_t sz, size_t live_off)
{
	size_t live = 0;
	for (size_t i = 0; i < n; i++)
		live += *((const bool *)((const char *)items + i * sz + live_off));
	if (!live)
		return -1;
	size_t k = rnd(m) % live;
	for (size_t i = 0; i < n; i++)
		if (*((const bool *)((const char *)items + i * sz + live_off)) && !k--)
			return (long)i;
	return -1;
}

#define PICK(m, arr, n) \
	pick(m, (m)->arr, (m)->n, sizeof((m)->arr[0]), offsetof(__typeof__((m)->arr[0]), live))

static void put_hold(model *m, mhold *h)
{
	cr_assert_eq(journal_put_hold(m->j, &h->slot, &h->r), 0);
}

static void drop(model *m, uint32_t *slot, bool *live, bool buffer)
{
	journal_drop(m->j, slot, buffer);
	cr_assert_eq(*slot, JOURNAL_NO_SLOT);
	*live = false;
}

/* Free buffer bi when no hold and no token names it. */
static void maybe_free(model *m, size_t bi)
{
	uint64_t id = m->b[bi].r.id;
	for (size_t i = 0; i < m->nh; i++)
		if (m->h[i].live && m->h[i].r.buffer == id)
			return;
	for (size_t i = 0; i < m->nt; i++)
		if (m->t[i].live && m->t[i].r.buffer == id)
			return;
	drop(m, &m->b[bi].slot, &m->b[bi].live, true);
}

static size_t buffer_index(model *m, uint64_t id)
{
	for (size_t i = 0; i < m->nb; i++)
		if (m->b[i].r.id == id)
			return i;
	cr_assert_fail("buffer %llu unknown to the model", (unsigned long long)id);
	return 0;
}

static void op_session_open(model *m)
{
	mses *s = &m->s[m->ns++];
	memset(s, 0, sizeof(*s));
	s->slot = JOURNAL_NO_SLOT;
	s->live = true;
	s->r.id = m->ids.next_session++;
	s->r.uid = 1000 + (uint32_t)(rnd(m) % 3);
	s->r.gid = s->r.uid;
	s->r.pid = (uint32_t)(rnd(m) % 100000);
	s->r.minor = 2;
	for (int i = 0; i < BB_TOKEN_SIZE; i++)
		s->r.secret[i] = (unsigned char)rnd(m);
	cr_assert_eq(journal_put_session(m->j, &s->slot, &s->r), 0);
	journal_set_ids(m->j, &m->ids);
}

/* The session made one more state-changing request. */
static void touch_session(model *m, uint64_t sid)
{
	for (size_t i = 0; i < m->ns; i++)
		if (m->s[i].live && m->s[i].r.id == sid) {
			m->s[i].r.last_request = ++m->request;
			m->s[i].r.applied_mask = rnd(m);
			cr_assert_eq(journal_put_session(m->j, &m->s[i].slot, &m->s[i].r), 0);
		}
}

static void op_alloc(model *m)
{
	long si = PICK(m, s, ns);
	if (si < 0)
		return op_session_open(m);
	mbuf *b = &m->b[m->nb++];
	memset(b, 0, sizeof(*b));
	b->slot = JOURNAL_NO_SLOT;
	b->live = true;
	b->r.id = m->ids.next_buffer++;
	b->r.size = 4096 * (1 + rnd(m) % 64);
	b->r.producer = m->s[si].r.id;
	b->r.kind = rnd(m) % 2 ? BB_HOST : BB_CUDA;
	b->r.device = b->r.kind == BB_CUDA ? (int32_t)(rnd(m) % 2) : -1;
	b->r.cuda_handle = b->r.kind == BB_CUDA ? 1 + (uint32_t)(rnd(m) % 2) : 0;
	b->r.allocation = b->r.kind == BB_CUDA ? 1 + rnd(m) % 8 : 0;
	b->r.offset = b->r.kind == BB_CUDA ? 4096 * (rnd(m) % 512) : 0;
	b->r.allocation_size = b->r.kind == BB_CUDA ? 4u << 20 : 0; /* holds any offset + size */
	b->r.state = BB_PENDING;
	b->r.owner_uid = m->s[si].r.uid;
	b->r.owner_gid = m->s[si].r.gid;
	b->r.share = (uint32_t)(rnd(m) % 3);
	if (rnd(m) % 2)
		snprintf(b->r.name, sizeof(b->r.name), "weights/layer-%llu",
			 (unsigned long long)b->r.id);
	cr_assert_eq(journal_put_buffer(m->j, &b->slot, &b->r), 0);
	mhold *h = &m->h[m->nh++];
	memset(h, 0, sizeof(*h));
	h->slot = JOURNAL_NO_SLOT;
	h->live = true;
	h->r.session = m->s[si].r.id;
	h->r.buffer = b->r.id;
	h->r.count = 1;
	put_hold(m, h);
	touch_session(m, h->r.session);
	journal_set_ids(m->j, &m->ids);
}

static void op_retain(model *m)
{
	long hi = PICK(m, h, nh);
	if (hi < 0)
		return;
	m->h[hi].r.count += 1 + (uint32_t)(rnd(m) % 3);
	put_hold(m, &m->h[hi]);
	touch_session(m, m->h[hi].r.session);
}

static void release_at(model *m, size_t hi)
{
	mhold *h = &m->h[hi];
	touch_session(m, h->r.session);
	if (--h->r.count) {
		put_hold(m, h);
		return;
	}
	drop(m, &h->slot, &h->live, false);
	maybe_free(m, buffer_index(m, h->r.buffer));
}

static void op_release(model *m)
{
	long hi = PICK(m, h, nh);
	if (hi >= 0)
		release_at(m, (size_t)hi);
}

static void op_take(model *m)
{
	long hi = PICK(m, h, nh);
	if (hi < 0)
		return;
	mhold *h = &m->h[hi];
	mtok *t = &m->t[m->nt++];
	memset(t, 0, sizeof(*t));
	t->slot = JOURNAL_NO_SLOT;
	t->live = true;
	for (int i = 0; i < BB_TOKEN_SIZE; i++)
		t->r.token[i] = (unsigned char)rnd(m);
	t->r.buffer = h->r.buffer;
	t->r.session = h->r.session;
	t->r.deadline_ms = 1000000 + rnd(m) % 60000;
	t->r.maker_uid = 1000;
	cr_assert_eq(journal_put_token(m->j, &t->slot, &t->r), 0);
	touch_session(m, h->r.session);
	if (--h->r.count)
		put_hold(m, h);
	else
		drop(m, &h->slot, &h->live, false);
}

static void op_adopt(model *m)
{
	long ti = PICK(m, t, nt);
	long si = PICK(m, s, ns);
	if (ti < 0 || si < 0)
		return;
	mtok *t = &m->t[ti];
	uint64_t sid = m->s[si].r.id;
	mhold *h = NULL;
	for (size_t i = 0; i < m->nh; i++)
		if (m->h[i].live && m->h[i].r.session == sid && m->h[i].r.buffer == t->r.buffer)
			h = &m->h[i];
	if (!h) {
		h = &m->h[m->nh++];
		memset(h, 0, sizeof(*h));
		h->slot = JOURNAL_NO_SLOT;
		h->live = true;
		h->r.session = sid;
		h->r.buffer = t->r.buffer;
	}
	h->r.count++;
	put_hold(m, h);
	drop(m, &t->slot, &t->live, false);
	touch_session(m, sid);
}

static void op_expire(model *m)
{
	long ti = PICK(m, t, nt);
	if (ti < 0)
		return;
	drop(m, &m->t[ti].slot, &m->t[ti].live, false);
	maybe_free(m, buffer_index(m, m->t[ti].r.buffer));
}

static void op_set_state(model *m)
{
	long bi = PICK(m, b, nb);
	if (bi < 0 || m->b[bi].r.state != BB_PENDING)
		return;
	mbuf *b = &m->b[bi];
	if (rnd(m) % 3) {
		b->r.state = BB_READY;
	} else {
		b->r.state = BB_FAILED;
		snprintf(b->r.error, sizeof(b->r.error), "loader failed: shard %llu unreadable",
			 (unsigned long long)(rnd(m) % 100));
	}
	cr_assert_eq(journal_put_buffer(m->j, &b->slot, &b->r), 0);
}

/* As a connection's close does: its PENDING buffers fail, its tokens live
 * on without it, its holds go (freeing what nothing else holds). */
static void op_session_close(model *m)
{
	long si = PICK(m, s, ns);
	if (si < 0)
		return;
	uint64_t sid = m->s[si].r.id;
	for (size_t i = 0; i < m->nb; i++) {
		mbuf *b = &m->b[i];
		if (!b->live || b->r.producer != sid)
			continue;
		b->r.producer = 0;
		if (b->r.state == BB_PENDING) {
			b->r.state = BB_FAILED;
			snprintf(b->r.error, sizeof(b->r.error), "producer disconnected");
		}
		cr_assert_eq(journal_put_buffer(m->j, &b->slot, &b->r), 0);
	}
	for (size_t i = 0; i < m->nt; i++)
		if (m->t[i].live && m->t[i].r.session == sid) {
			m->t[i].r.session = 0;
			cr_assert_eq(journal_put_token(m->j, &m->t[i].slot, &m->t[i].r), 0);
		}
	for (size_t i = 0; i < m->nh; i++)
		if (m->h[i].live && m->h[i].r.session == sid) {
			drop(m, &m->h[i].slot, &m->h[i].live, false);
			maybe_free(m, buffer_index(m, m->h[i].r.buffer));
		}
	drop(m, &m->s[si].slot, &m->s[si].live, false);
}

/* One transaction of one to three random operations. */
static void model_step(model *m)
{
	cr_assert_lt(m->nb + 3, MAXREC);
	cr_assert_lt(m->nh + 3, MAXREC);
	cr_assert_lt(m->nt + 3, MAXREC);
	cr_assert_lt(m->ns + 3, MAXREC);
	journal_begin(m->j);
	int ops = 1 + (int)(rnd(m) % 3);
	for (int i = 0; i < ops; i++) {
		switch (rnd(m) % 20) {
		case 0:
		case 1: op_session_open(m); break;
		case 2: op_session_close(m); break;
		case 3:
		case 4:
		case 5:
		case 6: op_alloc(m); break;
		case 7:
		case 8:
		case 9: op_retain(m); break;
		case 10:
		case 11:
		case 12: op_release(m); break;
		case 13:
		case 14: op_take(m); break;
		case 15:
		case 16: op_adopt(m); break;
		case 17: op_expire(m); break;
		default: op_set_state(m); break;
		}
	}
	journal_commit(m->j);
}

/* A model after steps random transactions on a journal whose first extents
 * have big and small slots. */
static model *model_after(uint64_t seed, uint32_t big, uint32_t small, int steps)
{
	model *m = model_new(seed, big, small);
	for (int i = 0; i < steps; i++)
		model_step(m);
	return m;
}

static int cmp_buffer(const void *a, const void *b)
{
	uint64_t x = ((const journal_buffer *)a)->id, y = ((const journal_buffer *)b)->id;
	return x < y ? -1 : x > y;
}

static int cmp_session(const void *a, const void *b)
{
	uint64_t x = ((const journal_session *)a)->id, y = ((const journal_session *)b)->id;
	return x < y ? -1 : x > y;
}

static int cmp_hold(const void *a, const void *b)
{
	const journal_hold *x = a, *y = b;
	if (x->session != y->session)
		return x->session < y->session ? -1 : 1;
	return x->buffer < y->buffer ? -1 : x->buffer > y->buffer;
}

static int cmp_token(const void *a, const void *b)
{
	return memcmp(((const journal_token *)a)->token, ((const journal_token *)b)->token,
		      BB_TOKEN_SIZE);
}

/* The state the model says is committed, as journal_read reports one. */
static void model_state(const model *m, journal_state *out)
{
	memset(out, 0, sizeof(*out));
	out->ids = m->ids;
	out->buffers = calloc(m->nb + 1, sizeof(journal_buffer));
	out->sessions = calloc(m->ns + 1, sizeof(journal_session));
	out->holds = calloc(m->nh + 1, sizeof(journal_hold));
	out->tokens = calloc(m->nt + 1, sizeof(journal_token));
	for (size_t i = 0; i < m->nb; i++)
		if (m->b[i].live)
			out->buffers[out->n_buffers++] = m->b[i].r;
	for (size_t i = 0; i < m->ns; i++)
		if (m->s[i].live)
			out->sessions[out->n_sessions++] = m->s[i].r;
	for (size_t i = 0; i < m->nh; i++)
		if (m->h[i].live)
			out->holds[out->n_holds++] = m->h[i].r;
	for (size_t i = 0; i < m->nt; i++)
		if (m->t[i].live)
			out->tokens[out->n_tokens++] = m->t[i].r;
	qsort(out->buffers, out->n_buffers, sizeof(journal_buffer), cmp_buffer);
	qsort(out->sessions, out->n_sessions, sizeof(journal_session), cmp_session);
	qsort(out->holds, out->n_holds, sizeof(journal_hold), cmp_hold);
	qsort(out->tokens, out->n_tokens, sizeof(journal_token), cmp_token);
}

/* The same records, ids and counts (the model's records are zero-padded
 * as the journal's are, so bytes compare). */
static bool states_equal(const journal_state *a, const journal_state *b)
{
	/* An empty array may be NULL, which memcmp may not take. */
#define SAME(n, arr) (a->n == b->n && (!a->n || !memcmp(a->arr, b->arr, a->n * sizeof(*a->arr))))
	return a->ids.next_buffer == b->ids.next_buffer &&
	       a->ids.next_session == b->ids.next_session && SAME(n_buffers, buffers) &&
	       SAME(n_sessions, sessions) && SAME(n_holds, holds) && SAME(n_tokens, tokens);
#undef SAME
}

/* A file's bytes. */
typedef struct image {
	unsigned char *bytes;
	size_t len;
} image;

static image image_of(int fd)
{
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	image im = {.bytes = malloc((size_t)st.st_size), .len = (size_t)st.st_size};
	cr_assert_not_null(im.bytes);
	cr_assert_eq(pread(fd, im.bytes, im.len, 0), (ssize_t)im.len);
	return im;
}

/* A new memfd holding the image, as the fd store would hand it back. */
static int memfd_of(const image *im)
{
	int fd = memfd_create("journal-image", MFD_CLOEXEC);
	cr_assert_geq(fd, 0);
	cr_assert_eq(pwrite(fd, im->bytes, im->len, 0), (ssize_t)im->len);
	return fd;
}

/* Read an image: the code, and the state when it is 0. */
static int read_image(const image *im, journal_state *out)
{
	int fd = memfd_of(im);
	char err[512];
	int rc = journal_read(fd, out, err, sizeof(err));
	close(fd);
	return rc;
}

static void expect_check_passes(const journal_state *s)
{
	char report[4096];
	int n = journal_check(s, report, sizeof(report));
	cr_assert_eq(n, 0, "the checker refused a committed state:\n%s", report);
}

/* The layout version in a journal file's header. */
static uint32_t file_version(int fd)
{
	uint32_t v = 0;
	cr_assert_eq(pread(fd, &v, sizeof(v), 8), (ssize_t)sizeof(v));
	return v;
}

static void round_trip(void)
{
	/* Small first extents: the file grows many times on the way. */
	model *m = model_after(42, 4, 8, 600);
	journal_state want, got;
	model_state(m, &want);
	cr_assert_gt(want.n_buffers, 5, "the workload should leave buffers");
	cr_assert_gt(want.n_holds, 5);
	cr_assert_gt(want.n_tokens, 0);
	cr_assert_gt(want.n_sessions, 1);
	size_t failed = 0, named = 0;
	for (size_t i = 0; i < want.n_buffers; i++) {
		failed += want.buffers[i].state == BB_FAILED && want.buffers[i].error[0];
		named += want.buffers[i].name[0] != 0;
	}
	cr_assert_gt(failed, 0, "the workload should leave a FAILED buffer with its message");
	cr_assert_gt(named, 0);
	char err[512];
	cr_assert_eq(journal_read(journal_fd(m->j), &got, err, sizeof(err)), 0, "%s", err);
	cr_assert(states_equal(&want, &got), "the state read back differs from the one written");
	cr_assert_eq(got.seq, journal_seq(m->j));
	expect_check_passes(&got);
	cr_assert_eq(file_version(journal_fd(m->j)), layout ? layout : JOURNAL_VERSION);
	journal_state_free(&want);
	journal_state_free(&got);
	model_free(m);
}

Test(journal, round_trip_keeps_a_rich_state)
{
	round_trip();
}

/* A daemon of the build before wrote layout 1 (every copy whole, its
 * checksum over all of it): this one reads it. */
Test(journal, a_layout_1_journal_reads_back_as_written)
{
	layout = 1;
	round_trip();
}

Test(journal, an_empty_journal_reads_as_the_empty_state)
{
	model *m = model_new(1, 0, 0);
	journal_state got;
	char err[512];
	cr_assert_eq(journal_read(journal_fd(m->j), &got, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(got.n_buffers + got.n_sessions + got.n_holds + got.n_tokens, 0);
	cr_assert_eq(got.ids.next_buffer, 1);
	cr_assert_eq(got.ids.next_session, 1);
	journal_state_free(&got);
	model_free(m);
}

/* Copies of the file after every store of a transaction. */
typedef struct snaps {
	int fd;
	image *im;
	size_t n, cap;
} snaps;

static void snap_hook(void *ctx)
{
	snaps *s = ctx;
	if (s->n == s->cap) {
		s->cap = s->cap ? 2 * s->cap : 256;
		s->im = realloc(s->im, s->cap * sizeof(*s->im));
		cr_assert_not_null(s->im);
	}
	s->im[s->n++] = image_of(s->fd);
}

static void snaps_clear(snaps *s)
{
	for (size_t i = 0; i < s->n; i++)
		free(s->im[i].bytes);
	s->n = 0;
}

static void crash_points(void)
{
	model *m = model_after(7, 2, 4, 40); /* tiny extents: growth happens in these steps */
	snaps s = {.fd = journal_fd(m->j)};
	size_t points = 0;
	for (int step = 0; step < 60; step++) {
		journal_state before, after;
		model_state(m, &before);
		journal_set_store_hook(m->j, snap_hook, &s);
		model_step(m);
		journal_set_store_hook(m->j, NULL, NULL);
		model_state(m, &after);
		cr_assert_geq(s.n, COMMIT_STORES);
		bool seen_after = false;
		for (size_t k = 0; k < s.n; k++) {
			journal_state got;
			int rc = read_image(&s.im[k], &got);
			cr_assert_eq(rc, 0, "step %d: a crash after store %zu of %zu is refused",
				     step, k + 1, s.n);
			/* Before the commit's stores (its last COMMIT_STORES) the
			 * state before; during them one or the other, never going
			 * back; after the last the state after. */
			bool is_after = states_equal(&after, &got);
			cr_assert(is_after || states_equal(&before, &got),
				  "step %d: a crash after store %zu of %zu reads as neither the "
				  "state before nor the one after",
				  step, k + 1, s.n);
			cr_assert(!is_after || k + COMMIT_STORES >= s.n,
				  "step %d: store %zu of %zu, before the commit, made the "
				  "transaction visible",
				  step, k + 1, s.n);
			cr_assert(is_after || !seen_after, "step %d: store %zu of %zu went back",
				  step, k + 1, s.n);
			cr_assert(is_after || k + 1 < s.n,
				  "step %d: the committed transaction is not visible", step);
			seen_after = is_after;
			expect_check_passes(&got);
			journal_state_free(&got);
			points++;
		}
		snaps_clear(&s);
		journal_state_free(&before);
		journal_state_free(&after);
	}
	cr_assert_gt(points, 1000, "only %zu crash points", points);
	free(s.im);
	model_free(m);
}

Test(journal, a_crash_after_any_store_reads_as_the_state_before_or_after)
{
	crash_points();
}

Test(journal, a_layout_1_journal_cut_after_any_store_reads_as_before_or_after)
{
	layout = 1;
	crash_points();
}

/* A real crash: a child process writes transactions into the journal
 * (the mapping and the memfd are its parent's, inherited) until it is
 * SIGKILLed at a random moment. The parent reads the memfd: it is never
 * refused, and it is exactly the state after as many transactions as it
 * says it committed (the workload is deterministic, so the parent replays
 * it that far and compares). */
Test(journal, a_writer_killed_at_random_leaves_its_last_committed_state)
{
	uint64_t rng = 4242;
	for (int round = 0; round < 10; round++) {
		uint64_t seed = 1000 + (uint64_t)round;
		model *m = model_new(seed, 4, 8);
		pid_t pid = fork();
		cr_assert_geq(pid, 0);
		if (pid == 0) {
			for (int i = 0; i < 3000; i++)
				model_step(m);
			for (;;)
				pause();
		}
		rng = rng * 6364136223846793005ull + 1442695040888963407ull;
		struct timespec ts = {.tv_nsec = (long)((rng >> 33) % 60000000)};
		nanosleep(&ts, NULL); /* where the kill falls: any point will do */
		cr_assert_eq(kill(pid, SIGKILL), 0);
		int status;
		cr_assert_eq(waitpid(pid, &status, 0), pid);
		cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
			  "round %d: the writer died otherwise (status %#x)", round, status);
		journal_state got;
		char err[512];
		cr_assert_eq(journal_read(journal_fd(m->j), &got, err, sizeof(err)), 0,
			     "round %d: %s", round, err);
		cr_assert_geq(got.seq, 1);
		model *replay = model_after(seed, 4, 8, (int)(got.seq - 1));
		journal_state want;
		model_state(replay, &want);
		cr_assert(states_equal(&want, &got),
			  "round %d: the journal after %llu transactions is not their state", round,
			  (unsigned long long)got.seq - 1);
		expect_check_passes(&got);
		journal_state_free(&want);
		journal_state_free(&got);
		model_free(replay);
		model_free(m);
	}
}

/* The compiler may order the stores within one record copy as it likes
 * (memcpy): a copy torn in any order, and a commit torn in any order, must
 * still read as the state before. */
Test(journal, stores_torn_in_any_order_within_a_step_read_as_the_state_before)
{
	model *m = model_after(99, 4, 8, 100);
	uint64_t rng = 12345;
	for (int step = 0; step < 40; step++) {
		journal_state before, after;
		model_state(m, &before);
		image pre = image_of(journal_fd(m->j));
		model_step(m);
		model_state(m, &after);
		image post = image_of(journal_fd(m->j));
		/* Words that changed, the commit's (page 0 from 2048 on) apart. */
		size_t *rec = malloc(post.len / 8 * sizeof(size_t));
		size_t *com = malloc(post.len / 8 * sizeof(size_t));
		size_t nrec = 0, ncom = 0;
		for (size_t w = 0; w < post.len / 8; w++) {
			bool changed = w * 8 >= pre.len ||
				       memcmp(pre.bytes + w * 8, post.bytes + w * 8, 8);
			if (!changed)
				continue;
			if (w * 8 >= 2048 && w * 8 < 4096)
				com[ncom++] = w;
			else
				rec[nrec++] = w;
		}
		cr_assert_gt(ncom, 0, "a step writes its commit");
		for (int trial = 0; trial < 30; trial++) {
			image im = {.bytes = malloc(post.len), .len = post.len};
			memset(im.bytes, 0, post.len);
			memcpy(im.bytes, pre.bytes, pre.len);
			bool all_commit = trial % 2 == 0;
			for (size_t i = 0; i < nrec; i++) {
				rng = rng * 6364136223846793005ull + 1442695040888963407ull;
				if (all_commit || (rng >> 33) % 2)
					memcpy(im.bytes + rec[i] * 8, post.bytes + rec[i] * 8, 8);
			}
			/* Every record word when all_commit (the fence orders them
			 * before the commit), then a proper subset of the commit's. */
			size_t skip = (size_t)(rng >> 40) % ncom;
			for (size_t i = 0; i < ncom; i++) {
				rng = rng * 6364136223846793005ull + 1442695040888963407ull;
				if (i != skip && (!all_commit || (rng >> 33) % 4))
					memcpy(im.bytes + com[i] * 8, post.bytes + com[i] * 8, 8);
			}
			journal_state got;
			cr_assert_eq(read_image(&im, &got), 0, "step %d trial %d: refused", step,
				     trial);
			cr_assert(states_equal(&before, &got),
				  "step %d trial %d: a torn transaction became visible", step,
				  trial);
			journal_state_free(&got);
			free(im.bytes);
		}
		journal_state got;
		cr_assert_eq(read_image(&post, &got), 0);
		cr_assert(states_equal(&after, &got));
		journal_state_free(&got);
		free(rec);
		free(com);
		free(pre.bytes);
		free(post.bytes);
		journal_state_free(&before);
		journal_state_free(&after);
	}
	model_free(m);
}

static void corruption(void)
{
	model *m = model_after(2024, 4, 8, 300);
	journal_state prev, last;
	model_state(m, &prev);
	model_step(m);
	model_state(m, &last);
	image good = image_of(journal_fd(m->j));
	uint64_t rng = 777;
	int refused = 0, accepted = 0;
	for (int trial = 0; trial < 3000; trial++) {
		image im = {.bytes = malloc(good.len), .len = good.len};
		memcpy(im.bytes, good.bytes, good.len);
		int flips = 1 + trial % 3;
		for (int f = 0; f < flips; f++) {
			rng = rng * 6364136223846793005ull + 1442695040888963407ull;
			size_t at = (size_t)(rng >> 20) % im.len;
			unsigned char x = (unsigned char)(1u << ((rng >> 8) % 8));
			if (trial % 5 == 0)
				x = (unsigned char)(rng >> 12) | 1; /* a random byte value */
			im.bytes[at] ^= x;
		}
		journal_state got;
		int rc = read_image(&im, &got);
		if (rc) {
			cr_assert(rc == BB_ERR_INVALID || rc == BB_ERR_PROTOCOL, "rc %d", rc);
			refused++;
		} else {
			/* A flip in the last commit makes the one before it stand. */
			cr_assert(states_equal(&last, &got) || states_equal(&prev, &got),
				  "trial %d: corruption read as a state never committed", trial);
			expect_check_passes(&got);
			journal_state_free(&got);
			accepted++;
		}
		free(im.bytes);
	}
	/* Both outcomes happen: flips in unused space are harmless, flips in
	 * live records are refused. */
	cr_assert_gt(refused, 100, "refused %d", refused);
	cr_assert_gt(accepted, 100, "accepted %d", accepted);
	free(good.bytes);
	journal_state_free(&prev);
	journal_state_free(&last);
	model_free(m);
}

Test(journal, random_corruption_is_refused_or_reads_as_a_committed_state)
{
	corruption();
}

Test(journal, a_corrupted_layout_1_journal_is_refused_or_reads_as_a_committed_state)
{
	layout = 1;
	corruption();
}

Test(journal, a_lost_live_record_is_refused)
{
	model *m = model_after(5, 4, 8, 50);
	image im = image_of(journal_fd(m->j));
	/* Zero both copies of a live buffer's slot, as though its extent were
	 * never read. The slot is found by its record: a copy (512 bytes, in a
	 * 1 KiB slot, page-aligned extents) of type 1 (a buffer) whose record
	 * starts with the id. */
	long bi = PICK(m, b, nb);
	cr_assert_geq(bi, 0);
	size_t at = 0;
	for (size_t off = 4096; off + 512 <= im.len && !at; off += 512) {
		uint32_t type;
		uint64_t id;
		memcpy(&type, im.bytes + off + 20, 4);
		memcpy(&id, im.bytes + off + 24, 8);
		if (type == 1 && id == m->b[bi].r.id)
			at = off & ~(size_t)1023;
	}
	cr_assert_neq(at, 0, "buffer %llu not found in the file",
		      (unsigned long long)m->b[bi].r.id);
	memset(im.bytes + at, 0, 1024);
	journal_state got;
	cr_assert_eq(read_image(&im, &got), BB_ERR_PROTOCOL);
	free(im.bytes);
	model_free(m);
}

Test(journal, what_is_not_a_journal_is_refused)
{
	image zeros = {.bytes = calloc(1, 8192), .len = 8192};
	journal_state got;
	cr_assert_eq(read_image(&zeros, &got), BB_ERR_INVALID);
	image shorter = {.bytes = zeros.bytes, .len = 100};
	cr_assert_eq(read_image(&shorter, &got), BB_ERR_INVALID);
	free(zeros.bytes);
}

/* A model whose journal holds one session and one buffer it allocated. */
static model *model_with_a_buffer(uint64_t seed)
{
	model *m = model_new(seed, 0, 0);
	journal_begin(m->j);
	op_session_open(m);
	op_alloc(m);
	journal_commit(m->j);
	return m;
}

Test(journal, the_memfd_is_sealed_against_shrinking)
{
	model *m = model_with_a_buffer(3);
	int seals = fcntl(journal_fd(m->j), F_GET_SEALS);
	cr_assert(seals & F_SEAL_SHRINK);
	cr_assert_neq(ftruncate(journal_fd(m->j), 4096), 0);
	model_free(m);
}

static void count_stores(void *ctx)
{
	(*(size_t *)ctx)++;
}

/* The cost RESTART.md states: a retain (one hold and the session's last
 * request id) is two copies, each its header and its record only, and one
 * commit copy, 8-byte stores, no growth; the file does not grow as buffers
 * come and go. */
Test(journal, a_retain_costs_two_record_copies_and_a_commit)
{
	model *m = model_with_a_buffer(11);
	struct stat st0, st1;
	cr_assert_eq(fstat(journal_fd(m->j), &st0), 0);
	size_t stores = 0;
	journal_set_store_hook(m->j, count_stores, &stores);
	journal_begin(m->j);
	op_retain(m);
	journal_commit(m->j);
	journal_set_store_hook(m->j, NULL, NULL);
	cr_assert_eq(stores, 2 * COPY_HEAD_STORES + HOLD_STORES + SESSION_STORES + COMMIT_STORES,
		     "%zu stores", stores);
	size_t nb = m->nb, nh = m->nh;
	for (int i = 0; i < 5000; i++) {
		journal_begin(m->j);
		op_alloc(m);
		journal_commit(m->j);
		cr_assert_eq(m->nh, nh + 1);
		journal_begin(m->j);
		release_at(m, nh); /* the new buffer's only reference: it is freed */
		journal_commit(m->j);
		cr_assert(!m->b[nb].live);
		m->nb = nb; /* the model forgets the dropped records */
		m->nh = nh;
	}
	cr_assert_eq(fstat(journal_fd(m->j), &st1), 0);
	cr_assert_eq(st1.st_size, st0.st_size, "the file grew from %lld to %lld bytes",
		     (long long)st0.st_size, (long long)st1.st_size);
	model_free(m);
}

Test(journal, a_reserve_grows_the_file_once_and_the_puts_fit_in_it)
{
	enum { N = 300 };
	journal *j = NULL;
	char err[512];
	/* Small first extents: without the reserve, the puts would grow the
	 * file many times. */
	journal_config jc = {.big_slots = 4, .small_slots = 8};
	cr_assert_eq(journal_create(&jc, &j, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(journal_reserve(j, N, N + 1), 0);
	struct stat st0, st1;
	cr_assert_eq(fstat(journal_fd(j), &st0), 0);
	journal_begin(j);
	uint32_t slot = JOURNAL_NO_SLOT;
	journal_session ses = {.id = 1, .uid = 1000};
	cr_assert_eq(journal_put_session(j, &slot, &ses), 0);
	for (uint64_t i = 1; i <= N; i++) {
		journal_buffer b = {.id = i,
				    .size = 4096,
				    .kind = BB_HOST,
				    .device = -1,
				    .state = BB_READY,
				    .producer = 1};
		journal_hold h = {.session = 1, .buffer = i, .count = 1};
		slot = JOURNAL_NO_SLOT;
		cr_assert_eq(journal_put_buffer(j, &slot, &b), 0);
		slot = JOURNAL_NO_SLOT;
		cr_assert_eq(journal_put_hold(j, &slot, &h), 0);
	}
	journal_set_ids(j, &(journal_ids){.next_buffer = N + 1, .next_session = 2});
	journal_commit(j);
	cr_assert_eq(fstat(journal_fd(j), &st1), 0);
	cr_assert_eq(st1.st_size, st0.st_size, "the file grew from %lld to %lld bytes",
		     (long long)st0.st_size, (long long)st1.st_size);
	journal_state got;
	cr_assert_eq(journal_read(journal_fd(j), &got, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(got.n_buffers, N);
	cr_assert_eq(got.n_holds, N);
	cr_assert_eq(got.n_sessions, 1);
	for (size_t i = 0; i < N; i++)
		cr_assert_eq(got.buffers[i].id, i + 1, "read in id order");
	expect_check_passes(&got);
	journal_state_free(&got);
	journal_free(j);
}

/* A state with one of everything, consistent. */
static journal_buffer c_buf[2] = {
	{.id = 1, .size = 4096, .kind = BB_HOST, .device = -1, .state = BB_READY, .producer = 1},
	{.id = 2, .size = 8192, .kind = BB_CUDA, .state = BB_PENDING, .producer = 1},
};
static journal_session c_ses[1] = {{.id = 1, .uid = 1000}};
static journal_hold c_hold[1] = {{.session = 1, .buffer = 1, .count = 2}};
static journal_token c_tok[1] = {{.token = {1}, .buffer = 2, .session = 1}};

static journal_state consistent(journal_buffer *b, journal_session *s, journal_hold *h,
				journal_token *t)
{
	memcpy(b, c_buf, sizeof(c_buf));
	memcpy(s, c_ses, sizeof(c_ses));
	memcpy(h, c_hold, sizeof(c_hold));
	memcpy(t, c_tok, sizeof(c_tok));
	journal_state st = {.ids = {.next_buffer = 3, .next_session = 2},
			    .buffers = b,
			    .n_buffers = 2,
			    .sessions = s,
			    .n_sessions = 1,
			    .holds = h,
			    .n_holds = 1,
			    .tokens = t,
			    .n_tokens = 1};
	return st;
}

static void expect_refused(const journal_state *st, const char *what)
{
	char report[1024];
	cr_assert_gt(journal_check(st, report, sizeof(report)), 0, "not refused: %s", what);
	cr_assert_not_null(strstr(report, what), "report \"%s\" lacks \"%s\"", report, what);
}

Test(journal, the_checker_refuses_inconsistent_states)
{
	journal_buffer b[2];
	journal_session s[1];
	journal_hold h[1];
	journal_token t[1];
	journal_state st = consistent(b, s, h, t);
	expect_check_passes(&st);

	/* One break of the consistent state per case, and what the report says. */
	static const char *const want[] = {
		"buffer 9 is unknown",
		"session 5 is unknown",
		"count 0",
		"token: buffer 7 is unknown",
		"would be reused", /* a buffer id */
		"would be reused", /* a session id */
		"buffer 2: no reference",
		"both named \"kv\"",
		"producer session 4 is unknown",
		"state 7",
		"two records",
		"lie outside VMM allocation 5", /* the allocation's size is kept */
		"CUDA handle kind 258",
	};
	for (size_t c = 0; c < sizeof(want) / sizeof(want[0]); c++) {
		st = consistent(b, s, h, t);
		switch (c) {
		case 0: h[0].buffer = 9; break;
		case 1: h[0].session = 5; break;
		case 2: h[0].count = 0; break;
		case 3: t[0].buffer = 7; break;
		case 4: st.ids.next_buffer = 2; break;
		case 5: st.ids.next_session = 1; break;
		case 6: st.n_tokens = 0; break; /* buffer 2's only reference */
		case 7: strcpy(b[0].name, "kv"), strcpy(b[1].name, "kv"); break;
		case 8: b[1].producer = 4; break;
		case 9: b[0].state = 7; break;
		case 10: b[1].id = 1; break;
		case 12: b[0].cuda_handle = 258; break; /* 2, VMM, in a byte */
		default:
			b[0].kind = BB_CUDA;
			b[0].device = 0;
			b[0].cuda_handle = BB_CUDA_HANDLE_VMM;
			b[0].allocation = 5;
			b[0].allocation_size = 2u << 20;
			b[0].offset = (2u << 20) - 256; /* its size runs past the end */
			break;
		}
		expect_refused(&st, want[c]);
	}
}

/* A journal whose records break an invariant (as a writer bug would make
 * one) reads, and the checker refuses it. */
Test(journal, a_journal_with_an_inconsistent_state_is_refused_by_the_checker)
{
	model *m = model_new(4, 0, 0);
	journal_begin(m->j);
	journal_hold h = {.session = 3, .buffer = 8, .count = 1};
	uint32_t slot = JOURNAL_NO_SLOT;
	cr_assert_eq(journal_put_hold(m->j, &slot, &h), 0);
	journal_commit(m->j);
	journal_state got;
	char err[512];
	cr_assert_eq(journal_read(journal_fd(m->j), &got, err, sizeof(err)), 0, "%s", err);
	char report[1024];
	cr_assert_gt(journal_check(&got, report, sizeof(report)), 0);
	cr_assert_not_null(strstr(report, "buffer 8 is unknown"), "%s", report);
	journal_state_free(&got);
	model_free(m);
}

/* The result ring's records (docs/RESTART.md, "Exactly once"): they read
 * back as written, a dropped one is gone, the digest and counts cover them
 * (a lost result is refused), and the checker refuses a result of an
 * unknown session or two results in one place of a session's ring. */
Test(journal, results_round_trip_and_are_checked)
{
	journal *j;
	char err[256];
	journal_config cfg = {.big_slots = 4, .small_slots = 8};
	cr_assert_eq(journal_create(&cfg, &j, err, sizeof(err)), 0, "%s", err);
	journal_session ses = {.id = 1, .uid = 1000};
	uint32_t sslot = JOURNAL_NO_SLOT, rslot[20];
	journal_begin(j);
	cr_assert_eq(journal_put_session(j, &sslot, &ses), 0);
	for (int i = 0; i < 20; i++) {
		journal_result r = {.session = 1, .request = (uint64_t)i + 1, .buffer = 100 + i};
		if (i == 3)
			r.status = BB_ERR_NOT_FOUND;
		memset(r.token, i, sizeof(r.token));
		rslot[i] = JOURNAL_NO_SLOT;
		cr_assert_eq(journal_put_result(j, &rslot[i], &r), 0); /* the file grows */
	}
	journal_ids ids = {.next_buffer = 1, .next_session = 2};
	journal_set_ids(j, &ids);
	journal_commit(j);
	journal_begin(j);
	journal_drop(j, &rslot[7], false);
	journal_commit(j);

	journal_state st;
	cr_assert_eq(journal_read(journal_fd(j), &st, err, sizeof(err)), 0, "%s", err);
	cr_assert_eq(st.n_results, 19);
	for (size_t i = 0; i < st.n_results; i++) {
		const journal_result *r = &st.results[i];
		uint64_t want = i < 7 ? i + 1 : i + 2; /* 8 was dropped */
		cr_assert_eq(r->request, want);
		cr_assert_eq(r->session, 1);
		cr_assert_eq(r->buffer, 99 + want);
		cr_assert_eq(r->status, want == 4 ? BB_ERR_NOT_FOUND : 0);
		cr_assert_eq(r->token[0], (unsigned char)(want - 1));
	}
	expect_check_passes(&st);

	st.results[5].session = 2;
	expect_refused(&st, "session 2 is unknown");
	st.results[5].session = 1;
	st.results[6].request = st.results[5].request + JOURNAL_RESULT_RING;
	expect_refused(&st, "share a place of the ring");
	journal_state_free(&st);

	/* A result's committed copy zeroed: lost, and refused. */
	int fd = journal_fd(j);
	struct stat sb;
	cr_assert_eq(fstat(fd, &sb), 0);
	unsigned char *mem =
		mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert_neq(mem, MAP_FAILED);
	size_t lost = 0;
	for (size_t off = 4096; off + 96 <= (size_t)sb.st_size && !lost; off += 96) {
		uint32_t type;
		memcpy(&type, mem + off + 20, sizeof(type));
		if (type == 5)
			lost = off;
	}
	cr_assert_neq(lost, 0, "no result record in the file");
	memset(mem + lost, 0, 96);
	munmap(mem, (size_t)sb.st_size);
	cr_assert_eq(journal_read(fd, &st, err, sizeof(err)), BB_ERR_PROTOCOL, "%s", err);
	journal_free(j);
}
