/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The state journal (journal.h; the design and the file layout are in
 * docs/RESTART.md, "The journal").
 *
 * The file: page 0 holds the header (written once), the extent table
 * (each entry written once, before any slot of its extent is used) and the
 * two copies of the commit record. Extents follow, page-aligned, each of
 * one slot class: big slots (buffers) or small slots (sessions, holds,
 * tokens). A slot is two copies of its record; a copy is a header (seq,
 * checksum, slot index, type) and the record's bytes.
 *
 * Two layouts: version 2 (written) checksums a copy's header and record
 * only, with a multiply-fold per 16 bytes, and writes a copy in place in
 * the mapping; version 1 (read, and written for tests) checksums the whole
 * fixed-size copy, zero-padded, with a multiply-xor per 8 bytes. The
 * header and extent entries are the same in both.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "journal.h"

#define PAGE 4096u
#define EXTENT_TABLE_OFF 64u
#define COMMIT_OFF 2048u
#define COMMIT_COPY 128u
#define BIG_COPY 512u
#define SMALL_COPY 96u
#define CLASS_BIG 0u
#define CLASS_SMALL 1u

enum {
	T_FREE = 0,
	T_BUFFER = 1,
	T_SESSION = 2,
	T_HOLD = 3,
	T_TOKEN = 4,
	T_RESULT = 5,
	T_COUNT = 6
};

typedef struct jheader {
	uint64_t magic;
	uint32_t version;
	uint32_t big_copy;   /* bytes of one copy of a big slot */
	uint32_t small_copy; /* ... of a small slot */
	uint32_t reserved;
	uint64_t ck; /* over the fields above */
} jheader;

typedef struct jextent {
	uint64_t offset; /* in the file, page-aligned */
	uint32_t cls;    /* CLASS_* */
	uint32_t nslots;
	uint64_t first; /* the class's slot index of its first slot */
	uint64_t ck;    /* over the fields above; 0: no entry */
} jextent;

typedef struct jcommit {
	uint64_t seq; /* the transaction committed; 0: never written */
	uint64_t ck;  /* over what follows, seeded with seq */
	uint64_t next_buffer, next_session;
	uint64_t digest;         /* sum of the checksums of live records' copies */
	uint64_t count[T_COUNT]; /* live records per type (count[T_FREE] unused) */
	uint64_t hold_sum;       /* the sum of every hold's count */
} jcommit;

typedef struct jcopy {
	uint64_t seq; /* the transaction that wrote it; 0: never written */
	uint64_t ck;  /* over what follows (to the copy's end), seeded with seq */
	uint32_t slot;
	uint32_t type; /* T_* */
} jcopy;

_Static_assert(sizeof(jcommit) <= COMMIT_COPY, "commit copy");
_Static_assert(EXTENT_TABLE_OFF + JOURNAL_EXTENTS * sizeof(jextent) <= COMMIT_OFF, "extents");
_Static_assert(sizeof(jcopy) + sizeof(journal_buffer) <= BIG_COPY, "big copy");
_Static_assert(sizeof(jcopy) + sizeof(journal_session) <= SMALL_COPY, "session copy");
_Static_assert(sizeof(jcopy) + sizeof(journal_token) <= SMALL_COPY, "token copy");
_Static_assert(sizeof(jcopy) + sizeof(journal_hold) <= SMALL_COPY, "hold copy");
_Static_assert(sizeof(jcopy) + sizeof(journal_result) <= SMALL_COPY, "result copy");

/* The writer's memory of one slot: the copy written last and what it
 * holds, so that the digest and the counts follow without reading the file
 * back. Every transaction begun is committed, so a copy written by an
 * earlier transaction than the one under way is committed: the next put
 * writes the other copy, and a commit has no slot to visit. */
typedef struct jshadow {
	unsigned char *addr; /* the slot in the mapping */
	uint64_t seq;        /* the transaction that wrote it last; 0: never */
	uint64_t ck;         /* its copy's checksum */
	uint32_t aux;        /* a hold's count in it */
	uint8_t copy;        /* the copy it wrote: 0 or 1 */
	uint8_t type;        /* the type it wrote (T_FREE: none) */
} jshadow;

typedef struct jclass {
	uint32_t copy;   /* bytes of one copy */
	uint32_t nslots; /* slots in all extents of the class */
	uint32_t first_extent_slots;
	jshadow *sh;    /* nslots */
	uint32_t *free; /* free slots, popped from the end */
	uint32_t n_free;
	uint32_t *dropped; /* nslots: slots dropped in this transaction, free after commit */
	uint32_t n_dropped;
} jclass;

struct journal {
	int fd;
	uint32_t version;     /* the layout written: 1 or 2 */
	unsigned char *page0; /* the header page, mapped */
	uint64_t size;        /* the file's size */
	void *ext_base[JOURNAL_EXTENTS];
	size_t ext_len[JOURNAL_EXTENTS];
	uint32_t n_ext;
	jclass cls[2];
	uint64_t seq;       /* the last committed transaction */
	uint8_t commit_cur; /* the commit copy that holds it */
	bool in_txn;
	jcommit next; /* the commit being built: ids, digest, counts (its seq and
		       * checksum set and stored as it is by journal_commit) */
	void (*hook)(void *ctx);
	void *hook_ctx;
};

/* ---- checksums ---------------------------------------------------------- */

static inline uint64_t jmix(uint64_t h)
{
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdull;
	h ^= h >> 33;
	h *= 0xc4ceb9fe1a85ec53ull;
	h ^= h >> 33;
	return h;
}

