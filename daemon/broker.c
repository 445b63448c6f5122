/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The broker's state machine: buffers, reference tables, tokens, states and
 * limits. Pure: the only calls out are to the backends' vtables and to the
 * configured clock and random source. See broker.h for the rules.
 */
#include "size.h"
#include "broker.h"
#include "idmap.h"
#include "journal.h"
#include "utf8.h"
#include "wire.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <uthash.h>
#include <utlist.h>

/* Per-uid usage, for the quotas. */
typedef struct uid_usage {
	uint32_t uid;
	uint64_t bytes[BROKER_KINDS]; /* bytes of buffers this uid owns, per kind */
	uint64_t buffers;             /* live buffers this uid owns */
	UT_hash_handle hh;
} uid_usage;

/* Live tokens one uid made, for the per-uid token limit: tokens outlive
 * their connection, so the per-connection limit alone would not bound
 * them. Present only while tokens > 0. */
typedef struct uid_tokens {
	uint32_t uid;      /* key: the maker's uid */
	uint64_t tokens;   /* its live tokens, its closed connections' included */
	UT_hash_handle hh; /* in broker.uid_tokens */
} uid_tokens;

/* A live buffer's name. Only named buffers have one, so an unnamed buffer
 * pays a pointer for the name index rather than a 56-byte handle. */
typedef struct buf_name {
	broker_buf *buf;   /* the buffer it names */
	UT_hash_handle hh; /* in broker.by_name, keyed by text */
	char text[];       /* NUL-terminated, at most BB_NAME_MAX bytes */
} buf_name;

/* A live, unadopted token: one reference waiting for its adopter. */
typedef struct token {
	unsigned char bytes[BB_TOKEN_SIZE]; /* key: 128 random bits */
	broker_buf *buf;                    /* the buffer it references */
	broker_conn *maker;                 /* NULL once the maker closed */
	uint32_t maker_uid;                 /* whose uid_tokens count it is in */
	uint64_t expires_ms;                /* when the reference is released */
	struct token *prev, *next;          /* broker's FIFO, oldest first */
	struct token *mprev, *mnext;        /* maker's list */
	UT_hash_handle hh;                  /* in broker.tokens */
	uint32_t jslot;                     /* its journal record's slot */
} token;

/* The daemon keeps one per live buffer, tens of thousands at a time, so
 * every byte counts: what only some buffers have (a name, a failure
 * message) lives behind a pointer, the tables that find a buffer keep it
 * in flat slots (idmap.h) rather than in handles inside it, and the fields
 * are ordered and narrowed so that it fits a 144-byte chunk of glibc's
 * malloc. */
struct broker_buf {
	uint64_t id;               /* never reused; first, as idmap requires */
	uint64_t size;             /* bytes */
	uint64_t refs;             /* sum of connection counts + live tokens */
	uint64_t created_ms;       /* clock at creation */
	backend *be;               /* the backend holding mem */
	backend_mem mem;           /* the memory */
	buf_name *name;            /* NULL, or its entry in broker.by_name */
	char *error;               /* NULL, or SetError's message once FAILED */
	broker_conn *producer;     /* allocating connection while PENDING */
	broker_buf *pprev, *pnext; /* producer's list of PENDING buffers */
	broker_waiter *waiters;    /* parked waits */
	uint32_t owner_uid;        /* the allocating connection's uid */
	uint32_t owner_gid;        /* ... and gid */
	uint32_t tokens;           /* live tokens */
	int16_t device;            /* CUDA ordinal (the backend checked it); 0 for host */
	uint8_t flags;             /* BUF_* */
	uint8_t kind;              /* bb_kind: BB_HOST or BB_CUDA */
	uint8_t state;             /* bb_state: PENDING until SetReady/SetError */
	uint8_t share;             /* BB_SHARE_* */
	uint8_t cuda_handle;       /* bb_cuda_handle: LEGACY or VMM; 0 for host */
	uint32_t jslot;            /* its journal record's slot (journal on) */
};

_Static_assert(offsetof(struct broker_buf, id) == 0,
	       "idmap reads an item's id as its first member");
/* 136 bytes and glibc's 8-byte chunk header round to 144; one byte more
 * costs 16 per buffer. */
_Static_assert(sizeof(void *) != 8 || sizeof(struct broker_buf) <= 136,
	       "a broker_buf outgrew its malloc chunk");

/* Where a VMM buffer lies, which every journal put of it writes (a restart
 * imports the allocation again and marks the buffer's range in it). Fixed
 * when the buffer is made: alloc asks the backend once, a restore takes it
 * from the journal record. */
typedef struct buf_place {
	uint64_t allocation;      /* the allocation's identity */
	uint64_t offset;          /* the buffer's start in it */
	uint64_t allocation_size; /* the allocation's bytes */
} buf_place;

/* A VMM buffer's record: only such buffers pay for a place (the others
 * keep their chunk size); buf->cuda_handle says which a broker_buf is. */
typedef struct vmm_buf {
	broker_buf buf;  /* first: a VMM buffer's broker_buf * points here */
	buf_place place; /* not journaled once its memory is lost */
} vmm_buf;

/* Bytes of the record of a buffer of handle kind cuda_handle. */
static size_t buf_record_size(int cuda_handle)
{
	return cuda_handle == BB_CUDA_HANDLE_VMM ? sizeof(vmm_buf) : sizeof(broker_buf);
}

/* The place of buf, a VMM buffer. */
static buf_place *place_of(broker_buf *buf)
{
	return &((vmm_buf *)buf)->place;
}

/* broker_buf.flags: the first two are journaled as JOURNAL_BUF_*. */
#define BUF_IMPORTED JOURNAL_BUF_IMPORTED /* its fd came from a client */
#define BUF_EXPOSED JOURNAL_BUF_EXPOSED   /* granted to another uid */
#define BUF_LOST \
	JOURNAL_BUF_LOST /* memory not kept across a restart: FAILED,
					   * no memory, in no total or limit */

/* The longest failure message kept: broker_info.error and Wait's error_out
 * hold 256 bytes. */
#define BUF_ERROR_MAX 255

/* What a FAILED buffer says when its own message could not be stored.
 * Never written; compared by address so that it is never freed. */
static char error_unstored[] = "failed (the daemon had no memory to keep the message)";

/* The VMM allocations one connection holds buffers of: a grant carries
 * the allocation's fd when its entry is new. */
typedef struct conn_allocation {
	uint64_t allocation; /* key: the backend's fd_allocation identity */
	uint32_t buffers;    /* buffers of it the connection holds a count on (> 0) */
	UT_hash_handle hh;   /* in broker_conn.allocations */
} conn_allocation;

/* One place of a session's result ring (journal on): the answer of the
 * result-bearing request whose id mod JOURNAL_RESULT_RING it is. */
typedef struct conn_result {
	journal_result r; /* request 0: none yet */
	uint32_t jslot;   /* its journal record's slot */
} conn_result;

struct broker_conn {
	uint32_t uid, gid, pid;       /* SO_PEERCRED */
	uint32_t minor;               /* protocol minor version of its Hello */
	idmap holdings;               /* item: a buffer; value: this connection's count (> 0);
				       * journal on, second value (idmap_aux): its hold's
				       * journal slot */
	conn_allocation *allocations; /* VMM allocations of the buffers it holds */
	broker_buf *produced;         /* buffers it allocated, still PENDING */
	token *tokens;                /* tokens it made that are live */
	uint32_t ntokens;             /* length of tokens */
	broker_waiter *waiters;       /* its parked waits */
	uint32_t nwaits;              /* length of waiters */
	uint64_t opened_ms;           /* when it opened, for its age */
	broker_conn *prev, *next;     /* broker.conns */
	broker *broker;               /* the broker it belongs to */
	uint64_t session;             /* its session id (journal records) */
	uint64_t last_request;        /* requests up to this id are applied */
	uint64_t applied_mask;        /* bit i: request last_request + 1 + i applied */
	uint64_t noted_request;       /* broker_conn_note_request's id, 0: none */
	bool absent;                  /* restored, not resumed yet (RESTART.md) */
	uint64_t grace_ms;            /* absent: released at this broker time */
	uint32_t jslot;               /* its session record's slot */
	bool resumed;                 /* a client resumed it: resent ids are checked */
	unsigned char secret[BB_TOKEN_SIZE]; /* resumes it (journal on) */
	conn_result *results;                /* journal on: the result ring */
};

struct broker {
	broker_config cfg;                          /* clock, random source */
	broker_limits limits;                       /* in force */
	backend *be[BROKER_KINDS];                  /* per kind; NULL = unsupported */
	char why[BROKER_KINDS][160];                /* why a kind is unsupported */
	idmap by_id;                                /* all live buffers */
	buf_name *by_name;                          /* the named ones */
	token *tokens;                              /* live tokens by value */
	token *token_fifo;                          /* live tokens, oldest first */
	uid_usage *uids;                            /* usage per uid */
	uid_tokens *uid_tokens;                     /* live tokens per maker uid */
	broker_conn *conns;                         /* open connections */
	uint32_t nconns;                            /* length of conns */
	uint64_t next_id;                           /* next buffer id */
	uint64_t ntokens;                           /* live tokens */
	uint64_t nwaits;                            /* parked waits */
	uint64_t buffers[BROKER_KINDS];             /* live buffers per kind */
	uint64_t bytes[BROKER_KINDS];               /* their bytes */
	uint64_t refused[BROKER_LIMIT_COUNT];       /* requests each limit refused */
	uint64_t cuda_buffers[BROKER_CUDA_HANDLES]; /* live CUDA buffers per handle kind */
	uint64_t cuda_bytes[BROKER_CUDA_HANDLES];   /* ... their bytes */
	journal *j;                                 /* cfg.journal: NULL when off */
	bool jopen;                                 /* a transaction is begun */
	uint64_t jerrors;                           /* puts the journal refused */
	uint64_t next_session;                      /* next session id */
	uint64_t grace_ms;                          /* grace period of restored sessions */
	uint32_t nabsent;                           /* absent sessions */
	uint64_t restored;                          /* buffers broker_restore rebuilt */
	uint64_t restored_lost;                     /* ... of which lost their memory */
	broker_restore_times restore_times;         /* the last broker_restore's */
};

static int fail(broker_error *err, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static int fail(broker_error *err, int code, const char *fmt, ...)
{
	if (err) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
		va_end(ap);
	}
	return code;
}

/* "9.0 GiB": sizes in messages. */
static const char *human(uint64_t n, char out[BB_SIZE_TEXT])
{
	return bb_size_format(n, out, BB_SIZE_TEXT);
}

/* A value and its limit for one message: in one decimal unit each, or in
 * bytes when that rounding would show them equal ("1.0 MiB; the limit is
 * 1.0 MiB" says nothing). */
static void human_pair(uint64_t value, uint64_t limit, char a[32], char b[32])
{
	human(value, a);
	human(limit, b);
	if (strcmp(a, b) == 0) {
		snprintf(a, 32, "%" PRIu64 " bytes", value);
		snprintf(b, 32, "%" PRIu64 " bytes", limit);
	}
}

static uint64_t default_now_ms(void *ctx)
{
	(void)ctx;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void default_random(void *ctx, unsigned char *buf, size_t n)
{
	(void)ctx;
	size_t got = 0;
	while (got < n) {
		ssize_t r = getrandom(buf + got, n - got, 0);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			/* getrandom only fails on kernels without it (< 3.17);
			 * tokens must never be guessable, so stop here. */
			abort();
		}
		got += (size_t)r;
	}
}

static uint64_t now(broker *b)
{
	return b->cfg.now_ms(b->cfg.ctx);
}

void broker_limits_default(broker_limits *l)
{
	long pages = sysconf(_SC_PHYS_PAGES);
	long page = sysconf(_SC_PAGESIZE);
	uint64_t phys = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : (8ULL << 30);

	memset(l, 0, sizeof(*l));
	l->uid_bytes[BB_HOST] = phys / 2;
	/* CUDA bytes are bounded per device by the device itself; per uid the
	 * default is generous but finite. */
	l->uid_bytes[BB_CUDA] = 1ULL << 40;
	l->uid_buffers = 65536;
	l->host_buffers = 65536;
	l->connections = 1024;
	l->conn_tokens = 4096;
	l->uid_tokens = 65536;
	l->conn_waits = 1024;
	l->token_ttl_ms = 60000;
}

