/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A torn or corrupted state journal at a restart (issue 14, docs/RESTART.md
 * "Tests"): each round a client makes buffers and counts (alloc, retain,
 * release, take) and keeps its own books, a snapshot of every count after
 * each request; then the test takes the stored journal from the systemd
 * stand-in, damages it, and SIGKILLs the daemon. The new daemon either
 * rebuilds a state the client made (the counts of one of its snapshots:
 * the last, or the one before when the last commit was torn) or refuses
 * the journal and starts empty (log line restart_refused, no buffer); it
 * never serves counts the client did not make, and `bufbroker check`
 * always passes.
 *
 * Damage, in turn: (a) 1 to 3 bytes of the committed copy of a live
 * record: refused (the digest no longer adds up); (b) a torn commit,
 * random bytes over part of the newest commit copy: the commit before
 * stands, rebuilt; (c) 1 to 3 random bytes anywhere in the journal's used
 * part (page 0 and every slot ever written): either. Layout: RESTART.md,
 * "The journal".
 * Rounds: $BBT_TORN_ROUNDS (12).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../../daemon/journal.h"
#include "harness.h"

TestSuite(restart_torn, .fini = bbt_cleanup, .timeout = 600);

#define OPS 12    /* requests per round */
#define NBUF 8    /* the most buffers a round makes */
#define PAGE 4096 /* the journal's page 0 */
#define EXTENT_TABLE_OFF 64
#define EXTENTS 32
#define COMMIT_OFF 2048
#define COMMIT_COPY 128
#define COMMIT_CHECKED 96 /* the commit's fields (protocol 1.3: 12 words); the rest is padding */
#define BIG_COPY 512
#define SMALL_COPY 96

static uint32_t g_rnd;

static uint32_t rnd(void)
{
	g_rnd ^= g_rnd << 13;
	g_rnd ^= g_rnd >> 17;
	g_rnd ^= g_rnd << 5;
	return g_rnd;
}

/* ---- the journal's layout ---------------------------------------------------- */

typedef struct jext {
	uint64_t offset;
	uint32_t cls; /* 0 big, 1 small */
	uint32_t nslots;
	uint64_t first;
	uint64_t ck;
} jext;

/* A written copy: where, and its seq. */
typedef struct jcopy {
	size_t off, len;
	size_t slot; /* the offset of its slot (two copies side by side) */
	uint64_t seq;
	uint32_t type; /* 0: a dropped record */
} jcopy;

/* Every copy ever written in the journal at p (len bytes): its number;
 * copies[] gets them. commit_seq: the newest commit's seq, *newest_commit
 * its offset. */
static size_t journal_copies(const uint8_t *p, size_t len, jcopy *copies, size_t cap,
			     uint64_t *commit_seq, size_t *newest_commit)
{
	uint64_t s0, s1;
	memcpy(&s0, p + COMMIT_OFF, 8);
	memcpy(&s1, p + COMMIT_OFF + COMMIT_COPY, 8);
	*commit_seq = s0 > s1 ? s0 : s1;
	*newest_commit = COMMIT_OFF + (s0 > s1 ? 0 : COMMIT_COPY);
	size_t n = 0;
	for (int e = 0; e < EXTENTS; e++) {
		jext x;
		memcpy(&x, p + EXTENT_TABLE_OFF + e * sizeof(jext), sizeof(x));
		if (!x.offset || x.cls > 1)
			break;
		size_t copy = x.cls ? SMALL_COPY : BIG_COPY;
		for (uint32_t s = 0; s < x.nslots; s++)
			for (int k = 0; k < 2; k++) {
				size_t off = x.offset + ((size_t)s * 2 + (size_t)k) * copy;
				uint64_t seq;
				uint32_t type;
				if (off + copy > len)
					break;
				memcpy(&seq, p + off, 8);
				memcpy(&type, p + off + 20, 4);
				if (seq && n < cap)
					copies[n++] =
						(jcopy){.off = off,
							.len = copy,
							.slot = x.offset + (size_t)s * 2 * copy,
							.seq = seq,
							.type = type};
			}
	}
	return n;
}

/* A committed copy of a live record (type not 0): per slot, the copy with
 * the highest seq not above the commit's. */
static bool pick_committed(const jcopy *c, size_t n, uint64_t commit_seq, jcopy *out)
{
	size_t count = 0;
	jcopy *cands = calloc(n ? n : 1, sizeof(*cands));
	cr_assert(cands);
	for (size_t i = 0; i < n; i++) {
		if (c[i].seq > commit_seq || c[i].type == 0)
			continue;
		bool newer_twin = false;
		for (size_t j = 0; j < n; j++)
			if (j != i && c[j].slot == c[i].slot && c[j].seq > c[i].seq &&
			    c[j].seq <= commit_seq)
				newer_twin = true;
		if (!newer_twin)
			cands[count++] = c[i];
	}
	bool ok = count > 0;
	if (ok)
		*out = cands[rnd() % count];
	free(cands);
	return ok;
}