/* A 64-bit checksum of n bytes (a multiple of 8), seeded; never 0, which
 * marks a copy never written. Order-sensitive: a word moved is a change.
 * Layout 1's copies and commits; the header and extent entries of both. */
static uint64_t jsum(uint64_t seed, const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t h = jmix(seed ^ 0x9e3779b97f4a7c15ull ^ n);
	for (size_t i = 0; i < n; i += 8) {
		uint64_t w;
		memcpy(&w, b + i, 8);
		h = (h ^ w) * 0x9fb21c651e98df25ull;
		h ^= h >> 29;
	}
	h = jmix(h);
	return h ? h : 1;
}

/* 64 x 64 -> 128-bit product, folded to 64 bits. */
static inline uint64_t jfold(uint64_t a, uint64_t b)
{
	unsigned __int128 r = (unsigned __int128)a * b;
	return (uint64_t)r ^ (uint64_t)(r >> 64);
}

/* Layout 2's checksum of the word first followed by n bytes at p (a
 * multiple of 8), seeded; never 0. Each 16 bytes (a, b) fold into the
 * state h as jfold(a ^ h, b ^ rotl(h, 32)): one multiply per 16 bytes,
 * half the instructions of jsum's chain per byte. Every word goes through
 * a multiply with the state, so a word changed or moved changes the sum
 * but with a chance of about 2^-64, as jsum's. The seed and the length
 * start the state through one multiply (odd: a different seed is a
 * different state); no final mix, which, a bijection, would not make two
 * sums that are equal differ. Inlined where n is a constant: the loop
 * unrolls. */
static inline uint64_t jsum2(uint64_t seed, uint64_t first, const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t h = (seed ^ n ^ 0x9e3779b97f4a7c15ull) * 0xff51afd7ed558ccdull;
	uint64_t x, y;
	if (n < 8) {
		h = jfold(first ^ h, h << 32 | h >> 32);
	} else {
		memcpy(&y, b, 8);
		h = jfold(first ^ h, y ^ (h << 32 | h >> 32));
		size_t i = 8;
#pragma GCC unroll 32
		for (; i + 16 <= n; i += 16) {
			memcpy(&x, b + i, 8);
			memcpy(&y, b + i + 8, 8);
			h = jfold(x ^ h, y ^ (h << 32 | h >> 32));
		}
		if (i < n) { /* an odd word last */
			memcpy(&x, b + i, 8);
			h = jfold(x ^ h, h << 32 | h >> 32);
		}
	}
	return h ? h : 1;
}

static uint64_t header_ck(const jheader *h)
{
	return jsum(0, h, offsetof(jheader, ck));
}

static uint64_t extent_ck(const jextent *e)
{
	return jsum(1, e, offsetof(jextent, ck));
}

/* Over what follows seq and ck, seeded with seq. */
static inline uint64_t commit_ck(uint32_t version, const jcommit *c)
{
	if (version == 1)
		return jsum(c->seq, (const unsigned char *)c + 16, sizeof(*c) - 16);
	return jsum2(c->seq, c->next_buffer, &c->next_session,
		     sizeof(*c) - offsetof(jcommit, next_session));
}

/* The bytes of each type's record. */
static const uint32_t rec_size[T_COUNT] = {
	[T_FREE] = 0,
	[T_BUFFER] = sizeof(journal_buffer),
	[T_SESSION] = sizeof(journal_session),
	[T_HOLD] = sizeof(journal_hold),
	[T_TOKEN] = sizeof(journal_token),
	[T_RESULT] = sizeof(journal_result),
};

/* The checksum a copy of copy_size bytes should carry. Layout 1: over the
 * whole copy after seq and ck. Layout 2: over its slot, type and record
 * (the record's size, by its type); 0 (never a checksum) for a type
 * unknown or too big for the copy. */
static uint64_t copy_ck(uint32_t version, const unsigned char *copy, uint32_t copy_size)
{
	jcopy h;
	memcpy(&h, copy, sizeof(h));
	if (version == 1)
		return jsum(h.seq, copy + 16, copy_size - 16);
	if (h.type >= T_COUNT || sizeof(h) + rec_size[h.type] > copy_size)
		return 0;
	uint64_t first;
	memcpy(&first, copy + offsetof(jcopy, slot), 8);
	return jsum2(h.seq, first, copy + sizeof(h), rec_size[h.type]);
}

/* ---- the writer ---------------------------------------------------------- */

/* Every store into the file goes through here, so a test can stop after
 * any of them (journal_set_store_hook). Inlined: a constant n's memcpy is
 * a few moves. */
static inline void jstore(journal *j, void *dst, const void *src, size_t n)
{
	if (!j->hook) {
		memcpy(dst, src, n);
		return;
	}
	unsigned char *d = dst;
	const unsigned char *s = src;
	for (size_t i = 0; i < n; i += 8) {
		size_t k = n - i < 8 ? n - i : 8;
		memcpy(d + i, s + i, k);
		j->hook(j->hook_ctx);
	}
}

/* Stores before this are made before stores after it: a crash stops the
 * writer at an instruction boundary, so the compiler's order is the one
 * that matters (the mapping is shared; no other thread reads it). */
static void jfence(void)
{
	atomic_signal_fence(memory_order_seq_cst);
}

static int set_err(char *err, size_t len, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int set_err(char *err, size_t len, int code, const char *fmt, ...)
{
	if (err && len) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, len, fmt, ap);
		va_end(ap);
	}
	return code;
}