broker *broker_new(const broker_config *cfg)
{
	broker *b = calloc(1, sizeof(*b));
	if (!b)
		return NULL;
	if (cfg)
		b->cfg = *cfg;
	else
		broker_limits_default(&b->cfg.limits);
	if (!b->cfg.now_ms)
		b->cfg.now_ms = default_now_ms;
	if (!b->cfg.random)
		b->cfg.random = default_random;
	b->limits = b->cfg.limits;
	b->next_id = 1;
	b->next_session = 1;
	b->j = b->cfg.journal;
	b->grace_ms = 10000;
	for (int k = 0; k < BROKER_KINDS; k++)
		snprintf(b->why[k], sizeof(b->why[k]), "buffers of kind %s are not supported",
			 bb_kind_name(k));
	return b;
}

void broker_set_backend(broker *b, bb_kind kind, backend *be, const char *unsupported_why)
{
	if (kind <= 0 || kind >= BROKER_KINDS)
		return;
	b->be[kind] = be;
	if (unsupported_why)
		snprintf(b->why[kind], sizeof(b->why[kind]), "%s", unsupported_why);
}

void broker_set_limits(broker *b, const broker_limits *l)
{
	b->limits = *l;
}

const broker_limits *broker_get_limits(const broker *b)
{
	return &b->limits;
}

/* ---- buffers --------------------------------------------------------------- */

static uid_usage *usage_of(broker *b, uint32_t uid, bool create)
{
	uid_usage *u;
	HASH_FIND(hh, b->uids, &uid, sizeof(uid), u);
	if (!u && create) {
		u = calloc(1, sizeof(*u));
		if (!u)
			return NULL;
		u->uid = uid;
		HASH_ADD(hh, b->uids, uid, sizeof(uid), u);
	}
	return u;
}

static broker_buf *find_buf(broker *b, uint64_t id)
{
	idmap_slot *s = idmap_find(&b->by_id, id);
	return s ? s->item : NULL;
}

static broker_buf *find_name(broker *b, const char *name)
{
	buf_name *n = NULL;
	HASH_FIND(hh, b->by_name, name, strlen(name), n);
	return n ? n->buf : NULL;
}

/* conn's count on buffer id: the slot's value. NULL when it holds none. */
static idmap_slot *find_holding(const broker_conn *conn, uint64_t id)
{
	return idmap_find(&conn->holdings, id);
}

/* The failure message, "" for a buffer that has none. */
static const char *buf_error(const broker_buf *buf)
{
	return buf->error ? buf->error : "";
}

/* Wake every waiter of buf with code/state, unlinking each first. */
static void wake_all(broker *b, broker_buf *buf, int code)
{
	broker_waiter *w, *tmp;
	DL_FOREACH_SAFE (buf->waiters, w, tmp) {
		DL_DELETE(buf->waiters, w);
		DL_DELETE2(w->conn->waiters, w, cprev, cnext);
		w->conn->nwaits--;
		b->nwaits--;
		w->buf = NULL;
		w->wake(w, code, buf->state, buf_error(buf));
	}
}

/* ---- journal (docs/RESTART.md, "Wiring the journal into the daemon") ------- */

/* Every helper is called only when b->j is set; the transaction begins at
 * the first put of a public call and is committed by jend as it returns. */
static void jbegin(broker *b)
{
	if (!b->jopen) {
		journal_begin(b->j);
		b->jopen = true;
	}
}

static void jcheck(broker *b, int rc)
{
	if (rc)
		b->jerrors++;
}

static void jput_buf(broker *b, broker_buf *buf)
{
	journal_buffer r = {
		.id = buf->id,
		.size = buf->size,
		.producer = buf->producer ? buf->producer->session : 0,
		.kind = buf->kind,
		.device = buf->device,
		.cuda_handle = buf->cuda_handle,
		.state = buf->state,
		.owner_uid = buf->owner_uid,
		.owner_gid = buf->owner_gid,
		.share = buf->share,
		.flags = buf->flags,
	};
	if (buf->cuda_handle == BB_CUDA_HANDLE_VMM && !(buf->flags & BUF_LOST)) {
		const buf_place *p = place_of(buf);
		r.allocation = p->allocation;
		r.offset = p->offset;
		r.allocation_size = p->allocation_size;
	}
	if (buf->name)
		snprintf(r.name, sizeof(r.name), "%s", buf->name->text);
	if (buf->state == BB_FAILED)
		snprintf(r.error, sizeof(r.error), "%s", buf_error(buf));
	jbegin(b);
	jcheck(b, journal_put_buffer(b->j, &buf->jslot, &r));
}

static void jdrop_buf(broker *b, broker_buf *buf)
{
	jbegin(b);
	journal_drop(b->j, &buf->jslot, true);
}

static void jput_session(broker *b, broker_conn *conn)
{
	journal_session r = {
		.id = conn->session,
		.last_request = conn->last_request,
		.applied_mask = conn->applied_mask,
		.uid = conn->uid,
		.gid = conn->gid,
		.pid = conn->pid,
		.minor = conn->minor,
		.grace_ms = conn->absent ? conn->grace_ms : 0,
	};
	memcpy(r.secret, conn->secret, sizeof(r.secret));
	jbegin(b);
	jcheck(b, journal_put_session(b->j, &conn->jslot, &r));
}

_Static_assert(IDMAP_AUX_NONE == JOURNAL_NO_SLOT, "a new holding has no journal slot");

/* conn's count on the buffer of h, its entry in holdings (conn's, or what
 * closing it took of them), is now count (0: the hold is gone). The hold's
 * journal slot is the entry's second value: no lookup of its own. */
static void jput_hold(broker *b, broker_conn *conn, const idmap *holdings, idmap_slot *h,
		      uint32_t count)
{
	jbegin(b);
	uint32_t *slot = idmap_aux(holdings, h);
	if (count == 0) {
		journal_drop(b->j, slot, false);
		return;
	}
	journal_hold r = {
		.session = conn->session, .buffer = ((broker_buf *)h->item)->id, .count = count};
	jcheck(b, journal_put_hold(b->j, slot, &r));
}

static void jput_token(broker *b, token *t)
{
	journal_token r = {
		.buffer = t->buf->id,
		.session = t->maker ? t->maker->session : 0,
		.deadline_ms = t->expires_ms,
		.maker_uid = t->maker_uid,
	};
	memcpy(r.token, t->bytes, sizeof(r.token));
	jbegin(b);
	jcheck(b, journal_put_token(b->j, &t->jslot, &r));
}

/* The result of conn's noted request (a result-bearing op: status, the
 * buffer granted or the token made) into its ring, in the call's
 * transaction. */
static void jput_result(broker *b, broker_conn *conn, int status, const broker_buf *buf,
			const unsigned char *tok)
{
	if (!conn || !conn->noted_request || !conn->results)
		return;
	conn_result *x = &conn->results[conn->noted_request % JOURNAL_RESULT_RING];
	memset(&x->r, 0, sizeof(x->r));
	x->r.session = conn->session;
	x->r.request = conn->noted_request;
	x->r.status = status;
	x->r.buffer = buf ? buf->id : 0;
	if (tok)
		memcpy(x->r.token, tok, sizeof(x->r.token));
	jbegin(b);
	jcheck(b, journal_put_result(b->j, &x->jslot, &x->r));
}

#define JRESULT(b, conn, status, buf, tok)                      \
	do {                                                    \
		if (__builtin_expect((b)->j != NULL, 0))        \
			jput_result(b, conn, status, buf, tok); \
	} while (0)

/* Request id of conn applied (or, for a request that changes nothing,
 * seen): the floor and the mask of ids above it. A client puts its ids on
 * the wire in ascending order (PROTOCOL.md, "Session resume"), so an id
 * more than 64 above the floor moves the floor up to 64 below it: every id
 * the window leaves behind has reached the daemon already. */
static void applied(broker_conn *conn, uint64_t id)
{
	if (id <= conn->last_request)
		return;
	uint64_t ahead = id - conn->last_request - 1;
	if (ahead >= 64) {
		uint64_t shift = ahead - 63;
		conn->applied_mask = shift >= 64 ? 0 : conn->applied_mask >> shift;
		conn->last_request += shift;
		ahead = 63;
	}
	conn->applied_mask |= 1ull << ahead;
	while (conn->applied_mask & 1) {
		conn->last_request++;
		conn->applied_mask >>= 1;
	}
}

/* The end of a public call that may change state: the request conn noted
 * (if any) is applied in the same transaction as its effect. */
static void jend_slow(broker *b, broker_conn *conn)
{
	if (conn && conn->noted_request) {
		applied(conn, conn->noted_request);
		conn->noted_request = 0;
		jput_session(b, conn);
	}
	if (!b->jopen)
		return;
	journal_ids ids = {.next_buffer = b->next_id, .next_session = b->next_session};
	journal_set_ids(b->j, &ids);
	journal_commit(b->j);
	b->jopen = false;
}

/* The one branch a mutation pays with the journal off. */
#define JEND(b, conn)                                    \
	do {                                             \
		if (__builtin_expect((b)->j != NULL, 0)) \
			jend_slow(b, conn);              \
	} while (0)

static uint64_t fd_allocation(const broker_buf *buf);

/* Leave PENDING: into READY or FAILED, waking waiters. */
static void settle(broker *b, broker_buf *buf, bb_state state, const char *error)
{
	buf->state = state;
	if (error) {
		/* Only FAILED buffers pay for a message. Settling cannot fail,
		 * so without memory the buffer still fails, with a stock one. */
		/* Cut between characters: the message travels as UTF-8. */
		buf->error = strndup(error, bb_utf8_prefix(error, BUF_ERROR_MAX));
		if (!buf->error)
			buf->error = error_unstored;
	}
	if (buf->producer) {
		DL_DELETE2(buf->producer->produced, buf, pprev, pnext);
		buf->producer = NULL;
	}
	if (b->j)
		jput_buf(b, buf);
	wake_all(b, buf, 0);
}

/* The fd store's hook (broker_config.keep) for buf, now live or freed. */
static void keep(broker *b, const broker_buf *buf, bool live)
{
	if (!b->cfg.keep || (buf->flags & BUF_LOST))
		return;
	broker_kept k = {
		.id = buf->id,
		.kind = buf->kind,
		.cuda_handle = buf->cuda_handle,
		.fd = buf->kind == BB_HOST ? buf->mem.fd : -1,
		.allocation = fd_allocation(buf),
	};
	b->cfg.keep(b->cfg.keep_ctx, &k, live);
}

/* refs reached 0: give the memory back and forget the buffer. */
static void destroy(broker *b, broker_buf *buf)
{
	if (b->j)
		jdrop_buf(b, buf);
	wake_all(b, buf, BB_ERR_NOT_FOUND);
	if (buf->producer)
		DL_DELETE2(buf->producer->produced, buf, pprev, pnext);
	if (buf->name)
		HASH_DELETE(hh, b->by_name, buf->name);
	idmap_remove(&b->by_id, idmap_find(&b->by_id, buf->id));
	uid_usage *u = buf->flags & BUF_LOST ? NULL : usage_of(b, buf->owner_uid, false);
	if (u) {
		u->bytes[buf->kind] -= buf->size;
		u->buffers--;
		if (u->buffers == 0) {
			HASH_DELETE(hh, b->uids, u);
			free(u);
		}
	}
	if (!(buf->flags & BUF_LOST)) {
		b->buffers[buf->kind]--;
		b->bytes[buf->kind] -= buf->size;
		b->cuda_buffers[buf->cuda_handle]--;
		b->cuda_bytes[buf->cuda_handle] -= buf->size;
	}
	keep(b, buf, false);
	buf->be->free(buf->be, &buf->mem);
	free(buf->name);
	if (buf->error != error_unstored)
		free(buf->error);
	free(buf);
}

static void drop_refs(broker *b, broker_buf *buf, uint64_t n)
{
	buf->refs -= n;
	if (buf->refs == 0)
		destroy(b, buf);
}

/* The allocation whose fd grants of buf carry once per connection; 0
 * for all but VMM buffers (a byte's test, no call, for the others). */
static uint64_t fd_allocation(const broker_buf *buf)
{
	if (buf->flags & BUF_LOST)
		return 0;
	if (buf->cuda_handle != BB_CUDA_HANDLE_VMM || !buf->be->fd_allocation)
		return 0;
	return buf->be->fd_allocation(buf->be, &buf->mem);
}