/* The bytes of a copy of type `type` the reader checks (layout 2,
 * RESTART.md "Layout"): the copy's header (seq, checksum, slot, type) and
 * the record, by its type (journal.c's T_BUFFER .. T_RESULT, 1 to 5); the
 * rest of the copy is never read. */
static size_t checked_len(uint32_t type)
{
	static const size_t rec[] = {0,
				     sizeof(journal_buffer),
				     sizeof(journal_session),
				     sizeof(journal_hold),
				     sizeof(journal_token),
				     sizeof(journal_result)};
	cr_assert(type < sizeof(rec) / sizeof(rec[0]), "a copy of type %u", type);
	return 24 + rec[type];
}

static void flip_bytes(uint8_t *p, size_t off, size_t len)
{
	int n = 1 + (int)(rnd() % 3);
	for (int i = 0; i < n; i++)
		p[off + rnd() % len] ^= (uint8_t)(1 + rnd() % 255);
}

enum { DAMAGE_RECORD, DAMAGE_COMMIT, DAMAGE_ANY, DAMAGE_KINDS };
static const char *const damage_name[] = {"a committed record", "the newest commit (torn)",
					  "anywhere used"};

/* Damage the stored journal as kind says. */
static void damage_journal(bbt_daemon *d, int kind)
{
	int fd = bbt_sd_journal_fd(d);
	cr_assert(fd >= 0, "no journal in the store (%d)", fd);
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	size_t len = (size_t)st.st_size;
	uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	cr_assert(p != MAP_FAILED, "mmap the journal: %s", strerror(errno));
	close(fd);

	size_t cap = 1 << 20;
	jcopy *copies = calloc(cap, sizeof(*copies));
	uint64_t commit_seq;
	size_t newest;
	size_t nc = journal_copies(p, len, copies, cap, &commit_seq, &newest);
	cr_assert(nc > 0 && commit_seq > 0, "the journal has no record");
	jcopy c;
	switch (kind) {
	case DAMAGE_RECORD:
		cr_assert(pick_committed(copies, nc, commit_seq, &c));
		flip_bytes(p, c.off, checked_len(c.type));
		break;
	case DAMAGE_COMMIT: {
		size_t a = rnd() % COMMIT_CHECKED, b = a + 1 + rnd() % (COMMIT_CHECKED - a);
		for (size_t i = a; i < b; i++)
			p[newest + i] = (uint8_t)rnd();
		p[newest + a] ^= 0x5a; /* at least one byte changed */
		break;
	}
	default: {
		/* Page 0 counts as one more region, as large as the rest. */
		size_t pick = rnd() % (nc + 1);
		if (pick == nc)
			flip_bytes(p, 0, PAGE);
		else
			flip_bytes(p, copies[pick].off, copies[pick].len);
	}
	}
	free(copies);
	munmap(p, len);
}

/* ---- the client's books ------------------------------------------------------ */

static const void *g_kept[1024];

static void keep(const void *p)
{
	for (size_t i = 0; i < sizeof(g_kept) / sizeof(g_kept[0]); i++)
		if (!g_kept[i]) {
			g_kept[i] = p;
			return;
		}
}

typedef struct books {
	uint64_t id[NBUF];
	int nid;
	/* snap[k][i]: buffer i's count after request k (0: not made yet or gone) */
	uint64_t snap[OPS + 1][NBUF];
	int nsnap;
} books;

static void snapshot(books *bk, const uint64_t *now)
{
	memcpy(bk->snap[bk->nsnap++], now, sizeof(bk->snap[0]));
}