/* Add an extent of the class with at least want slots. */
static int journal__grow(journal *j, uint32_t cls, uint32_t want)
{
	jclass *c = &j->cls[cls];
	if (j->n_ext >= JOURNAL_EXTENTS || c->nslots > UINT32_MAX / 2)
		return BB_ERR_NO_MEMORY;
	uint32_t n = c->nslots > want ? c->nslots : want;
	size_t len = ((size_t)n * 2 * c->copy + PAGE - 1) / PAGE * PAGE;
	n = (uint32_t)(len / (2 * c->copy));
	jshadow *sh = realloc(c->sh, ((size_t)c->nslots + n) * sizeof(*sh));
	if (!sh)
		return BB_ERR_NO_MEMORY;
	c->sh = sh;
	/* Room for every slot: dropped ones come back at commits. */
	uint32_t *fr = realloc(c->free, ((size_t)c->nslots + n) * sizeof(*fr));
	if (!fr)
		return BB_ERR_NO_MEMORY;
	c->free = fr;
	uint32_t *dr = realloc(c->dropped, ((size_t)c->nslots + n) * sizeof(*dr));
	if (!dr)
		return BB_ERR_NO_MEMORY;
	c->dropped = dr;
	if (ftruncate(j->fd, (off_t)(j->size + len)) != 0)
		return BB_ERR_NO_MEMORY;
	void *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, j->fd, (off_t)j->size);
	if (base == MAP_FAILED)
		return BB_ERR_NO_MEMORY; /* the file stays longer: harmless, unnamed */
	jextent e = {.offset = j->size, .cls = cls, .nslots = n, .first = c->nslots};
	e.ck = extent_ck(&e);
	jstore(j, j->page0 + EXTENT_TABLE_OFF + j->n_ext * sizeof(jextent), &e, sizeof(e));
	jfence(); /* the entry before any slot of it */
	j->ext_base[j->n_ext] = base;
	j->ext_len[j->n_ext] = len;
	j->n_ext++;
	j->size += len;
	for (uint32_t i = 0; i < n; i++) {
		jshadow *s = &c->sh[c->nslots + i];
		memset(s, 0, sizeof(*s));
		s->addr = (unsigned char *)base + (size_t)i * 2 * c->copy;
		c->free[c->n_free++] = c->nslots + n - 1 - i; /* lowest popped first */
	}
	c->nslots += n;
	return 0;
}

/* Layout 1's copy (tests only: journal_config.version): built whole,
 * zero-padded, on the stack, then stored. Its checksum. */
static __attribute__((noinline)) uint64_t journal__copy_v1(journal *j, unsigned char *dst,
							   uint32_t copy_size, jcopy *h,
							   const void *rec, size_t rec_len)
{
	unsigned char copy[BIG_COPY];
	memset(copy, 0, copy_size);
	memcpy(copy, h, sizeof(*h));
	if (rec_len)
		memcpy(copy + sizeof(*h), rec, rec_len);
	uint64_t ck = copy_ck(1, copy, copy_size);
	memcpy(copy + 8, &ck, 8);
	jstore(j, dst, copy, copy_size);
	return ck;
}

/* Write a record of type (T_FREE: a drop) with its bytes into *slot's
 * uncommitted copy; a new slot when *slot is JOURNAL_NO_SLOT. Inlined
 * into each put, so that rec_len is a constant there. */
static inline __attribute__((always_inline)) int journal__put(journal *j, uint32_t cls,
							      uint32_t *slot, uint32_t type,
							      const void *rec, size_t rec_len,
							      uint32_t aux)
{
	jclass *c = &j->cls[cls];
	if (*slot == JOURNAL_NO_SLOT) {
		if (!c->n_free) {
			int rc = journal__grow(j, cls, c->first_extent_slots);
			if (rc)
				return rc;
		}
		*slot = c->free[--c->n_free];
	} else if (*slot >= c->nslots) {
		return BB_ERR_INVALID; /* not a slot this journal gave */
	}
	jshadow *s = &c->sh[*slot];
	uint64_t seq = j->seq + 1;
	/* The copy not committed: the other one, unless this transaction
	 * wrote this slot already. */
	uint8_t to = s->seq == seq ? s->copy : 1 - s->copy;
	unsigned char *dst = s->addr + (size_t)to * c->copy;
	jcopy h = {.seq = seq, .slot = *slot, .type = type};
	uint64_t ck;
	if (__builtin_expect(j->version == 1, 0)) {
		ck = journal__copy_v1(j, dst, c->copy, &h, rec, rec_len);
	} else {
		/* In place: the header and the record, nothing after it (the
		 * checksum does not cover it, the reader does not read it). */
		uint64_t first;
		memcpy(&first, &h.slot, 8);
		h.ck = ck = jsum2(h.seq, first, rec, rec_len);
		jstore(j, dst, &h, sizeof(h));
		if (rec_len)
			jstore(j, dst + sizeof(h), rec, rec_len);
	}

	/* The digest and counts, moved from what the slot held to what it holds. */
	if (s->type != T_FREE) {
		j->next.digest -= s->ck;
		j->next.count[s->type]--;
		if (s->type == T_HOLD)
			j->next.hold_sum -= s->aux;
	}
	if (type != T_FREE) {
		j->next.digest += ck;
		j->next.count[type]++;
		if (type == T_HOLD)
			j->next.hold_sum += aux;
	}
	s->seq = seq;
	s->ck = ck;
	s->aux = aux;
	s->copy = to;
	s->type = (uint8_t)type;
	return 0;
}