static conn_allocation *conn_allocation_find(const broker_conn *conn, uint64_t allocation)
{
	conn_allocation *a;
	HASH_FIND(hh, conn->allocations, &allocation, sizeof(allocation), a);
	return a;
}

/* conn starts (delta 1) or stops (-1) holding a buffer of allocation.
 * Starting can fail (out of memory): BB_ERR_NO_MEMORY. */
static int conn_allocation_add(broker_conn *conn, uint64_t allocation, int delta)
{
	conn_allocation *a = conn_allocation_find(conn, allocation);
	if (delta > 0) {
		if (!a) {
			if (!(a = calloc(1, sizeof(*a))))
				return BB_ERR_NO_MEMORY;
			a->allocation = allocation;
			HASH_ADD(hh, conn->allocations, allocation, sizeof(a->allocation), a);
		}
		a->buffers++;
	} else if (a && --a->buffers == 0) {
		HASH_DELETE(hh, conn->allocations, a);
		free(a);
	}
	return 0;
}

static void conn_allocations_free(broker_conn *conn)
{
	conn_allocation *a, *tmp;
	HASH_ITER (hh, conn->allocations, a, tmp) {
		HASH_DELETE(hh, conn->allocations, a);
		free(a);
	}
}

/* Give conn count more references on buf; the caller adjusts refs.
 * *held (may be NULL) gets conn's count afterwards. */
static int hold(broker_conn *conn, broker_buf *buf, uint32_t count, uint32_t *held,
		broker_error *err)
{
	idmap_slot *h = find_holding(conn, buf->id);
	if (!h) {
		uint64_t alloc = fd_allocation(buf);
		if (alloc && conn_allocation_add(conn, alloc, 1))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		if (idmap_insert(&conn->holdings, buf, count)) {
			if (alloc)
				conn_allocation_add(conn, alloc, -1);
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		}
		if (conn->broker->j)
			jput_hold(conn->broker, conn, &conn->holdings, find_holding(conn, buf->id),
				  count);
		if (held)
			*held = count;
		return 0;
	}
	if (h->value > UINT32_MAX - count)
		return fail(err, BB_ERR_INVALID,
			    "buffer %" PRIu64 ": the connection's count would overflow", buf->id);
	h->value += count;
	if (conn->broker->j)
		jput_hold(conn->broker, conn, &conn->holdings, h, h->value);
	if (held)
		*held = h->value;
	return 0;
}

/* Take count (at most its value) of conn's references away; the caller
 * adjusts refs. h is stale afterwards. */
static void unhold(broker_conn *conn, idmap_slot *h, uint32_t count)
{
	h->value -= count;
	if (conn->broker->j)
		jput_hold(conn->broker, conn, &conn->holdings, h, h->value);
	if (h->value == 0) {
		uint64_t alloc = fd_allocation(h->item);
		if (alloc)
			conn_allocation_add(conn, alloc, -1);
		idmap_remove(&conn->holdings, h);
	}
}

/* Whether buf can be granted to conn: a VMM buffer needs protocol 1.2. */
static int grantable(const broker_buf *buf, const broker_conn *conn, broker_error *err)
{
	if (buf->cuda_handle == BB_CUDA_HANDLE_VMM && conn->minor < 2)
		return fail(err, BB_ERR_UNSUPPORTED,
			    "buffer %" PRIu64 " is a VMM CUDA buffer, which needs protocol 1.2 "
			    "(this client speaks 1.%u): upgrade libbufbroker",
			    buf->id, conn->minor);
	return 0;
}

/* Whether the share policy lets conn reach buf without holding it. */
static bool admits(const broker_buf *buf, const broker_conn *conn)
{
	if (conn->uid == 0 || conn->uid == buf->owner_uid)
		return true;
	if (buf->share == BB_SHARE_ANY)
		return true;
	if (buf->share == BB_SHARE_GID && conn->gid == buf->owner_gid)
		return true;
	return false;
}

static bool may_see(const broker_buf *buf, const broker_conn *conn)
{
	return admits(buf, conn) || find_holding(conn, buf->id) || buf->producer == conn;
}

/* Find buffer id for conn, checking the policy. */
static int reach(broker *b, broker_conn *conn, uint64_t id, broker_buf **out, broker_error *err)
{
	broker_buf *buf = find_buf(b, id);
	if (!buf)
		return fail(err, BB_ERR_NOT_FOUND, "no buffer with id %" PRIu64, id);
	if (!may_see(buf, conn))
		return fail(err, BB_ERR_DENIED,
			    "buffer %" PRIu64
			    " belongs to uid %u and is shared by %s; uid %u may not use it",
			    id, buf->owner_uid, buf->share == BB_SHARE_GID ? "gid" : "uid",
			    conn->uid);
	*out = buf;
	return 0;
}

static int check_name(const char *name, broker_error *err)
{
	size_t n = strlen(name);
	if (n > BB_NAME_MAX)
		return fail(err, BB_ERR_INVALID, "name is %zu bytes; the limit is %d", n,
			    BB_NAME_MAX);
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)name[i];
		if (c < 0x20 || c == 0x7f)
			return fail(err, BB_ERR_INVALID,
				    "name contains a control character at byte %zu", i);
	}
	size_t bad = bb_utf8_invalid_at(name, n);
	if (bad < n)
		return fail(err, BB_ERR_INVALID, "name is not valid UTF-8 at byte %zu", bad);
	return 0;
}

static int alloc_op(broker *b, broker_conn *conn, const broker_alloc_req *req, broker_buf **out,
		    broker_error *err)
{
	const char *name = req->name && req->name[0] ? req->name : NULL;
	char h1[32], h2[32];
	int rc;

	if (req->handle_refused)
		*req->handle_refused = false;
	if (req->size == 0)
		return fail(err, BB_ERR_INVALID, "size must be greater than 0");
	if (!bb_kind_valid(req->kind))
		return fail(err, BB_ERR_INVALID, "unknown buffer kind %d", (int)req->kind);
	if (req->share < BB_SHARE_UID || req->share > BB_SHARE_ANY)
		return fail(err, BB_ERR_INVALID, "unknown share policy %d", req->share);
	if (req->device < 0 || (req->kind == BB_HOST && req->device != 0))
		return fail(err, BB_ERR_INVALID, "device %d is not valid for %s buffers",
			    req->device, bb_kind_name(req->kind));
	if (req->cuda_handle < BB_CUDA_HANDLE_DEFAULT || req->cuda_handle > BB_CUDA_HANDLE_VMM)
		return fail(err, BB_ERR_INVALID, "unknown CUDA handle kind %d", req->cuda_handle);
	if (req->kind != BB_CUDA && req->cuda_handle != BB_CUDA_HANDLE_DEFAULT)
		return fail(err, BB_ERR_INVALID,
			    "a CUDA handle kind applies to CUDA buffers only, not %s ones",
			    bb_kind_name(req->kind));
	if (name && (rc = check_name(name, err)))
		return rc;
	backend *be = b->be[req->kind];
	if (!be)
		return fail(err, BB_ERR_UNSUPPORTED, "%s", b->why[req->kind]);
	if (req->import_fd >= 0 && !be->import_fd)
		return fail(err, BB_ERR_UNSUPPORTED,
			    "buffers of kind %s cannot be imported from an fd",
			    bb_kind_name(req->kind));
	if (name && find_name(b, name))
		return fail(err, BB_ERR_EXISTS, "the name \"%s\" is taken by buffer %" PRIu64, name,
			    find_name(b, name)->id);

	uid_usage *u = usage_of(b, conn->uid, false);
	uint64_t have_buffers = u ? u->buffers : 0;
	uint64_t have_bytes = u ? u->bytes[req->kind] : 0;
	if (have_buffers + 1 > b->limits.uid_buffers) {
		b->refused[BROKER_LIMIT_UID_BUFFERS]++;
		return fail(err, BB_ERR_NO_MEMORY,
			    "uid %u would own %" PRIu64 " buffers; the limit is %" PRIu64
			    " (--uid-buffers)",
			    conn->uid, have_buffers + 1, b->limits.uid_buffers);
	}
	/* Each host buffer holds a memfd: this bounds the daemon's fds. */
	if (req->kind == BB_HOST && b->buffers[BB_HOST] + 1 > b->limits.host_buffers) {
		b->refused[BROKER_LIMIT_HOST_BUFFERS]++;
		return fail(err, BB_ERR_NO_MEMORY,
			    "the daemon would hold %" PRIu64 " host buffers; the limit is %" PRIu64
			    " (--max-host-buffers)",
			    b->buffers[BB_HOST] + 1, b->limits.host_buffers);
	}
	if (req->size > b->limits.uid_bytes[req->kind] ||
	    have_bytes > b->limits.uid_bytes[req->kind] - req->size) {
		b->refused[req->kind == BB_CUDA ? BROKER_LIMIT_UID_CUDA_BYTES
						: BROKER_LIMIT_UID_BYTES]++;
		/* The sum may pass the limit by less than the rounding shows. */
		uint64_t would =
			req->size > UINT64_MAX - have_bytes ? UINT64_MAX : have_bytes + req->size;
		human_pair(would, b->limits.uid_bytes[req->kind], h1, h2);
		return fail(err, BB_ERR_NO_MEMORY,
			    "uid %u would hold %s of %s buffers; the limit is %s (--uid-%s-bytes)",
			    conn->uid, h1, bb_kind_name(req->kind), h2, bb_kind_name(req->kind));
	}

	if (!(u = usage_of(b, conn->uid, true)))
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	char msg[BROKER_ERR_LEN] = "";
	int handle = req->cuda_handle;
	backend_mem mem = {.fd = -1};
	if (req->import_fd >= 0)
		rc = be->import_fd(be, req->import_fd, req->size, &mem, msg, sizeof(msg));
	else
		rc = be->alloc(be, req->size, req->device, conn->uid, req->share, &handle, &mem,
			       msg, sizeof(msg));
	if (rc) {
		/* BACKEND_GROW passes through: the caller retries later. */
		fail(err, rc, "%s", msg[0] ? msg : "the backend could not provide the memory");
		if (req->handle_refused && rc == BB_ERR_UNSUPPORTED &&
		    handle == BACKEND_HANDLE_REFUSED)
			*req->handle_refused = true;
		goto err_usage;
	}
	/* The handle kind the backend gave decides the record's size. */
	if (req->kind != BB_CUDA || handle <= 0 || handle >= BROKER_CUDA_HANDLES)
		handle = BB_CUDA_HANDLE_DEFAULT;
	broker_buf *buf = calloc(1, buf_record_size(handle));
	if (!buf) {
		rc = fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		goto err_mem;
	}
	buf->mem = mem;
	if (name) {
		size_t len = strlen(name);
		if (!(buf->name = calloc(1, sizeof(*buf->name) + len + 1))) {
			rc = fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
			goto err_buf;
		}
		buf->name->buf = buf;
		memcpy(buf->name->text, name, len + 1);
	}
	if (handle == BB_CUDA_HANDLE_VMM) {
		/* Asked once: where a buffer lies never changes. */
		backend_export ex = {.fd = -1};
		if ((rc = be->export_mem(be, &mem, &ex, msg, sizeof(msg)))) {
			fail(err, rc, "%s",
			     msg[0] ? msg : "the backend could not say where the memory lies");
			goto err_buf;
		}
		*place_of(buf) = (buf_place){.allocation = ex.allocation,
					     .offset = ex.offset,
					     .allocation_size = ex.allocation_size};
	}

	buf->jslot = JOURNAL_NO_SLOT;
	buf->id = b->next_id++;
	buf->size = req->size;
	buf->kind = req->kind;
	buf->device = req->device;
	buf->state = BB_PENDING;
	buf->owner_uid = conn->uid;
	buf->owner_gid = conn->gid;
	buf->share = req->share;
	buf->created_ms = now(b);
	buf->be = be;
	buf->cuda_handle = (uint8_t)handle;
	buf->flags = req->import_fd >= 0 ? BUF_IMPORTED : 0;
	if ((rc = idmap_insert(&b->by_id, buf, 0))) {
		fail(err, rc, "daemon out of memory");
		goto err_buf;
	}
	if ((rc = hold(conn, buf, 1, NULL, err)))
		goto err_by_id;
	buf->refs = 1;
	buf->producer = conn;
	DL_APPEND2(conn->produced, buf, pprev, pnext);
	if (buf->name)
		HASH_ADD_KEYPTR(hh, b->by_name, buf->name->text, strlen(buf->name->text),
				buf->name);
	u->buffers++;
	u->bytes[buf->kind] += buf->size;
	b->buffers[buf->kind]++;
	b->bytes[buf->kind] += buf->size;
	b->cuda_buffers[buf->cuda_handle]++;
	b->cuda_bytes[buf->cuda_handle] += buf->size;
	keep(b, buf, true);
	if (b->j)
		jput_buf(b, buf);
	*out = buf;
	return 0;

err_by_id:
	idmap_remove(&b->by_id, idmap_find(&b->by_id, buf->id));
err_buf:
	free(buf->name);
	free(buf);
err_mem:
	be->free(be, &mem);
err_usage:
	if (u->buffers == 0) {
		HASH_DELETE(hh, b->uids, u);
		free(u);
	}
	return rc;
}