/* One round's requests, each answered; the books after each. */
static void make_state(bb_client *c, books *bk)
{
	bb_buf *b[NBUF] = {0};
	uint64_t refs[NBUF] = {0}, retained[NBUF] = {0};
	memset(bk, 0, sizeof(*bk));
	snapshot(bk, refs);
	for (int op = 0; op < OPS; op++) {
		int i = bk->nid ? (int)(rnd() % (uint32_t)bk->nid) : 0;
		uint32_t what = bk->nid == 0 ? 0 : rnd() % 5;
		int rc = 0;
		if (what == 0 && bk->nid < NBUF) {
			bb_alloc_opts o = {.size = 4096, .kind = BB_HOST};
			i = bk->nid;
			rc = bb_alloc(c, &o, &b[i]);
			cr_assert_eq(rc, 0, "bb_alloc: %s", bb_last_error());
			bk->id[bk->nid++] = bb_id(b[i]);
			refs[i] = 1;
		} else if (what <= 1) {
			uint32_t k = 1 + rnd() % 3;
			rc = bb_retain(c, bk->id[i], k);
			refs[i] += k, retained[i] += k;
		} else if (what == 2 && retained[i]) {
			uint32_t k = 1 + (uint32_t)(rnd() % retained[i]);
			rc = bb_release(c, bk->id[i], k);
			refs[i] -= k, retained[i] -= k;
		} else if (what == 3) {
			/* A token that nobody adopts holds a count of its own. */
			bb_token t;
			bb_ref(b[i]);
			rc = bb_take(b[i], &t);
			refs[i] += 1;
		} else {
			rc = bb_set_ready(b[i]);
			if (rc == BB_ERR_STATE)
				rc = 0; /* READY already: no change */
		}
		cr_assert_eq(rc, 0, "request %d (%u) on %llu: %s", op, what,
			     (unsigned long long)bk->id[i], bb_last_error());
		snapshot(bk, refs);
	}
	/* Every request was answered, so committed: the daemon agrees. */
	for (int k = 0; k < bk->nid; k++)
		cr_assert_eq(bbt_refs(c, bk->id[k]), (int64_t)refs[k], "before the crash: %llu",
			     (unsigned long long)bk->id[k]);
	/* The handles stay with the dead connection's session: never freed,
	 * kept reachable (valgrind). */
	for (int k = 0; k < bk->nid; k++)
		keep(b[k]);
}

/* The snapshot the daemon's counts equal, or -1. */
static int matching_snapshot(bb_client *c, const books *bk)
{
	uint64_t now[NBUF] = {0};
	for (int k = 0; k < bk->nid; k++) {
		int64_t r = bbt_refs(c, bk->id[k]);
		cr_assert(r >= 0 || r == BB_ERR_NOT_FOUND, "bb_stat %llu: %lld",
			  (unsigned long long)bk->id[k], (long long)r);
		now[k] = r > 0 ? (uint64_t)r : 0;
	}
	for (int s = bk->nsnap - 1; s >= 0; s--)
		if (!memcmp(now, bk->snap[s], sizeof(now)))
			return s;
	for (int k = 0; k < bk->nid; k++)
		fprintf(stderr, "buffer %llu: refs %llu, the client's last %llu\n",
			(unsigned long long)bk->id[k], (unsigned long long)now[k],
			(unsigned long long)bk->snap[bk->nsnap - 1][k]);
	return -1;
}

Test(restart_torn, a_damaged_journal_is_refused_or_yields_a_state_the_clients_made)
{
	int rounds = 12;
	const char *e = getenv("BBT_TORN_ROUNDS");
	if (e && atoi(e) > 0)
		rounds = atoi(e);
	bbt_daemon *d = bbt_start_sd(NULL);
	int jfd = bbt_sd_journal_fd(d);
	cr_assert(jfd >= 0, "bbt_sd_journal_fd: %d", jfd);
	close(jfd);
	bb_client *k;
	g_rnd = (uint32_t)bbt_now_ms() | 1;
	fprintf(stderr, "torn: seed %u\n", g_rnd);

	int refused = 0, rebuilt = 0;
	for (int round = 0; round < rounds; round++) {
		int kind = round % DAMAGE_KINDS;
		bb_client *c = bbt_connect(d);
		/* Its session stays as the crash left it. */
		bb_reconnect_opts off = {.enabled = 0};
		cr_assert_eq(bb_client_set_reconnect(c, &off), 0);
		books bk;
		make_state(c, &bk);
		damage_journal(d, kind);
		size_t from = bbt_log_size(d);
		bbt_sd_crash(d);
		keep(c);

		k = bbt_connect(d);
		const char *needle[] = {"restart_refused", NULL};
		bbt_totals tot;
		cr_assert_eq(bbt_server_totals(k, &tot), 0);
		if (bbt_log_wait_line(d, from, 0, needle)) {
			refused++;
			cr_assert_eq(tot.buffers, 0, "refused, yet %llu buffers are served",
				     (unsigned long long)tot.buffers);
			cr_assert_eq(tot.tokens, 0);
			cr_assert_neq(kind, DAMAGE_COMMIT, "a torn commit must not be refused");
		} else {
			rebuilt++;
			int s = matching_snapshot(k, &bk);
			cr_assert(s >= 0, "round %d (damage: %s): counts the client never had",
				  round, damage_name[kind]);
			if (kind == DAMAGE_COMMIT)
				cr_assert_geq(s, bk.nsnap - 2,
					      "a torn commit goes back one request at most");
			cr_assert_neq(kind, DAMAGE_RECORD,
				      "a damaged committed record was not refused (snapshot %d)",
				      s);
		}
		cr_assert_eq(bbt_check_problems(k), 0, "bufbroker check after round %d", round);
		bb_disconnect(k);
	}
	fprintf(stderr, "torn: %d rounds, %d refused, %d rebuilt\n", rounds, refused, rebuilt);
	bbt_stop_clean(d);
}