int journal_create(const journal_config *cfg, journal **out, char *err, size_t len)
{
	uint32_t version = cfg && cfg->version ? cfg->version : JOURNAL_VERSION;
	if (version < JOURNAL_VERSION_OLDEST || version > JOURNAL_VERSION)
		return set_err(err, len, BB_ERR_INVALID, "journal: cannot write version %u",
			       version);
	journal *j = calloc(1, sizeof(*j));
	if (!j)
		return set_err(err, len, BB_ERR_NO_MEMORY, "journal: out of memory");
	j->version = version;
	j->cls[CLASS_BIG].copy = BIG_COPY;
	j->cls[CLASS_SMALL].copy = SMALL_COPY;
	j->cls[CLASS_BIG].first_extent_slots = cfg && cfg->big_slots ? cfg->big_slots : 1024;
	j->cls[CLASS_SMALL].first_extent_slots = cfg && cfg->small_slots ? cfg->small_slots : 4096;
	j->fd = memfd_create("bufbroker-journal", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (j->fd < 0) {
		int e = errno;
		free(j);
		return set_err(err, len, BB_ERR_SYSTEM, "journal: memfd_create: %s", strerror(e));
	}
	if (ftruncate(j->fd, PAGE) != 0 || fcntl(j->fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)
		goto err_sys;
	j->size = PAGE;
	j->page0 = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, j->fd, 0);
	if (j->page0 == MAP_FAILED)
		goto err_sys;
	jheader h = {.magic = JOURNAL_MAGIC,
		     .version = j->version,
		     .big_copy = BIG_COPY,
		     .small_copy = SMALL_COPY};
	h.ck = header_ck(&h);
	memcpy(j->page0, &h, sizeof(h));
	/* Transaction 1: the empty state, ids from 1. */
	j->next.next_buffer = 1;
	j->next.next_session = 1;
	j->in_txn = true;
	journal_commit(j);
	*out = j;
	return 0;
err_sys:;
	int e = errno;
	if (j->page0 && j->page0 != MAP_FAILED)
		munmap(j->page0, PAGE);
	close(j->fd);
	free(j);
	return set_err(err, len, BB_ERR_SYSTEM, "journal: cannot size the memfd: %s", strerror(e));
}

void journal_free(journal *j)
{
	if (!j)
		return;
	for (uint32_t i = 0; i < j->n_ext; i++)
		munmap(j->ext_base[i], j->ext_len[i]);
	munmap(j->page0, PAGE);
	close(j->fd);
	for (int i = 0; i < 2; i++) {
		free(j->cls[i].sh);
		free(j->cls[i].free);
		free(j->cls[i].dropped);
	}
	free(j);
}

int journal_fd(const journal *j)
{
	return j->fd;
}

uint64_t journal_seq(const journal *j)
{
	return j->seq;
}

void journal_set_store_hook(journal *j, void (*fn)(void *ctx), void *ctx)
{
	j->hook = fn;
	j->hook_ctx = ctx;
}

int journal_reserve(journal *j, uint32_t big, uint32_t small)
{
	uint32_t want[2] = {[CLASS_BIG] = big, [CLASS_SMALL] = small};
	for (uint32_t k = CLASS_BIG; k <= CLASS_SMALL; k++) {
		jclass *c = &j->cls[k];
		if (want[k] > c->n_free) {
			int rc = journal__grow(j, k, want[k] - c->n_free);
			if (rc)
				return rc;
		}
	}
	return 0;
}

void journal_begin(journal *j)
{
	j->in_txn = true;
}

int journal_put_buffer(journal *j, uint32_t *slot, const journal_buffer *b)
{
	journal_buffer r;
	memset(&r, 0, sizeof(r)); /* padding too: the checksum reads it */
	r.id = b->id;
	r.size = b->size;
	r.producer = b->producer;
	r.allocation = b->allocation;
	r.offset = b->offset;
	r.allocation_size = b->allocation_size;
	r.kind = b->kind;
	r.device = b->device;
	r.cuda_handle = b->cuda_handle;
	r.state = b->state;
	r.owner_uid = b->owner_uid;
	r.owner_gid = b->owner_gid;
	r.share = b->share;
	r.flags = b->flags;
	/* At most the field's length, the rest zeros (memset above). */
	memcpy(r.name, b->name, strnlen(b->name, BB_NAME_MAX));
	memcpy(r.error, b->error, strnlen(b->error, JOURNAL_ERROR_MAX));
	return journal__put(j, CLASS_BIG, slot, T_BUFFER, &r, sizeof(r), 0);
}

/* A session record has no padding: stored as it is given (every request
 * writes one). */
_Static_assert(sizeof(journal_session) == 4 * 8 + 4 * 4 + BB_TOKEN_SIZE, "session padding");

int journal_put_session(journal *j, uint32_t *slot, const journal_session *s)
{
	return journal__put(j, CLASS_SMALL, slot, T_SESSION, s, sizeof(*s), 0);
}

int journal_put_hold(journal *j, uint32_t *slot, const journal_hold *h)
{
	journal_hold r;
	memset(&r, 0, sizeof(r));
	r.session = h->session;
	r.buffer = h->buffer;
	r.count = h->count;
	return journal__put(j, CLASS_SMALL, slot, T_HOLD, &r, sizeof(r), r.count);
}

int journal_put_token(journal *j, uint32_t *slot, const journal_token *t)
{
	journal_token r;
	memset(&r, 0, sizeof(r));
	memcpy(r.token, t->token, sizeof(r.token));
	r.buffer = t->buffer;
	r.session = t->session;
	r.deadline_ms = t->deadline_ms;
	r.maker_uid = t->maker_uid;
	return journal__put(j, CLASS_SMALL, slot, T_TOKEN, &r, sizeof(r), 0);
}

int journal_put_result(journal *j, uint32_t *slot, const journal_result *res)
{
	journal_result r;
	memset(&r, 0, sizeof(r));
	r.session = res->session;
	r.request = res->request;
	r.buffer = res->buffer;
	r.status = res->status;
	memcpy(r.token, res->token, sizeof(r.token));
	return journal__put(j, CLASS_SMALL, slot, T_RESULT, &r, sizeof(r), 0);
}

void journal_drop(journal *j, uint32_t *slot, bool buffer)
{
	if (*slot == JOURNAL_NO_SLOT)
		return;
	jclass *c = &j->cls[buffer ? CLASS_BIG : CLASS_SMALL];
	if (journal__put(j, buffer ? CLASS_BIG : CLASS_SMALL, slot, T_FREE, NULL, 0, 0))
		return;
	c->dropped[c->n_dropped++] = *slot;
	*slot = JOURNAL_NO_SLOT;
}

void journal_set_ids(journal *j, const journal_ids *ids)
{
	j->next.next_buffer = ids->next_buffer;
	j->next.next_session = ids->next_session;
}

void journal_commit(journal *j)
{
	if (!j->in_txn)
		return;
	jcommit *c = &j->next; /* stored as it is: no copy on the stack */
	c->seq = j->seq + 1;
	c->ck = commit_ck(j->version, c);
	uint8_t to = j->seq ? 1 - j->commit_cur : 0;
	jfence(); /* every record of the transaction before its commit */
	/* The rest of the copy's COMMIT_COPY bytes stays zero. */
	jstore(j, j->page0 + COMMIT_OFF + to * COMMIT_COPY, c, sizeof(*c));
	jfence();
	j->commit_cur = to;
	j->seq = c->seq;
	j->in_txn = false;
	for (int k = 0; k < 2; k++) {
		jclass *cl = &j->cls[k];
		for (uint32_t i = 0; i < cl->n_dropped; i++)
			if (cl->sh[cl->dropped[i]].type == T_FREE) /* not reused since */
				cl->free[cl->n_free++] = cl->dropped[i];
		cl->n_dropped = 0;
	}
}

/* ---- the reader ---------------------------------------------------------- */

typedef struct jvec {
	void *items;
	size_t n, cap, size;
} jvec;

/* Room for n items; a hint: without memory, jvec_push grows as it needs. */
static void jvec_reserve(jvec *v, size_t n)
{
	if (n <= v->cap)
		return;
	void *p = realloc(v->items, n * v->size);
	if (p) {
		v->items = p;
		v->cap = n;
	}
}

static void *jvec_push(jvec *v)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? 2 * v->cap : 64;
		void *p = realloc(v->items, cap * v->size);
		if (!p)
			return NULL;
		v->items = p;
		v->cap = cap;
	}
	return (unsigned char *)v->items + v->n++ * v->size;
}