static int open_id_op(broker *b, broker_conn *conn, uint64_t id, broker_buf **out,
		      broker_error *err)
{
	broker_buf *buf = NULL;
	int rc = reach(b, conn, id, &buf, err);
	if (rc)
		return rc;
	if ((rc = grantable(buf, conn, err)))
		return rc;
	if ((rc = hold(conn, buf, 1, NULL, err)))
		return rc;
	buf->refs++;
	*out = buf;
	return 0;
}

int broker_open_name(broker *b, broker_conn *conn, const char *name, broker_buf **out,
		     broker_error *err)
{
	int rc;
	broker_buf *buf = NULL;
	if (!name || !name[0])
		rc = fail(err, BB_ERR_INVALID, "an empty name names no buffer");
	else if ((rc = check_name(name, err)) == 0 && !(buf = find_name(b, name)))
		rc = fail(err, BB_ERR_NOT_FOUND, "no buffer named \"%s\"", name);
	if (!rc)
		return broker_open_id(b, conn, buf->id, out, err);
	JRESULT(b, conn, rc, NULL, NULL);
	JEND(b, conn);
	return rc;
}

static int retain_op(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		     uint32_t *held_out, broker_error *err)
{
	broker_buf *buf = NULL;
	int rc;
	if (count == 0)
		return fail(err, BB_ERR_INVALID, "retain count must be at least 1");
	if ((rc = reach(b, conn, id, &buf, err)))
		return rc;
	if ((rc = hold(conn, buf, count, held_out, err)))
		return rc;
	buf->refs += count;
	if (refs_out)
		*refs_out = buf->refs;
	return 0;
}

static int release_op(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		      uint32_t *held_out, broker_error *err)
{
	if (count == 0)
		return fail(err, BB_ERR_INVALID, "release count must be at least 1");
	idmap_slot *h = find_holding(conn, id);
	if (!h) {
		if (find_buf(b, id))
			return fail(err, BB_ERR_INVALID,
				    "this connection holds no reference to buffer %" PRIu64, id);
		return fail(err, BB_ERR_NOT_FOUND, "no buffer with id %" PRIu64, id);
	}
	if (count > h->value)
		return fail(err, BB_ERR_INVALID,
			    "cannot release %u references to buffer %" PRIu64
			    "; this connection holds %u",
			    count, id, h->value);
	broker_buf *buf = h->item;
	uint32_t held = h->value - count;
	uint64_t refs = buf->refs - count;
	unhold(conn, h, count);
	drop_refs(b, buf, count);
	if (refs_out)
		*refs_out = refs;
	if (held_out)
		*held_out = held;
	return 0;
}

/* ---- tokens ---------------------------------------------------------------- */

static void token_forget(broker *b, token *t)
{
	uid_tokens *ut;
	HASH_FIND(hh, b->uid_tokens, &t->maker_uid, sizeof(t->maker_uid), ut);
	if (ut && --ut->tokens == 0) {
		HASH_DELETE(hh, b->uid_tokens, ut);
		free(ut);
	}
	if (b->j) {
		jbegin(b);
		journal_drop(b->j, &t->jslot, false);
	}
	HASH_DELETE(hh, b->tokens, t);
	DL_DELETE(b->token_fifo, t);
	if (t->maker) {
		DL_DELETE2(t->maker->tokens, t, mprev, mnext);
		t->maker->ntokens--;
	}
	t->buf->tokens--;
	b->ntokens--;
	free(t);
}

static int take_op(broker *b, broker_conn *conn, uint64_t id, bool retain,
		   unsigned char out[BB_TOKEN_SIZE], broker_error *err)
{
	idmap_slot *h = find_holding(conn, id);
	if (!h)
		return fail(err, BB_ERR_NOT_FOUND,
			    "this connection holds no buffer with id %" PRIu64, id);
	if (conn->ntokens >= b->limits.conn_tokens) {
		b->refused[BROKER_LIMIT_CONN_TOKENS]++;
		return fail(
			err, BB_ERR_NO_MEMORY,
			"the connection would have %u live tokens; the limit is %u (--conn-tokens)",
			conn->ntokens + 1, b->limits.conn_tokens);
	}
	uid_tokens *ut;
	HASH_FIND(hh, b->uid_tokens, &conn->uid, sizeof(conn->uid), ut);
	uint64_t have = ut ? ut->tokens : 0;
	if (have >= b->limits.uid_tokens) {
		b->refused[BROKER_LIMIT_UID_TOKENS]++;
		return fail(err, BB_ERR_NO_MEMORY,
			    "uid %u would have %" PRIu64 " live tokens; the limit is %" PRIu64
			    " (--uid-tokens)",
			    conn->uid, have + 1, b->limits.uid_tokens);
	}
	if (!ut) {
		if (!(ut = calloc(1, sizeof(*ut))))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		ut->uid = conn->uid;
		HASH_ADD(hh, b->uid_tokens, uid, sizeof(ut->uid), ut);
	}
	token *t = calloc(1, sizeof(*t));
	if (t)
		t->jslot = JOURNAL_NO_SLOT;
	if (!t) {
		if (ut->tokens == 0) {
			HASH_DELETE(hh, b->uid_tokens, ut);
			free(ut);
		}
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	}
	/* 128 random bits: a collision with a live token is as likely as
	 * guessing one; still, never let two live tokens share a value. */
	token *dup;
	do {
		b->cfg.random(b->cfg.ctx, t->bytes, sizeof(t->bytes));
		HASH_FIND(hh, b->tokens, t->bytes, sizeof(t->bytes), dup);
	} while (dup);

	broker_buf *buf = h->item;
	t->buf = buf;
	t->maker = conn;
	t->maker_uid = conn->uid;
	ut->tokens++;
	t->expires_ms = now(b) + b->limits.token_ttl_ms;
	HASH_ADD(hh, b->tokens, bytes, sizeof(t->bytes), t);
	DL_APPEND(b->token_fifo, t);
	DL_APPEND2(conn->tokens, t, mprev, mnext);
	conn->ntokens++;
	buf->tokens++;
	b->ntokens++;
	if (retain)
		buf->refs++;
	else
		unhold(conn, h, 1); /* the reference moves; refs unchanged */
	if (b->j)
		jput_token(b, t);
	memcpy(out, t->bytes, sizeof(t->bytes));
	return 0;
}

static int adopt_op(broker *b, broker_conn *conn, const unsigned char tok[BB_TOKEN_SIZE],
		    broker_buf **out, broker_error *err)
{
	token *t;
	HASH_FIND(hh, b->tokens, tok, BB_TOKEN_SIZE, t);
	if (!t)
		return fail(err, BB_ERR_NOT_FOUND, "no such token (already adopted, or expired)");
	broker_buf *buf = t->buf;
	if (now(b) >= t->expires_ms) {
		token_forget(b, t);
		drop_refs(b, buf, 1);
		return fail(err, BB_ERR_NOT_FOUND, "the token expired");
	}
	int rc = grantable(buf, conn, err);
	if (rc)
		return rc; /* the token stays, for a client that can map it */
	rc = hold(conn, buf, 1, NULL, err);
	if (rc)
		return rc;
	token_forget(b, t); /* its reference is now conn's: refs unchanged */
	*out = buf;
	return 0;
}

static uint64_t expire_tokens_op(broker *b)
{
	uint64_t t_now = now(b);
	while (b->token_fifo) {
		token *t = b->token_fifo;
		/* TTL may have shrunk since older tokens were made; the FIFO is
		 * still ordered by creation, so scan only expired heads. */
		if (t->expires_ms > t_now)
			return t->expires_ms - t_now;
		broker_buf *buf = t->buf;
		token_forget(b, t);
		drop_refs(b, buf, 1);
	}
	return UINT64_MAX;
}

/* ---- async state ------------------------------------------------------------ */

static int settle_check(broker *b, broker_conn *conn, uint64_t id, broker_buf **out,
			broker_error *err)
{
	broker_buf *buf = find_buf(b, id);
	if (!buf)
		return fail(err, BB_ERR_NOT_FOUND, "no buffer with id %" PRIu64, id);
	if (buf->producer != conn && !find_holding(conn, id))
		return fail(err, BB_ERR_DENIED,
			    "only the producer or a holder may change buffer %" PRIu64 "'s state",
			    id);
	if (buf->state != BB_PENDING)
		return fail(err, BB_ERR_STATE, "buffer %" PRIu64 " is already %s", id,
			    buf->state == BB_READY ? "ready" : "failed");
	*out = buf;
	return 0;
}

static int set_ready_op(broker *b, broker_conn *conn, uint64_t id, broker_error *err)
{
	broker_buf *buf = NULL;
	int rc = settle_check(b, conn, id, &buf, err);
	if (rc)
		return rc;
	settle(b, buf, BB_READY, NULL);
	return 0;
}

static int set_error_op(broker *b, broker_conn *conn, uint64_t id, const char *message,
			broker_error *err)
{
	broker_buf *buf = NULL;
	int rc = settle_check(b, conn, id, &buf, err);
	if (rc)
		return rc;
	settle(b, buf, BB_FAILED, message && message[0] ? message : "failed");
	return 0;
}

int broker_wait(broker *b, broker_conn *conn, uint64_t id, broker_waiter *w, bb_state *state_out,
		char *error_out, broker_error *err)
{
	broker_buf *buf = NULL;
	int rc = reach(b, conn, id, &buf, err);
	if (rc)
		return rc;
	if (buf->state != BB_PENDING) {
		*state_out = buf->state;
		snprintf(error_out, 256, "%s", buf_error(buf));
		return 1;
	}
	if (conn->nwaits >= b->limits.conn_waits) {
		b->refused[BROKER_LIMIT_CONN_WAITS]++;
		return fail(
			err, BB_ERR_NO_MEMORY,
			"the connection would have %u parked waits; the limit is %u (--conn-waits)",
			conn->nwaits + 1, b->limits.conn_waits);
	}
	w->conn = conn;
	w->buf = buf;
	DL_APPEND(buf->waiters, w);
	DL_APPEND2(conn->waiters, w, cprev, cnext);
	conn->nwaits++;
	b->nwaits++;
	return 0;
}

void broker_wait_cancel(broker *b, broker_waiter *w)
{
	if (!w->buf)
		return;
	DL_DELETE(w->buf->waiters, w);
	DL_DELETE2(w->conn->waiters, w, cprev, cnext);
	w->conn->nwaits--;
	b->nwaits--;
	w->buf = NULL;
}

/* ---- connections ------------------------------------------------------------ */

/* conn's empty result ring (journal on). */
static int conn_results_new(broker_conn *conn)
{
	conn->results = calloc(JOURNAL_RESULT_RING, sizeof(*conn->results));
	if (!conn->results)
		return BB_ERR_NO_MEMORY;
	for (int i = 0; i < JOURNAL_RESULT_RING; i++)
		conn->results[i].jslot = JOURNAL_NO_SLOT;
	return 0;
}