/* Whether v is in cmp's order already (then it needs no sort: records
 * written in order and slots used in order, as often). */
static bool jvec_sorted(const jvec *v, int (*cmp)(const void *, const void *))
{
	const unsigned char *p = v->items;
	for (size_t i = 1; i < v->n; i++)
		if (cmp(p + (i - 1) * v->size, p + i * v->size) > 0)
			return false;
	return true;
}

static int cmp_u64(uint64_t a, uint64_t b)
{
	return a < b ? -1 : a > b;
}

static int cmp_buffer(const void *a, const void *b)
{
	return cmp_u64(((const journal_buffer *)a)->id, ((const journal_buffer *)b)->id);
}

static int cmp_session(const void *a, const void *b)
{
	return cmp_u64(((const journal_session *)a)->id, ((const journal_session *)b)->id);
}

static int cmp_hold(const void *a, const void *b)
{
	const journal_hold *x = a, *y = b;
	int c = cmp_u64(x->session, y->session);
	return c ? c : cmp_u64(x->buffer, y->buffer);
}

static int cmp_token(const void *a, const void *b)
{
	return memcmp(((const journal_token *)a)->token, ((const journal_token *)b)->token,
		      BB_TOKEN_SIZE);
}

static int cmp_result(const void *a, const void *b)
{
	const journal_result *x = a, *y = b;
	int c = cmp_u64(x->session, y->session);
	return c ? c : cmp_u64(x->request, y->request);
}

/* The committed copy of a slot: the valid one with the highest sequence
 * number not above seq. NULL when neither is (never written, or both
 * unusable: the digest then tells whether a record went missing). */
static const unsigned char *pick_copy(uint32_t version, const unsigned char *slot, uint32_t copy,
				      uint64_t index, uint64_t seq)
{
	/* The candidates by their headers, the higher sequence number first
	 * (copy 0 first on a tie); the first whose checksum holds is the
	 * one, so a slot costs one checksum, not two. */
	const unsigned char *c[2] = {slot, slot + copy};
	uint64_t s[2];
	for (int i = 0; i < 2; i++) {
		jcopy h;
		memcpy(&h, c[i], sizeof(h));
		s[i] = h.seq == 0 || h.seq > seq || h.slot != index ? 0 : h.seq;
	}
	int first = s[1] > s[0] ? 1 : 0;
	for (int k = 0; k < 2; k++) {
		int i = k ? 1 - first : first;
		jcopy h;
		memcpy(&h, c[i], sizeof(h));
		if (s[i] && h.ck && h.ck == copy_ck(version, c[i], copy)) /* 0: never a checksum */
			return c[i];
	}
	return NULL;
}

/* Read the slots of one extent into the state's vectors. */
static int read_extent(uint32_t version, const unsigned char *base, const jextent *e, uint64_t seq,
		       jvec v[T_COUNT], jcommit *seen, char *err, size_t len)
{
	uint32_t copy = e->cls == CLASS_BIG ? BIG_COPY : SMALL_COPY;
	for (uint32_t i = 0; i < e->nslots; i++) {
		const unsigned char *c =
			pick_copy(version, base + (size_t)i * 2 * copy, copy, e->first + i, seq);
		if (!c)
			continue;
		jcopy h;
		memcpy(&h, c, sizeof(h));
		if (h.type == T_FREE)
			continue;
		bool big = h.type == T_BUFFER;
		if (h.type >= T_COUNT || big != (e->cls == CLASS_BIG))
			return set_err(err, len, BB_ERR_PROTOCOL,
				       "journal: slot %llu holds a record of type %u",
				       (unsigned long long)(e->first + i), h.type);
		void *rec = jvec_push(&v[h.type]);
		if (!rec)
			return set_err(err, len, BB_ERR_NO_MEMORY, "journal: out of memory");
		memcpy(rec, c + sizeof(h), v[h.type].size);
		seen->digest += h.ck;
		seen->count[h.type]++;
		if (h.type == T_HOLD)
			seen->hold_sum += ((journal_hold *)rec)->count;
		if (big) {
			journal_buffer *b = rec;
			if (b->name[BB_NAME_MAX] || b->error[JOURNAL_ERROR_MAX])
				return set_err(err, len, BB_ERR_PROTOCOL,
					       "journal: buffer %llu has an unterminated string",
					       (unsigned long long)b->id);
		}
	}
	return 0;
}

int journal_read(int fd, journal_state *out, char *err, size_t len)
{
	memset(out, 0, sizeof(*out));
	struct stat st;
	if (fstat(fd, &st) != 0)
		return set_err(err, len, BB_ERR_SYSTEM, "journal: fstat: %s", strerror(errno));
	if (st.st_size < PAGE)
		return set_err(err, len, BB_ERR_INVALID, "journal: %lld bytes is too short",
			       (long long)st.st_size);
	size_t size = (size_t)st.st_size;
	unsigned char *m = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED)
		return set_err(err, len, BB_ERR_SYSTEM, "journal: mmap: %s", strerror(errno));
	int rc = 0;
	jvec v[T_COUNT] = {{0}};
	v[T_BUFFER].size = sizeof(journal_buffer);
	v[T_SESSION].size = sizeof(journal_session);
	v[T_HOLD].size = sizeof(journal_hold);
	v[T_TOKEN].size = sizeof(journal_token);
	v[T_RESULT].size = sizeof(journal_result);
	v[T_FREE].size = 1;

	jheader h;
	memcpy(&h, m, sizeof(h));
	if (h.magic != JOURNAL_MAGIC || h.ck != header_ck(&h)) {
		rc = set_err(err, len, BB_ERR_INVALID, "journal: not a journal (bad header)");
		goto out;
	}
	if (h.version < JOURNAL_VERSION_OLDEST || h.version > JOURNAL_VERSION ||
	    h.big_copy != BIG_COPY || h.small_copy != SMALL_COPY) {
		rc = set_err(err, len, BB_ERR_INVALID,
			     "journal: version %u (copies of %u and %u bytes) is not one of %u to "
			     "%u (%u and %u)",
			     h.version, h.big_copy, h.small_copy, JOURNAL_VERSION_OLDEST,
			     JOURNAL_VERSION, BIG_COPY, SMALL_COPY);
		goto out;
	}
	jcommit commit = {0};
	for (int i = 0; i < 2; i++) {
		jcommit c;
		memcpy(&c, m + COMMIT_OFF + i * COMMIT_COPY, sizeof(c));
		if (c.seq && c.ck == commit_ck(h.version, &c) && c.seq > commit.seq)
			commit = c;
	}
	if (!commit.seq) {
		rc = set_err(err, len, BB_ERR_PROTOCOL, "journal: no valid commit record");
		goto out;
	}
	/* The commit says how many records of each type to expect: room for
	 * them at once (no more than the file could hold: the counts are
	 * checked against what is found below). */
	for (int t = T_BUFFER; t < T_COUNT; t++)
		if (commit.count[t] <= size / (2 * (t == T_BUFFER ? BIG_COPY : SMALL_COPY)))
			jvec_reserve(&v[t], commit.count[t]);
	jcommit seen = {0};
	uint64_t first[2] = {0, 0};
	for (uint32_t i = 0; i < JOURNAL_EXTENTS; i++) {
		jextent e;
		memcpy(&e, m + EXTENT_TABLE_OFF + i * sizeof(e), sizeof(e));
		/* Entries are written in order, each before its slots are used: the
		 * first invalid one ends the table (a torn last entry has no
		 * records; a corrupted earlier one loses records, which the digest
		 * finds). */
		if (e.ck != extent_ck(&e) || e.cls > CLASS_SMALL || !e.nslots || e.offset % PAGE ||
		    e.first != first[e.cls])
			break;
		size_t bytes = (size_t)e.nslots * 2 * (e.cls == CLASS_BIG ? BIG_COPY : SMALL_COPY);
		if (e.offset < PAGE || e.offset > size || bytes > size - e.offset)
			break;
		first[e.cls] += e.nslots;
		rc = read_extent(h.version, m + e.offset, &e, commit.seq, v, &seen, err, len);
		if (rc)
			goto out;
	}
	bool counts_ok = seen.hold_sum == commit.hold_sum;
	for (int t = T_BUFFER; t < T_COUNT; t++)
		counts_ok = counts_ok && seen.count[t] == commit.count[t];
	if (seen.digest != commit.digest || !counts_ok) {
		rc = set_err(err, len, BB_ERR_PROTOCOL,
			     "journal: the records do not match commit %llu (%llu buffers, %llu "
			     "sessions, %llu holds, %llu tokens found; %llu, %llu, %llu, %llu "
			     "committed): a record is lost or stale",
			     (unsigned long long)commit.seq,
			     (unsigned long long)seen.count[T_BUFFER],
			     (unsigned long long)seen.count[T_SESSION],
			     (unsigned long long)seen.count[T_HOLD],
			     (unsigned long long)seen.count[T_TOKEN],
			     (unsigned long long)commit.count[T_BUFFER],
			     (unsigned long long)commit.count[T_SESSION],
			     (unsigned long long)commit.count[T_HOLD],
			     (unsigned long long)commit.count[T_TOKEN]);
		goto out;
	}
	int (*cmp[T_COUNT])(const void *, const void *) = {
		[T_BUFFER] = cmp_buffer, [T_SESSION] = cmp_session, [T_HOLD] = cmp_hold,
		[T_TOKEN] = cmp_token,   [T_RESULT] = cmp_result,
	};
	for (int t = T_BUFFER; t < T_COUNT; t++)
		if (v[t].n && !jvec_sorted(&v[t], cmp[t])) /* items is NULL when empty, which
							    * qsort may not take */
			qsort(v[t].items, v[t].n, v[t].size, cmp[t]);
	out->seq = commit.seq;
	out->ids.next_buffer = commit.next_buffer;
	out->ids.next_session = commit.next_session;
	out->buffers = v[T_BUFFER].items;
	out->n_buffers = v[T_BUFFER].n;
	out->sessions = v[T_SESSION].items;
	out->n_sessions = v[T_SESSION].n;
	out->holds = v[T_HOLD].items;
	out->n_holds = v[T_HOLD].n;
	out->tokens = v[T_TOKEN].items;
	out->n_tokens = v[T_TOKEN].n;
	out->results = v[T_RESULT].items;
	out->n_results = v[T_RESULT].n;
	munmap(m, size);
	return 0;