broker_conn *broker_conn_open(broker *b, uint32_t uid, uint32_t gid, uint32_t pid,
			      broker_error *err)
{
	if (b->nconns >= b->limits.connections) {
		b->refused[BROKER_LIMIT_CONNECTIONS]++;
		fail(err, BB_ERR_NO_MEMORY,
		     "%u connections are open; the limit is %u (--max-connections)", b->nconns,
		     b->limits.connections);
		return NULL;
	}
	broker_conn *conn = calloc(1, sizeof(*conn));
	if (!conn) {
		fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		return NULL;
	}
	conn->uid = uid;
	conn->gid = gid;
	conn->pid = pid;
	conn->minor = BB_PROTO_MINOR;
	conn->opened_ms = now(b);
	conn->broker = b;
	conn->session = b->next_session++;
	conn->jslot = JOURNAL_NO_SLOT;
	if (b->j) {
		(void)idmap_aux_on(&conn->holdings); /* owns no memory yet: cannot fail */
		if (conn_results_new(conn)) {
			free(conn);
			b->next_session--;
			fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
			return NULL;
		}
		b->cfg.random(b->cfg.ctx, conn->secret, sizeof(conn->secret));
	}
	DL_APPEND(b->conns, conn);
	b->nconns++;
	if (b->j)
		jput_session(b, conn);
	JEND(b, NULL);
	return conn;
}

void broker_conn_close(broker *b, broker_conn *conn)
{
	broker_waiter *w, *wtmp;
	DL_FOREACH_SAFE2(conn->waiters, w, wtmp, cnext)
	broker_wait_cancel(b, w);

	/* Fail what it was producing before its references go, so that other
	 * holders' waiters learn why rather than finding the buffer gone. */
	broker_buf *buf, *btmp;
	DL_FOREACH_SAFE2(conn->produced, buf, btmp, pnext)
	settle(b, buf, BB_FAILED, "producer disconnected");

	token *t, *ttmp;
	DL_FOREACH_SAFE2(conn->tokens, t, ttmp, mnext)
	{
		DL_DELETE2(conn->tokens, t, mprev, mnext);
		t->maker = NULL;
		if (b->j)
			jput_token(b, t);
	}

	/* Take the holdings off conn first: while the counts drop and buffers
	 * go, conn holds nothing rather than entries that point at them. */
	idmap held = conn->holdings;
	conn->holdings = (idmap){0};
	for (idmap_slot *h = idmap_next(&held, NULL); h; h = idmap_next(&held, h)) {
		if (b->j)
			jput_hold(b, conn, &held, h, 0);
		drop_refs(b, h->item, h->value);
	}
	idmap_free(&held);
	if (b->j) {
		jbegin(b);
		journal_drop(b->j, &conn->jslot, false);
		for (int i = 0; conn->results && i < JOURNAL_RESULT_RING; i++)
			journal_drop(b->j, &conn->results[i].jslot, false);
	}
	free(conn->results);
	if (conn->absent)
		b->nabsent--;
	conn_allocations_free(conn);
	DL_DELETE(b->conns, conn);
	b->nconns--;
	free(conn);
	JEND(b, NULL);
}

uint32_t broker_conn_uid(const broker_conn *conn)
{
	return conn->uid;
}

void broker_conn_set_minor(broker_conn *conn, uint32_t minor)
{
	conn->minor = minor;
	if (conn->broker->j) {
		jput_session(conn->broker, conn);
		jend_slow(conn->broker, NULL);
	}
}

uint32_t broker_conn_allocation_buffers(const broker_conn *conn, uint64_t allocation)
{
	const conn_allocation *a = conn_allocation_find(conn, allocation);
	return a ? a->buffers : 0;
}

int broker_allocation_fd(broker *b, broker_conn *conn, uint64_t allocation, backend_export *out,
			 broker_error *err)
{
	backend *be = b->be[BB_CUDA];
	char msg[BROKER_ERR_LEN] = "";
	memset(out, 0, sizeof(*out));
	out->fd = -1;
	if (!allocation || !conn_allocation_find(conn, allocation) || !be || !be->export_allocation)
		return fail(err, BB_ERR_NOT_FOUND,
			    "this connection holds no buffer in VMM allocation %" PRIu64,
			    allocation);
	int rc = be->export_allocation(be, allocation, out, msg, sizeof(msg));
	if (rc)
		return fail(err, rc, "%s", msg[0] ? msg : "the backend could not export it");
	return 0;
}

uint32_t broker_conn_pid(const broker_conn *conn)
{
	return conn->pid;
}

void broker_conn_holdings(const broker_conn *conn, uint64_t *buffers, uint64_t *bytes)
{
	uint64_t sz = 0;
	for (const idmap_slot *h = idmap_next(&conn->holdings, NULL); h;
	     h = idmap_next(&conn->holdings, h)) {
		const broker_buf *hb = h->item;
		sz += hb->size;
	}
	*buffers = idmap_count(&conn->holdings);
	*bytes = sz;
}

void broker_conn_stats_get(broker *b, const broker_conn *conn, broker_conn_stats *out)
{
	uint64_t t = now(b);
	broker_conn_holdings(conn, &out->buffers, &out->bytes);
	out->tokens = conn->ntokens;
	out->waits = conn->nwaits;
	out->age_ms = t > conn->opened_ms ? t - conn->opened_ms : 0;
}

/* ---- reporting -------------------------------------------------------------- */

void broker_buf_info(broker *b, const broker_buf *buf, const broker_conn *conn, broker_info *out)
{
	memset(out, 0, sizeof(*out));
	out->id = buf->id;
	out->size = buf->size;
	out->kind = buf->kind;
	out->device = buf->device;
	out->state = buf->state;
	out->refs = buf->refs;
	out->tokens = buf->tokens;
	if (conn) {
		const idmap_slot *h = find_holding(conn, buf->id);
		out->held = h ? h->value : 0;
	}
	snprintf(out->name, sizeof(out->name), "%s", buf->name ? buf->name->text : "");
	snprintf(out->error, sizeof(out->error), "%s", buf_error(buf));
	out->owner_uid = buf->owner_uid;
	out->owner_gid = buf->owner_gid;
	out->share = buf->share;
	out->age_ms = now(b) - buf->created_ms;
	out->cuda_handle = buf->cuda_handle;
}

int broker_buf_export(broker *b, const broker_buf *buf, backend_export *out, broker_error *err)
{
	(void)b;
	char msg[BROKER_ERR_LEN] = "";
	memset(out, 0, sizeof(*out));
	out->fd = -1;
	int rc = buf->be->export_mem(buf->be, &buf->mem, out, msg, sizeof(msg));
	if (rc)
		return fail(err, rc, "%s",
			    msg[0] ? msg : "the backend could not export the buffer");
	return 0;
}

int broker_grant(broker *b, broker_conn *conn, broker_buf *buf, broker_granted *out,
		 broker_error *err)
{
	broker_buf_info(b, buf, conn, &out->info);
	out->exposed = false;
	out->allocation_fd = false;
	int rc = broker_buf_export(b, buf, &out->ex, err);
	if (rc) {
		/* The caller got a count it will never learn of: give it back. */
		broker_release(b, conn, out->info.id, 1, NULL, NULL, NULL);
		return rc;
	}
	uint64_t alloc = fd_allocation(buf);
	if (alloc) {
		/* The fd goes once: with the grant that made conn hold its first
		 * buffer of the allocation (this buffer, one count, alone). */
		const idmap_slot *h = find_holding(conn, buf->id);
		out->allocation_fd =
			broker_conn_allocation_buffers(conn, alloc) == 1 && h && h->value == 1;
		if (!out->allocation_fd)
			out->ex.fd = -1;
	}
	if (buf->owner_uid != conn->uid && buf->be->expose) {
		buf->be->expose(buf->be, &buf->mem);
		out->exposed = true;
		if (!(buf->flags & BUF_EXPOSED)) {
			buf->flags |= BUF_EXPOSED;
			if (b->j)
				jput_buf(b, buf);
			JEND(b, NULL);
		}
	}
	return 0;
}

int broker_stat_id(broker *b, broker_conn *conn, uint64_t id, broker_info *out, broker_error *err)
{
	broker_buf *buf = NULL;
	int rc = reach(b, conn, id, &buf, err);
	if (rc)
		return rc;
	broker_buf_info(b, buf, conn, out);
	return 0;
}

int broker_stat_name(broker *b, broker_conn *conn, const char *name, broker_info *out,
		     broker_error *err)
{
	if (!name || !name[0])
		return fail(err, BB_ERR_INVALID, "an empty name names no buffer");
	broker_buf *buf = find_name(b, name);
	if (!buf)
		return fail(err, BB_ERR_NOT_FOUND, "no buffer named \"%s\"", name);
	return broker_stat_id(b, conn, buf->id, out, err);
}

static int compare_ids(const void *x, const void *y)
{
	uint64_t a = (*(broker_buf *const *)x)->id, c = (*(broker_buf *const *)y)->id;
	return (a > c) - (a < c);
}

/* broker_list without the memory to sort: each next buffer is found by a
 * scan of the whole table. Slow, but List pages by id (after_id), so the
 * order is part of the answer. */
static void list_by_scans(broker *b, broker_conn *conn,
			  int (*fn)(const broker_info *info, void *arg), void *arg)
{
	broker_info info;
	uint64_t after = 0;
	for (;;) {
		broker_buf *next = NULL;
		for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s)) {
			broker_buf *buf = s->item;
			if (buf->id > after && (!next || buf->id < next->id) && may_see(buf, conn))
				next = buf;
		}
		if (!next)
			return;
		after = next->id;
		broker_buf_info(b, next, conn, &info);
		if (fn(&info, arg))
			return;
	}
}

void broker_list(broker *b, broker_conn *conn, int (*fn)(const broker_info *info, void *arg),
		 void *arg)
{
	/* The table keeps no order: List is an admin request, so sorting a
	 * snapshot here is cheaper than keeping every buffer in order. */
	broker_buf **bufs = malloc((idmap_count(&b->by_id) + 1) * sizeof(*bufs));
	if (!bufs) {
		list_by_scans(b, conn, fn, arg);
		return;
	}
	size_t n = 0;
	for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s))
		if (may_see(s->item, conn))
			bufs[n++] = s->item;
	qsort(bufs, n, sizeof(*bufs), compare_ids);
	broker_info info;
	for (size_t i = 0; i < n; i++) {
		broker_buf_info(b, bufs[i], conn, &info);
		if (fn(&info, arg))
			break;
	}
	free(bufs);
}

void broker_totals_get(broker *b, broker_totals *out)
{
	memset(out, 0, sizeof(*out));
	for (int k = 0; k < BROKER_KINDS; k++) {
		out->buffers[k] = b->buffers[k];
		out->bytes[k] = b->bytes[k];
	}
	out->connections = b->nconns;
	out->tokens = b->ntokens;
	out->waits = b->nwaits;
	memcpy(out->refused, b->refused, sizeof(out->refused));
	memcpy(out->cuda_buffers, b->cuda_buffers, sizeof(out->cuda_buffers));
	memcpy(out->cuda_bytes, b->cuda_bytes, sizeof(out->cuda_bytes));
}

const char *broker_limit_name(broker_limit limit)
{
	static const char *names[BROKER_LIMIT_COUNT] = {
		[BROKER_LIMIT_CONNECTIONS] = "connections",
		[BROKER_LIMIT_UID_BUFFERS] = "uid_buffers",
		[BROKER_LIMIT_UID_BYTES] = "uid_bytes",
		[BROKER_LIMIT_CONN_TOKENS] = "conn_tokens",
		[BROKER_LIMIT_CONN_WAITS] = "conn_waits",
		[BROKER_LIMIT_UID_TOKENS] = "uid_tokens",
		[BROKER_LIMIT_HOST_BUFFERS] = "host_buffers",
		[BROKER_LIMIT_UID_CUDA_BYTES] = "uid_cuda_bytes",
	};
	return (unsigned)limit < BROKER_LIMIT_COUNT ? names[limit] : NULL;
}

void broker_uid_usage(broker *b,
		      void (*fn)(uint32_t uid, uint64_t buffers, const uint64_t bytes[BROKER_KINDS],
				 void *arg),
		      void *arg)
{
	/* destroy drops a uid's entry with its last buffer: every one owns some. */
	for (const uid_usage *u = b->uids; u; u = u->hh.next)
		fn(u->uid, u->buffers, u->bytes, arg);
}

/* Append one problem line to the report being built. */
static void report_add(char *report, size_t len, size_t *used, int *problems, const char *fmt, ...)
	__attribute__((format(printf, 5, 6)));