out:
	for (int t = 0; t < T_COUNT; t++)
		free(v[t].items);
	munmap(m, size);
	return rc;
}

void journal_state_free(journal_state *s)
{
	free(s->buffers);
	free(s->sessions);
	free(s->holds);
	free(s->tokens);
	free(s->results);
	memset(s, 0, sizeof(*s));
}

/* ---- the checker --------------------------------------------------------- */

typedef struct jreport {
	char *buf;
	size_t len, used;
	int problems;
} jreport;

static void problem(jreport *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void problem(jreport *r, const char *fmt, ...)
{
	r->problems++;
	if (r->used + 2 > r->len)
		return;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(r->buf + r->used, r->len - r->used - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	r->used += (size_t)n < r->len - r->used - 1 ? (size_t)n : r->len - r->used - 2;
	r->buf[r->used++] = '\n';
	r->buf[r->used] = '\0';
}

static const journal_buffer *find_buffer(const journal_state *s, uint64_t id)
{
	journal_buffer key = {.id = id};
	if (!s->n_buffers)
		return NULL; /* buffers may be NULL, which bsearch may not take */
	return bsearch(&key, s->buffers, s->n_buffers, sizeof(key), cmp_buffer);
}

static bool has_session(const journal_state *s, uint64_t id)
{
	journal_session key = {.id = id};
	if (!s->n_sessions)
		return false;
	return bsearch(&key, s->sessions, s->n_sessions, sizeof(key), cmp_session) != NULL;
}

static int cmp_name(const void *a, const void *b)
{
	return strcmp((*(const journal_buffer *const *)a)->name,
		      (*(const journal_buffer *const *)b)->name);
}

int journal_check(const journal_state *s, char *report, size_t len)
{
	jreport r = {.buf = report, .len = len};
	if (len)
		report[0] = '\0';
	/* References per buffer (index in s->buffers), and the named buffers. */
	uint64_t *refs = calloc(s->n_buffers ? s->n_buffers : 1, sizeof(*refs));
	const journal_buffer **named = calloc(s->n_buffers ? s->n_buffers : 1, sizeof(*named));
	if (!refs || !named) {
		free(refs);
		free(named);
		problem(&r, "check: out of memory");
		return r.problems;
	}
	size_t n_named = 0;
	for (size_t i = 0; i < s->n_buffers; i++) {
		const journal_buffer *b = &s->buffers[i];
		if (!b->id || b->id >= s->ids.next_buffer)
			problem(&r, "buffer %llu: id not below the next id %llu (would be reused)",
				(unsigned long long)b->id, (unsigned long long)s->ids.next_buffer);
		if (i && b->id == s->buffers[i - 1].id)
			problem(&r, "buffer %llu: two records", (unsigned long long)b->id);
		if (b->kind != BB_HOST && b->kind != BB_CUDA)
			problem(&r, "buffer %llu: kind %u", (unsigned long long)b->id, b->kind);
		if (b->state > BB_FAILED)
			problem(&r, "buffer %llu: state %u", (unsigned long long)b->id, b->state);
		if (b->share > BB_SHARE_ANY)
			problem(&r, "buffer %llu: share %u", (unsigned long long)b->id, b->share);
		/* The broker counts buffers per handle kind and sizes a VMM
		 * buffer's record by it. */
		if (b->cuda_handle > BB_CUDA_HANDLE_VMM)
			problem(&r, "buffer %llu: CUDA handle kind %u", (unsigned long long)b->id,
				b->cuda_handle);
		if (!b->size)
			problem(&r, "buffer %llu: size 0", (unsigned long long)b->id);
		if (b->cuda_handle == BB_CUDA_HANDLE_VMM && b->allocation &&
		    !(b->flags & JOURNAL_BUF_LOST) &&
		    (b->offset > b->allocation_size || b->size > b->allocation_size - b->offset))
			problem(&r,
				"buffer %llu: bytes %llu-%llu lie outside VMM allocation %llu of "
				"%llu bytes",
				(unsigned long long)b->id, (unsigned long long)b->offset,
				(unsigned long long)(b->offset + b->size),
				(unsigned long long)b->allocation,
				(unsigned long long)b->allocation_size);
		if (b->producer && !has_session(s, b->producer))
			problem(&r, "buffer %llu: producer session %llu is unknown",
				(unsigned long long)b->id, (unsigned long long)b->producer);
		if (b->name[0])
			named[n_named++] = b;
	}
	qsort(named, n_named, sizeof(*named), cmp_name);
	for (size_t i = 1; i < n_named; i++)
		if (!strcmp(named[i]->name, named[i - 1]->name))
			problem(&r, "buffers %llu and %llu: both named \"%s\"",
				(unsigned long long)named[i - 1]->id,
				(unsigned long long)named[i]->id, named[i]->name);
	for (size_t i = 0; i < s->n_sessions; i++) {
		const journal_session *x = &s->sessions[i];
		if (!x->id || x->id >= s->ids.next_session)
			problem(&r, "session %llu: id not below the next id %llu (would be reused)",
				(unsigned long long)x->id, (unsigned long long)s->ids.next_session);
		if (i && x->id == s->sessions[i - 1].id)
			problem(&r, "session %llu: two records", (unsigned long long)x->id);
	}
	/* Holds are sorted by session, then buffer: a session's holds are
	 * looked up once, and its next buffer is most often the buffer after
	 * the last one found. */
	const journal_buffer *last = NULL;
	bool session_known = false;
	for (size_t i = 0; i < s->n_holds; i++) {
		const journal_hold *h = &s->holds[i];
		const journal_buffer *b =
			last && last + 1 < s->buffers + s->n_buffers && last[1].id == h->buffer
				? last + 1
				: find_buffer(s, h->buffer);
		if (!b)
			problem(&r, "hold of session %llu: buffer %llu is unknown",
				(unsigned long long)h->session, (unsigned long long)h->buffer);
		else
			refs[(last = b) - s->buffers] += h->count;
		if (!i || h->session != h[-1].session)
			session_known = has_session(s, h->session);
		if (!session_known)
			problem(&r, "hold on buffer %llu: session %llu is unknown",
				(unsigned long long)h->buffer, (unsigned long long)h->session);
		if (!h->count)
			problem(&r, "hold of session %llu on buffer %llu: count 0",
				(unsigned long long)h->session, (unsigned long long)h->buffer);
		if (i && !cmp_hold(h, h - 1))
			problem(&r, "session %llu: two holds on buffer %llu",
				(unsigned long long)h->session, (unsigned long long)h->buffer);
	}
	for (size_t i = 0; i < s->n_tokens; i++) {
		const journal_token *t = &s->tokens[i];
		const journal_buffer *b = find_buffer(s, t->buffer);
		if (!b)
			problem(&r, "token: buffer %llu is unknown", (unsigned long long)t->buffer);
		else
			refs[b - s->buffers]++;
		if (t->session && !has_session(s, t->session))
			problem(&r, "token on buffer %llu: session %llu is unknown",
				(unsigned long long)t->buffer, (unsigned long long)t->session);
		if (i && !cmp_token(t, t - 1))
			problem(&r, "token on buffer %llu: two records",
				(unsigned long long)t->buffer);
	}
	for (size_t i = 0; i < s->n_results; i++) {
		const journal_result *x = &s->results[i];
		if (!has_session(s, x->session))
			problem(&r, "result of request %llu: session %llu is unknown",
				(unsigned long long)x->request, (unsigned long long)x->session);
		if (!x->request)
			problem(&r, "result of session %llu: request id 0",
				(unsigned long long)x->session);
		/* Sorted by session then request: one result per place of the
		 * ring is one within any 64 consecutive entries of a session. */
		for (size_t k = i; k-- > 0 && s->results[k].session == x->session;)
			if (s->results[k].request % JOURNAL_RESULT_RING ==
			    x->request % JOURNAL_RESULT_RING) {
				problem(&r,
					"session %llu: results of requests %llu and %llu share "
					"a place of the ring",
					(unsigned long long)x->session,
					(unsigned long long)s->results[k].request,
					(unsigned long long)x->request);
				break;
			}
	}
	for (size_t i = 0; i < s->n_buffers; i++)
		if (!refs[i])
			problem(&r, "buffer %llu: no reference (no hold, no token) but not freed",
				(unsigned long long)s->buffers[i].id);
	free(refs);
	free(named);
	return r.problems;
}