static void report_add(char *report, size_t len, size_t *used, int *problems, const char *fmt, ...)
{
	(*problems)++;
	if (*used + 1 >= len)
		return;
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(report + *used, len - *used, fmt, ap);
	va_end(ap);
	if (n > 0)
		*used = *used + (size_t)n < len ? *used + (size_t)n : len - 1;
	if (*used + 1 < len) {
		report[(*used)++] = '\n';
		report[*used] = '\0';
	}
}

/* Scratch counts per buffer while checking. Keyed by address, so that a
 * holding, token or waiter that points at a freed buffer is found out
 * without reading it: an open-addressing table sized once for every live
 * buffer (one allocation, not one per buffer). */
typedef struct check_row {
	const broker_buf *buf; /* key; NULL: an empty place */
	uint64_t counts;       /* sum of connection counts */
	uint64_t tokens;       /* live tokens seen */
	uint64_t waiters;      /* waiters seen through connections */
} check_row;

typedef struct check_rows {
	check_row *rows;
	size_t mask; /* places - 1, a power of two at least twice the buffers */
} check_rows;

static size_t check_home(const check_rows *t, const broker_buf *buf)
{
	uint64_t h = (uint64_t)(uintptr_t)buf;
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdull;
	h ^= h >> 33;
	return (size_t)h & t->mask;
}

/* buf's row, or NULL: not a live buffer. */
static check_row *check_row_find(const check_rows *t, const broker_buf *buf)
{
	if (!buf)
		return NULL;
	for (size_t i = check_home(t, buf);; i = (i + 1) & t->mask) {
		if (t->rows[i].buf == buf)
			return &t->rows[i];
		if (!t->rows[i].buf)
			return NULL;
	}
}

/* A row for buf (a live buffer, in no row yet). */
static check_row *check_row_add(check_rows *t, const broker_buf *buf)
{
	size_t i = check_home(t, buf);
	while (t->rows[i].buf)
		i = (i + 1) & t->mask;
	t->rows[i].buf = buf;
	return &t->rows[i];
}

/* conn's books of VMM allocations against its holdings: each allocation
 * counts the buffers of it that conn holds, and no other is there. */
static void check_conn_allocations(broker *b, broker_conn *c, char *report, size_t len,
				   size_t *used, int *problems)
{
	(void)b;
	conn_allocation *seen = NULL, *a, *tmp;
	for (idmap_slot *h = idmap_next(&c->holdings, NULL); h; h = idmap_next(&c->holdings, h)) {
		uint64_t alloc = fd_allocation(h->item);
		if (!alloc)
			continue;
		HASH_FIND(hh, seen, &alloc, sizeof(alloc), a);
		if (!a) {
			if (!(a = calloc(1, sizeof(*a)))) {
				report_add(report, len, used, problems, "check: out of memory");
				goto out;
			}
			a->allocation = alloc;
			HASH_ADD(hh, seen, allocation, sizeof(a->allocation), a);
		}
		a->buffers++;
	}
	for (a = c->allocations; a; a = a->hh.next) {
		conn_allocation *s;
		HASH_FIND(hh, seen, &a->allocation, sizeof(a->allocation), s);
		if (!s || s->buffers != a->buffers)
			report_add(
				report, len, used, problems,
				"connection of pid %u counts %u buffers in VMM allocation %" PRIu64
				" but holds %u",
				c->pid, a->buffers, a->allocation, s ? s->buffers : 0);
	}
	for (a = seen; a; a = a->hh.next)
		if (!conn_allocation_find(c, a->allocation))
			report_add(
				report, len, used, problems,
				"connection of pid %u holds %u buffers in VMM allocation %" PRIu64
				" that its books do not count",
				c->pid, a->buffers, a->allocation);
out:
	HASH_ITER (hh, seen, a, tmp) {
		HASH_DELETE(hh, seen, a);
		free(a);
	}
}

int broker_check(broker *b, char *report, size_t len)
{
	size_t used = 0;
	int problems = 0;
	check_rows rows = {NULL, 0};
	check_row *row;
	uint64_t buffers[BROKER_KINDS] = {0}, bytes[BROKER_KINDS] = {0};
	uint64_t hbuffers[BROKER_CUDA_HANDLES] = {0}, hbytes[BROKER_CUDA_HANDLES] = {0};
	uint64_t waits = 0, conns = 0;

	if (len)
		report[0] = '\0';
#define PROBLEM(...) report_add(report, len, &used, &problems, __VA_ARGS__)
	size_t places = 16;
	while (places < 2 * (size_t)idmap_count(&b->by_id))
		places *= 2;
	if (!(rows.rows = calloc(places, sizeof(*rows.rows)))) {
		PROBLEM("check: out of memory");
		goto out;
	}
	rows.mask = places - 1;
	for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s)) {
		broker_buf *buf = s->item;
		check_row_add(&rows, buf);
		if (!(buf->flags & BUF_LOST)) { /* a lost buffer is in no total */
			buffers[buf->kind]++;
			bytes[buf->kind] += buf->size;
			hbuffers[buf->cuda_handle]++;
			hbytes[buf->cuda_handle] += buf->size;
		} else if (buf->state != BB_FAILED) {
			PROBLEM("buffer %" PRIu64 ": its memory is lost but it is not FAILED",
				buf->id);
		}
		if ((buf->kind == BB_CUDA) != (buf->cuda_handle != BB_CUDA_HANDLE_DEFAULT))
			PROBLEM("buffer %" PRIu64 ": a %s buffer with CUDA handle kind %d", buf->id,
				bb_kind_name(buf->kind), buf->cuda_handle);
		if (find_buf(b, buf->id) != buf)
			PROBLEM("buffer %" PRIu64 ": its id does not lead back to it", buf->id);
		if (buf->name && find_name(b, buf->name->text) != buf)
			PROBLEM("buffer %" PRIu64 ": its name \"%s\" does not lead back to it",
				buf->id, buf->name->text);
	}
	for (broker_conn *c = b->conns; c; c = c->next) {
		conns++;
		for (idmap_slot *h = idmap_next(&c->holdings, NULL); h;
		     h = idmap_next(&c->holdings, h)) {
			const broker_buf *hb = h->item;
			row = check_row_find(&rows, hb);
			if (!row) {
				PROBLEM("connection of pid %u holds %u on a buffer that is not live (%p)",
					c->pid, h->value, h->item);
				continue;
			}
			if (find_holding(c, hb->id) != h)
				PROBLEM("connection of pid %u: its count on buffer %" PRIu64
					" is not found by the id",
					c->pid, hb->id);
			if (h->value == 0)
				PROBLEM("connection of pid %u keeps a zero count on buffer %" PRIu64,
					c->pid, hb->id);
			row->counts += h->value;
		}
		check_conn_allocations(b, c, report, len, &used, &problems);
		uint32_t nw = 0, nt = 0;
		for (broker_waiter *w = c->waiters; w; w = w->cnext) {
			nw++;
			if (!w->buf) {
				PROBLEM("connection of pid %u has a waiter on no buffer", c->pid);
				continue;
			}
			row = check_row_find(&rows, w->buf);
			if (row)
				row->waiters++;
		}
		for (token *t = c->tokens; t; t = t->mnext)
			nt++;
		if (nw != c->nwaits)
			PROBLEM("connection of pid %u counts %u waits but has %u", c->pid,
				c->nwaits, nw);
		if (nt != c->ntokens)
			PROBLEM("connection of pid %u counts %u tokens but has %u", c->pid,
				c->ntokens, nt);
		waits += nw;
	}
	uint64_t ntokens = 0;
	for (token *t = b->tokens; t; t = t->hh.next) {
		ntokens++;
		row = check_row_find(&rows, t->buf);
		if (!row)
			PROBLEM("a live token references a buffer that is not live (%p)",
				(void *)t->buf);
		else
			row->tokens++;
	}
	for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s)) {
		const broker_buf *buf = s->item;
		uint64_t nwaiters = 0;
		row = check_row_find(&rows, buf);
		for (broker_waiter *w = buf->waiters; w; w = w->next)
			nwaiters++;
		if (buf->refs != row->counts + row->tokens)
			PROBLEM("buffer %" PRIu64 ": refs %" PRIu64 " but connections hold %" PRIu64
				" and %" PRIu64 " tokens are live",
				buf->id, buf->refs, row->counts, row->tokens);
		if (buf->tokens != row->tokens)
			PROBLEM("buffer %" PRIu64 ": counts %u tokens but %" PRIu64 " are live",
				buf->id, buf->tokens, row->tokens);
		if (buf->refs == 0)
			PROBLEM("buffer %" PRIu64 " is live with no references", buf->id);
		if (nwaiters != row->waiters)
			PROBLEM("buffer %" PRIu64 ": %" PRIu64
				" waiters, connections know of %" PRIu64,
				buf->id, nwaiters, row->waiters);
	}
	for (int k = 0; k < BROKER_CUDA_HANDLES; k++) {
		if (hbuffers[k] != b->cuda_buffers[k] || hbytes[k] != b->cuda_bytes[k])
			PROBLEM("CUDA handle kind %d totals say %" PRIu64 " buffers, %" PRIu64
				" bytes; the buffers add up to %" PRIu64 ", %" PRIu64,
				k, b->cuda_buffers[k], b->cuda_bytes[k], hbuffers[k], hbytes[k]);
	}
	for (int k = 1; k < BROKER_KINDS; k++) {
		if (buffers[k] != b->buffers[k] || bytes[k] != b->bytes[k])
			PROBLEM("%s totals say %" PRIu64 " buffers, %" PRIu64
				" bytes; the buffers add up to %" PRIu64 ", %" PRIu64,
				bb_kind_name(k), b->buffers[k], b->bytes[k], buffers[k], bytes[k]);
	}
	/* Per-uid usage, recounted into a scratch table. */
	uid_usage *seen = NULL, *su, *stmp;
	for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s)) {
		const broker_buf *buf = s->item;
		if (buf->flags & BUF_LOST)
			continue;
		HASH_FIND(hh, seen, &buf->owner_uid, sizeof(buf->owner_uid), su);
		if (!su) {
			if (!(su = calloc(1, sizeof(*su)))) {
				PROBLEM("check: out of memory");
				break;
			}
			su->uid = buf->owner_uid;
			HASH_ADD(hh, seen, uid, sizeof(su->uid), su);
		}
		su->buffers++;
		su->bytes[buf->kind] += buf->size;
	}
	for (uid_usage *u = b->uids; u; u = u->hh.next) {
		HASH_FIND(hh, seen, &u->uid, sizeof(u->uid), su);
		uid_usage zero = {.uid = u->uid};
		if (!su)
			su = &zero;
		if (su->buffers != u->buffers || su->bytes[BB_HOST] != u->bytes[BB_HOST] ||
		    su->bytes[BB_CUDA] != u->bytes[BB_CUDA])
			PROBLEM("uid %u's usage says %" PRIu64 " buffers, %" PRIu64
				" host and %" PRIu64 " cuda bytes; it owns %" PRIu64 ", %" PRIu64
				" and %" PRIu64,
				u->uid, u->buffers, u->bytes[BB_HOST], u->bytes[BB_CUDA],
				su->buffers, su->bytes[BB_HOST], su->bytes[BB_CUDA]);
	}
	HASH_ITER (hh, seen, su, stmp) {
		uid_usage *u = usage_of(b, su->uid, false);
		if (!u)
			PROBLEM("uid %u owns %" PRIu64 " buffers that its usage does not count",
				su->uid, su->buffers);
		HASH_DELETE(hh, seen, su);
		free(su);
	}
	if (ntokens != b->ntokens)
		PROBLEM("%" PRIu64 " tokens counted, %" PRIu64 " live", b->ntokens, ntokens);
	/* Per-uid token counts, recounted into a scratch table. */
	uid_tokens *made = NULL, *mt, *mtmp, *ut;
	for (token *t = b->tokens; t; t = t->hh.next) {
		HASH_FIND(hh, made, &t->maker_uid, sizeof(t->maker_uid), mt);
		if (!mt) {
			if (!(mt = calloc(1, sizeof(*mt)))) {
				PROBLEM("check: out of memory");
				break;
			}
			mt->uid = t->maker_uid;
			HASH_ADD(hh, made, uid, sizeof(mt->uid), mt);
		}
		mt->tokens++;
	}
	for (ut = b->uid_tokens; ut; ut = ut->hh.next) {
		HASH_FIND(hh, made, &ut->uid, sizeof(ut->uid), mt);
		if (!mt || mt->tokens != ut->tokens)
			PROBLEM("uid %u is counted %" PRIu64 " live tokens but made %" PRIu64,
				ut->uid, ut->tokens, mt ? mt->tokens : 0);
	}
	HASH_ITER (hh, made, mt, mtmp) {
		HASH_FIND(hh, b->uid_tokens, &mt->uid, sizeof(mt->uid), ut);
		if (!ut)
			PROBLEM("uid %u made %" PRIu64 " live tokens that no per-uid count has",
				mt->uid, mt->tokens);
		HASH_DELETE(hh, made, mt);
		free(mt);
	}
	if (waits != b->nwaits)
		PROBLEM("%" PRIu64 " waits counted, %" PRIu64 " parked", b->nwaits, waits);
	if (conns != b->nconns)
		PROBLEM("%u connections counted, %" PRIu64 " open", b->nconns, conns);
#undef PROBLEM
out:
	free(rows.rows);
	return problems;
}

void broker_free(broker *b)
{
	if (b)
		b->j = NULL; /* freeing is no state change: the journal keeps the last state */
	if (!b)
		return;
	/* Connections first: their waiters and holdings go, and buffers that
	 * only they held are freed. Then tokens, which free the rest. */
	while (b->conns)
		broker_conn_close(b, b->conns);
	while (b->token_fifo) {
		token *t = b->token_fifo;
		broker_buf *buf = t->buf;
		token_forget(b, t);
		drop_refs(b, buf, 1);
	}
	/* Nothing can remain; if accounting were wrong, free what is left
	 * rather than leak it. Each free may move entries (and shrink the
	 * table), so every round starts from the first slot again. */
	idmap_slot *s;
	while ((s = idmap_next(&b->by_id, NULL))) {
		broker_buf *buf = s->item;
		buf->refs = 1;
		drop_refs(b, buf, 1);
	}
	idmap_free(&b->by_id);
	uid_usage *u, *utmp;
	HASH_ITER (hh, b->uids, u, utmp) {
		HASH_DELETE(hh, b->uids, u);
		free(u);
	}
	uid_tokens *ut, *uttmp;
	HASH_ITER (hh, b->uid_tokens, ut, uttmp) {
		HASH_DELETE(hh, b->uid_tokens, ut);
		free(ut);
	}
	free(b);
}

/* ---- the public mutators: one journal transaction each ------------------- */

int broker_alloc(broker *b, broker_conn *conn, const broker_alloc_req *req, broker_buf **out,
		 broker_error *err)
{
	int rc = alloc_op(b, conn, req, out, err);
	if (rc == BACKEND_GROW)
		conn->noted_request = 0; /* parked: applied when it is retried */
	else
		JRESULT(b, conn, rc, rc ? NULL : *out, NULL);
	JEND(b, conn);
	return rc;
}

int broker_open_id(broker *b, broker_conn *conn, uint64_t id, broker_buf **out, broker_error *err)
{
	int rc = open_id_op(b, conn, id, out, err);
	JRESULT(b, conn, rc, rc ? NULL : *out, NULL);
	JEND(b, conn);
	return rc;
}

int broker_retain(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		  uint32_t *held_out, broker_error *err)
{
	int rc = retain_op(b, conn, id, count, refs_out, held_out, err);
	JEND(b, conn);
	return rc;
}

int broker_release(broker *b, broker_conn *conn, uint64_t id, uint32_t count, uint64_t *refs_out,
		   uint32_t *held_out, broker_error *err)
{
	int rc = release_op(b, conn, id, count, refs_out, held_out, err);
	JEND(b, conn);
	return rc;
}

int broker_take(broker *b, broker_conn *conn, uint64_t id, bool retain,
		unsigned char out[BB_TOKEN_SIZE], broker_error *err)
{
	int rc = take_op(b, conn, id, retain, out, err);
	JRESULT(b, conn, rc, NULL, rc ? NULL : out);
	JEND(b, conn);
	return rc;
}

int broker_adopt(broker *b, broker_conn *conn, const unsigned char tok[BB_TOKEN_SIZE],
		 broker_buf **out, broker_error *err)
{
	int rc = adopt_op(b, conn, tok, out, err);
	JRESULT(b, conn, rc, rc ? NULL : *out, NULL);
	JEND(b, conn);
	return rc;
}

int broker_set_ready(broker *b, broker_conn *conn, uint64_t id, broker_error *err)
{
	int rc = set_ready_op(b, conn, id, err);
	JEND(b, conn);
	return rc;
}

int broker_set_error(broker *b, broker_conn *conn, uint64_t id, const char *message,
		     broker_error *err)
{
	int rc = set_error_op(b, conn, id, message, err);
	JEND(b, conn);
	return rc;
}

uint64_t broker_expire_tokens(broker *b)
{
	uint64_t next = expire_tokens_op(b);
	JEND(b, NULL);
	return next;
}

void broker_conn_note_request(broker_conn *conn, uint64_t id)
{
	conn->noted_request = id;
}

void broker_conn_seen(broker_conn *conn, uint64_t id)
{
	applied(conn, id);
}

uint64_t broker_journal_errors(const broker *b)
{
	return b->jerrors;
}

/* ---- restore from a journal ------------------------------------------------- */

static int compare_session_id(const void *key, const void *item)
{
	uint64_t id = *(const uint64_t *)key;
	uint64_t other = ((const journal_session *)item)->id;
	return id < other ? -1 : id > other;
}

static int compare_token_deadline(const void *x, const void *y)
{
	const journal_token *a = x, *c = y;
	return a->deadline_ms < c->deadline_ms ? -1 : a->deadline_ms > c->deadline_ms;
}

/* The connection of restored session id (conns[i] is sessions[i]'s). */
static broker_conn *restored_conn(const journal_state *s, broker_conn **conns, uint64_t id)
{
	const journal_session *r =
		bsearch(&id, s->sessions, s->n_sessions, sizeof(*s->sessions), compare_session_id);
	return r ? conns[r - s->sessions] : NULL;
}

/* The backend of a buffer whose memory was lost at a restart: nothing to
 * free, nothing to export. */
static void gone_free(backend *be, backend_mem *mem)
{
	(void)be;
	(void)mem;
}

static int gone_export(backend *be, const backend_mem *mem, backend_export *out, char *err,
		       size_t errlen)
{
	(void)be;
	(void)mem;
	(void)out;
	snprintf(err, errlen, "its memory did not survive the daemon's restart");
	return BB_ERR_FAILED;
}

static backend gone_backend = {.name = "gone", .free = gone_free, .export_mem = gone_export};

static int restore_buffer(broker *b, const journal_buffer *r, broker_conn *producer,
			  broker_restore_mem mem, void *ctx, broker_error *err)
{
	backend *be = r->kind < BROKER_KINDS ? b->be[r->kind] : NULL;
	bool lost = r->flags & JOURNAL_BUF_LOST;
	if (r->device < INT16_MIN || r->device > INT16_MAX)
		return fail(err, BB_ERR_PROTOCOL, "buffer %" PRIu64 ": device %d out of range",
			    r->id, (int)r->device);

	/* Sized by the byte the record keeps (journal_check refuses a kind
	 * beyond VMM; this holds without it). */
	uint8_t handle = (uint8_t)r->cuda_handle;
	broker_buf *buf = calloc(1, buf_record_size(handle));
	if (!buf)
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	if (handle == BB_CUDA_HANDLE_VMM)
		*place_of(buf) = (buf_place){.allocation = r->allocation,
					     .offset = r->offset,
					     .allocation_size = r->allocation_size};
	if (r->name[0]) {
		size_t len = strlen(r->name);
		if (!(buf->name = calloc(1, sizeof(*buf->name) + len + 1))) {
			free(buf);
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		}
		buf->name->buf = buf;
		memcpy(buf->name->text, r->name, len + 1);
	}
	uid_usage *u = usage_of(b, r->owner_uid, true);
	char msg[BROKER_ERR_LEN] = "";
	buf->mem.fd = -1;
	int rc = !u     ? BB_ERR_NO_MEMORY
		 : lost ? BROKER_RESTORE_LOST
			: mem(ctx, be, r, &buf->mem, msg, sizeof(msg));
	if (rc == BROKER_RESTORE_LOST) {
		/* Kept as a record, FAILED, so that its holders learn why. */
		rc = 0;
		lost = true;
		be = &gone_backend;
		buf->mem = (backend_mem){.fd = -1};
		if (!(r->flags & JOURNAL_BUF_LOST))
			b->restored_lost++;
	}
	if (rc) {
		fail(err, rc, "buffer %" PRIu64 ": %s", r->id, msg[0] ? msg : "no memory for it");
		free(buf->name);
		free(buf);
		return rc;
	}
	buf->id = r->id;
	buf->size = r->size;
	buf->kind = (uint8_t)r->kind;
	buf->device = (int16_t)r->device;
	buf->state = (uint8_t)r->state;
	buf->flags = (uint8_t)(r->flags & (BUF_IMPORTED | BUF_EXPOSED | BUF_LOST));
	buf->owner_uid = r->owner_uid;
	buf->owner_gid = r->owner_gid;
	buf->share = (uint8_t)r->share;
	buf->cuda_handle = handle;
	buf->created_ms = now(b);
	buf->be = be;
	buf->jslot = JOURNAL_NO_SLOT;
	const char *error = r->error;
	if (lost && !(r->flags & JOURNAL_BUF_LOST)) {
		/* Lost now: FAILED with why (one that had failed already keeps
		 * its own message: that is what its producer said). */
		if (r->state != BB_FAILED)
			error = msg[0] ? msg : "its memory was not kept across the restart";
		buf->state = BB_FAILED;
		buf->flags |= BUF_LOST;
	}
	if (buf->state == BB_FAILED && !(buf->error = strdup(error)))
		buf->error = error_unstored;
	if (idmap_insert(&b->by_id, buf, 0)) {
		be->free(be, &buf->mem);
		if (buf->error != error_unstored)
			free(buf->error);
		free(buf->name);
		free(buf);
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	}
	if (buf->name)
		HASH_ADD_KEYPTR(hh, b->by_name, buf->name->text, strlen(buf->name->text),
				buf->name);
	if (producer && buf->state == BB_PENDING) {
		buf->producer = producer;
		DL_APPEND2(producer->produced, buf, pprev, pnext);
	}
	b->restored++;
	if (lost) {
		if (u->buffers == 0) {
			HASH_DELETE(hh, b->uids, u);
			free(u);
		}
		return 0;
	}
	u->buffers++;
	u->bytes[buf->kind] += buf->size;
	b->buffers[buf->kind]++;
	b->bytes[buf->kind] += buf->size;
	b->cuda_buffers[buf->cuda_handle]++;
	b->cuda_bytes[buf->cuda_handle] += buf->size;
	keep(b, buf, true);
	return 0;
}

static int restore_token(broker *b, const journal_token *r, broker_conn *maker, broker_error *err)
{
	broker_buf *buf = find_buf(b, r->buffer);
	uid_tokens *ut;
	HASH_FIND(hh, b->uid_tokens, &r->maker_uid, sizeof(r->maker_uid), ut);
	if (!ut) {
		if (!(ut = calloc(1, sizeof(*ut))))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		ut->uid = r->maker_uid;
		HASH_ADD(hh, b->uid_tokens, uid, sizeof(ut->uid), ut);
	}
	token *t = calloc(1, sizeof(*t));
	if (!t)
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	memcpy(t->bytes, r->token, sizeof(t->bytes));
	t->buf = buf;
	t->maker = maker;
	t->maker_uid = r->maker_uid;
	t->expires_ms = r->deadline_ms;
	t->jslot = JOURNAL_NO_SLOT;
	ut->tokens++;
	HASH_ADD(hh, b->tokens, bytes, sizeof(t->bytes), t);
	DL_APPEND(b->token_fifo, t);
	if (maker) {
		DL_APPEND2(maker->tokens, t, mprev, mnext);
		maker->ntokens++;
	}
	buf->tokens++;
	buf->refs++;
	b->ntokens++;
	return 0;
}

/* With b's journal on: the whole of b in one transaction. */
static void journal_everything(broker *b)
{
	broker_conn *conn;
	/* Room for every record at once (one extent per class, not a
	 * doubling series); should it fail, the puts grow the file as usual. */
	uint64_t small = b->ntokens;
	DL_FOREACH (b->conns, conn) {
		small += 1 + idmap_count(&conn->holdings);
		for (int i = 0; conn->results && i < JOURNAL_RESULT_RING; i++)
			small += conn->results[i].r.request != 0;
	}
	uint64_t big = idmap_count(&b->by_id);
	if (big <= UINT32_MAX && small <= UINT32_MAX)
		(void)journal_reserve(b->j, (uint32_t)big, (uint32_t)small);
	DL_FOREACH (b->conns, conn) {
		jput_session(b, conn);
		for (idmap_slot *h = idmap_next(&conn->holdings, NULL); h;
		     h = idmap_next(&conn->holdings, h))
			jput_hold(b, conn, &conn->holdings, h, h->value);
		for (int i = 0; conn->results && i < JOURNAL_RESULT_RING; i++)
			if (conn->results[i].r.request)
				jcheck(b, journal_put_result(b->j, &conn->results[i].jslot,
							     &conn->results[i].r));
	}
	for (idmap_slot *s = idmap_next(&b->by_id, NULL); s; s = idmap_next(&b->by_id, s))
		jput_buf(b, s->item);
	token *t;
	DL_FOREACH (b->token_fifo, t)
		jput_token(b, t);
	jend_slow(b, NULL);
}

static int restore_state(broker *b, const journal_state *s, broker_conn **conns,
			 broker_restore_mem mem, void *ctx, broker_error *err)
{
	int rc;
	for (size_t i = 0; i < s->n_sessions; i++) {
		const journal_session *r = &s->sessions[i];
		broker_conn *conn = calloc(1, sizeof(*conn));
		if (!conn)
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		conn->uid = r->uid;
		conn->gid = r->gid;
		conn->pid = r->pid;
		conn->minor = r->minor;
		conn->opened_ms = now(b);
		conn->broker = b;
		conn->session = r->id;
		conn->last_request = r->last_request;
		conn->applied_mask = r->applied_mask;
		conn->jslot = JOURNAL_NO_SLOT;
		/* Absent until resumed; a deadline kept from an earlier start
		 * stands (a second crash does not extend it). */
		conn->absent = true;
		conn->grace_ms = r->grace_ms ? r->grace_ms : now(b) + b->grace_ms;
		if (!conn->grace_ms)
			conn->grace_ms = 1; /* 0 would read as connected */
		b->nabsent++;
		memcpy(conn->secret, r->secret, sizeof(conn->secret));
		DL_APPEND(b->conns, conn);
		b->nconns++;
		conns[i] = conn;
		if (b->j)
			(void)idmap_aux_on(&conn->holdings); /* owns no memory yet: cannot fail */
		if (b->j && conn_results_new(conn))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	}
	for (size_t i = 0; i < s->n_results; i++) {
		const journal_result *r = &s->results[i];
		broker_conn *conn = restored_conn(s, conns, r->session);
		if (conn && conn->results)
			conn->results[r->request % JOURNAL_RESULT_RING].r = *r;
	}
	/* Tables sized once for what comes (hints: inserts grow them as
	 * usual should this fail). */
	if (s->n_buffers <= UINT32_MAX - idmap_count(&b->by_id))
		(void)idmap_reserve(&b->by_id, idmap_count(&b->by_id) + (uint32_t)s->n_buffers);
	for (size_t i = 0; i < s->n_buffers; i++) {
		const journal_buffer *r = &s->buffers[i];
		broker_conn *producer = r->producer ? restored_conn(s, conns, r->producer) : NULL;
		if ((rc = restore_buffer(b, r, producer, mem, ctx, err)))
			return rc;
	}
	broker_conn *conn = NULL;
	for (size_t i = 0; i < s->n_holds; i++) {
		const journal_hold *r = &s->holds[i];
		/* Sorted by session: one lookup and one sizing per session. */
		if (!i || r->session != s->holds[i - 1].session) {
			conn = restored_conn(s, conns, r->session);
			size_t run = 1;
			while (i + run < s->n_holds && s->holds[i + run].session == r->session)
				run++;
			if (run <= UINT32_MAX - idmap_count(&conn->holdings))
				(void)idmap_reserve(&conn->holdings,
						    idmap_count(&conn->holdings) + (uint32_t)run);
		}
		broker_buf *buf = find_buf(b, r->buffer);
		uint64_t alloc = fd_allocation(buf);
		if (alloc && conn_allocation_add(conn, alloc, 1))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		if (idmap_insert(&conn->holdings, buf, r->count))
			return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
		buf->refs += r->count;
	}
	/* The FIFO is oldest first: by deadline, which is creation + TTL. */
	if (s->n_tokens > 1) /* no NULL array to qsort (UBSan) */
		qsort(s->tokens, s->n_tokens, sizeof(*s->tokens), compare_token_deadline);
	for (size_t i = 0; i < s->n_tokens; i++) {
		const journal_token *r = &s->tokens[i];
		broker_conn *maker = r->session ? restored_conn(s, conns, r->session) : NULL;
		if ((rc = restore_token(b, r, maker, err)))
			return rc;
	}
	b->next_id = s->ids.next_buffer;
	b->next_session = s->ids.next_session;
	return 0;
}

/* Back to an empty broker after a failed restore, writing nothing. */
static void restore_undo(broker *b)
{
	journal *j = b->j;
	b->j = NULL;
	while (b->conns)
		broker_conn_close(b, b->conns);
	while (b->token_fifo) {
		broker_buf *buf = b->token_fifo->buf;
		token_forget(b, b->token_fifo);
		drop_refs(b, buf, 1);
	}
	/* Buffers no hold or token reached (a failure half way). */
	idmap_slot *s;
	while ((s = idmap_next(&b->by_id, NULL)))
		destroy(b, s->item);
	b->j = j;
	b->restored = b->restored_lost = 0;
}

/* The monotonic clock in microseconds: the restore's phases (a measurement,
 * not the broker's clock). */
static uint64_t restore_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

int broker_restore(broker *b, int fd, broker_restore_mem mem, void *ctx, broker_error *err)
{
	char msg[BROKER_ERR_LEN];
	journal_state s;
	broker_restore_times *tm = &b->restore_times;
	memset(tm, 0, sizeof(*tm));
	uint64_t t = restore_us(), t1;
	int rc = journal_read(fd, &s, msg, sizeof(msg));
	t1 = restore_us();
	tm->read_us = t1 - t;
	t = t1;
	if (rc)
		return fail(err, rc, "the journal is refused: %s", msg);
	int bad = journal_check(&s, msg, sizeof(msg));
	t1 = restore_us();
	tm->check_us = t1 - t;
	t = t1;
	if (bad) {
		journal_state_free(&s);
		return fail(err, BB_ERR_PROTOCOL, "the journal's state does not hold together: %s",
			    msg);
	}
	broker_conn **conns = calloc(s.n_sessions ? s.n_sessions : 1, sizeof(*conns));
	if (!conns) {
		journal_state_free(&s);
		return fail(err, BB_ERR_NO_MEMORY, "daemon out of memory");
	}
	rc = restore_state(b, &s, conns, mem, ctx, err);
	free(conns);
	journal_state_free(&s);
	t1 = restore_us();
	tm->rebuild_us = t1 - t;
	t = t1;
	if (!rc && broker_check(b, msg, sizeof(msg)))
		rc = fail(err, BB_ERR_PROTOCOL, "the rebuilt broker does not check: %s", msg);
	t1 = restore_us();
	tm->broker_check_us = t1 - t;
	t = t1;
	if (rc) {
		restore_undo(b);
		return rc;
	}
	if (b->j)
		journal_everything(b);
	tm->journal_us = restore_us() - t;
	return 0;
}

void broker_restore_times_get(const broker *b, broker_restore_times *out)
{
	*out = b->restore_times;
}

/* ---- sessions across a restart ------------------------------------------- */

uint64_t broker_conn_session(const broker_conn *conn)
{
	return conn->session;
}

bool broker_conn_absent(const broker_conn *conn)
{
	return conn->absent;
}

uint32_t broker_absent_sessions(const broker *b)
{
	return b->nabsent;
}

uint32_t broker_release_absent(broker *b)
{
	if (!b->nabsent)
		return 0;
	uint64_t t = now(b);
	uint32_t n = 0;
	broker_conn *conn, *tmp;
	DL_FOREACH_SAFE (b->conns, conn, tmp) {
		if (conn->absent && conn->grace_ms <= t) {
			broker_conn_close(b, conn); /* as a disconnect, one transaction */
			n++;
		}
	}
	return n;
}

uint64_t broker_next_grace(const broker *b)
{
	uint64_t next = 0;
	if (!b->nabsent)
		return 0;
	for (const broker_conn *conn = b->conns; conn; conn = conn->next)
		if (conn->absent && (!next || conn->grace_ms < next))
			next = conn->grace_ms;
	return next;
}

void broker_set_grace(broker *b, uint64_t grace_ms)
{
	b->grace_ms = grace_ms;
}

void broker_restored(const broker *b, uint64_t *buffers, uint64_t *lost)
{
	*buffers = b->restored;
	*lost = b->restored_lost;
}

void broker_conn_secret(const broker_conn *conn, unsigned char out[BB_TOKEN_SIZE])
{
	memcpy(out, conn->secret, BB_TOKEN_SIZE);
}

bool broker_keeps_state(const broker *b)
{
	return b->j != NULL;
}

/* Equal, in a time that does not depend on where they differ. */
static bool secret_equal(const unsigned char *a, const unsigned char *c, size_t n)
{
	volatile unsigned char d = 0;
	for (size_t i = 0; i < n; i++)
		d |= a[i] ^ c[i];
	return d == 0;
}

int broker_session_resume(broker *b, uint64_t session, const unsigned char *secret,
			  size_t secret_len, uint32_t uid, broker_conn **out, uint64_t *floor,
			  uint64_t *mask, broker_error *err)
{
	broker_conn *conn;
	DL_FOREACH (b->conns, conn)
		if (conn->session == session)
			break;
	bool secret_ok = conn && b->j && secret_len == BB_TOKEN_SIZE && secret &&
			 secret_equal(secret, conn->secret, BB_TOKEN_SIZE);
	if (!conn || !b->j || (!conn->absent && !secret_ok))
		/* A live session of another client: the one asked for is not
		 * here (a daemon that started without its state numbers its
		 * sessions from 1 again). */
		return fail(err, BB_ERR_NOT_FOUND,
			    "session %" PRIu64 " is not known: released after the grace period, "
			    "or the daemon started without its state",
			    session);
	if (!secret_ok)
		return fail(err, BB_ERR_DENIED,
			    "the secret does not resume session %" PRIu64
			    " (HelloReply.session_secret, 16 bytes)",
			    session);
	if (uid != conn->uid)
		return fail(err, BB_ERR_DENIED,
			    "session %" PRIu64 " belongs to another uid than %" PRIu32, session,
			    uid);
	if (!conn->absent)
		return fail(err, BB_ERR_EXISTS,
			    "session %" PRIu64 " is attached to a live connection", session);
	conn->absent = false;
	conn->grace_ms = 0;
	b->nabsent--;
	conn->resumed = true;
	conn->opened_ms = now(b);
	jput_session(b, conn);
	jend_slow(b, NULL);
	*out = conn;
	*floor = conn->last_request;
	*mask = conn->applied_mask;
	return 0;
}

static bool id_applied(const broker_conn *conn, uint64_t id)
{
	if (id <= conn->last_request)
		return true;
	uint64_t ahead = id - conn->last_request - 1;
	return ahead < 64 && (conn->applied_mask >> ahead & 1);
}

bool broker_conn_applied(broker *b, broker_conn *conn, uint64_t id, broker_applied *out)
{
	if (__builtin_expect(!conn->resumed, 1) || !id_applied(conn, id))
		return false;
	memset(out, 0, sizeof(*out));
	const conn_result *x = conn->results ? &conn->results[id % JOURNAL_RESULT_RING] : NULL;
	if (x && x->r.request == id) {
		out->found = true;
		out->status = x->r.status;
		memcpy(out->token, x->r.token, sizeof(out->token));
		if (x->r.buffer && find_holding(conn, x->r.buffer))
			out->buf = find_buf(b, x->r.buffer);
	}
	return true;
}
