/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The request layer: sessions, and one function per op that turns a
 * decoded Request into broker calls and an answer through the session's
 * reply interface.
 */
#include "handler.h"

#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <utlist.h>

#include "kinds.h"
#include "log.h"
#include "ops.h"
#include "status.h"
#include "utf8.h"
#include "wire.h"

/* Connections of peers that no allow-list admits, waiting for the Hello
 * that gets their refusal; beyond this many, the next is refused at once. */
#define HANDLER_DENIED_PENDING_MAX 64

struct handler {
	uv_loop_t *loop;             /* timers */
	const snapshot_sources *src; /* broker, backends: what the snapshot reads */
	broker *b;                   /* src->b */
	park *park;                  /* parked waits and allocs */
	metrics_counters *counters;  /* requests answered, refusals */
	uint32_t max_datagram;       /* the most one answer may hold */
	uv_timer_t token_timer;      /* next token expiry */
	uint32_t denied_pending;     /* denied sessions not yet closed */
	bool stopping;               /* handler_stop was called */
	handler_upgrade upgrade;     /* the Upgrade op's hooks; prepare NULL: unsupported */
	session *sessions;           /* open sessions, in connection-number order */
};

/* One client connection, as the request layer sees it. */
struct session {
	handler *h;             /* owner */
	handler_reply reply;    /* how it answers */
	uint64_t serial;        /* connection number, for logs */
	uint32_t uid, gid, pid; /* SO_PEERCRED */
	char name[64];          /* Hello.client_name, for logs */
	bool hello;             /* Hello accepted */
	bool resumed;           /* its Hello resumed a restored session */
	uint32_t minor;         /* protocol minor version it speaks (at most ours) */
	bool denied;            /* no allow-list admits the peer: its first request is refused */
	broker_conn *bc;        /* the broker's view of it; NULL when denied or refused */
	park_wait *waits;       /* its parked Waits */
	uint32_t parked_allocs; /* its Allocs parked in the lot */
	uint32_t parked;        /* parked requests: waits and allocs */
	session *prev, *next;   /* handler's list */
};

/* The request being answered. */
typedef struct req_ctx {
	session *c;  /* who asked */
	uint64_t id; /* Request.id */
	bool quiet;  /* Request.no_reply */
	int opc;     /* Request.op_case, for metrics */
} req_ctx;

/* Tests only (bufbrokerd(8), BUFBROKERD_TEST_CRASH_AFTER=N): the daemon
 * kills itself after the commit and before the answer of its Nth
 * state-changing request, so that the exactly-once tests can crash it at
 * the one point where a client cannot tell whether its request was
 * applied. 0: off. */
static uint64_t crash_after, crash_count;
static bool crash_armed;
static const char *crash_once; /* BUFBROKERD_TEST_CRASH_ONCE: a file made when it fires */

static void crash_point(void)
{
	if (__builtin_expect(crash_armed, 0)) {
		log_warn("event=test_crash_point request=%llu", (unsigned long long)crash_count);
		if (crash_once)
			close(open(crash_once, O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
		raise(SIGKILL);
	}
}

/* Send a response that is just a status. */
static void send_status(session *c, uint64_t req_id, int code, const char *msg)
{
	crash_point();
	Bufbroker__Response r = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	st.code = code;
	st.message = (char *)(msg ? msg : "");
	r.id = req_id;
	r.status = &st;
	c->reply.send(c->reply.ctx, &r, -1);
}

static void close_after(session *c, const char *why)
{
	c->reply.close_after(c->reply.ctx, why);
}

/* The session's parked count changed by delta: tell the transport. */
static void parked_add(session *c, int delta)
{
	c->parked = (uint32_t)((int)c->parked + delta);
	c->reply.parked(c->reply.ctx, c->parked);
}

static void on_token_timer(uv_timer_t *t)
{
	handler *h = t->data;
	uint64_t next = broker_expire_tokens(h->b);
	if (next != UINT64_MAX)
		uv_timer_start(&h->token_timer, on_token_timer, next, 0);
}

/* Tokens were made or ended (Take, Adopt, a closed session): make sure the
 * token timer fires when the oldest live one expires. */
static void tokens_changed(handler *h)
{
	if (h->stopping)
		return;
	/* Tokens expire oldest first; the timer only needs to track the
	 * oldest. Recompute from the broker, which also expires overdue ones. */
	uint64_t next = broker_expire_tokens(h->b);
	if (next == UINT64_MAX)
		uv_timer_stop(&h->token_timer);
	else if (!uv_is_active((uv_handle_t *)&h->token_timer) ||
		 uv_timer_get_due_in(&h->token_timer) > next)
		uv_timer_start(&h->token_timer, on_token_timer, next, 0);
}

void handler_restored(handler *h)
{
	tokens_changed(h);
}

static void reply_error(req_ctx *r, int code, const char *msg)
{
	session *c = r->c;
	metrics_answered(c->h->counters, r->opc, code);
	if (code != BB_ERR_TIMEOUT && log_enabled(LOG_INFO)) {
		char esc[512];
		log_info("event=request_failed conn=%llu uid=%u pid=%u op=%s code=%s error=\"%s\"",
			 (unsigned long long)c->serial, c->uid, c->pid, bb_op_name(r->opc),
			 bb_err_name(code), log_escape(msg, esc, sizeof(esc)));
	}
	if (!r->quiet)
		send_status(c, r->id, code, msg);
}

static void reply(req_ctx *r, Bufbroker__Response *resp, int fd)
{
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	metrics_answered(r->c->h->counters, r->opc, BB_OK);
	if (r->quiet)
		return;
	crash_point();
	st.message = "";
	resp->id = r->id;
	resp->status = &st;
	r->c->reply.send(r->c->reply.ctx, resp, fd);
}

static void reply_ok(req_ctx *r)
{
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	reply(r, &resp, -1);
}

static void fill_info(Bufbroker__BufferInfo *bi, const broker_info *in)
{
	bufbroker__buffer_info__init(bi);
	bi->id = in->id;
	bi->size = in->size;
	bi->kind = (Bufbroker__Kind)in->kind;
	bi->device = in->device;
	bi->state = (Bufbroker__State)in->state;
	bi->refs = in->refs;
	bi->name = (char *)in->name;
	bi->error = (char *)in->error;
	bi->owner_uid = in->owner_uid;
	bi->owner_gid = in->owner_gid;
	bi->share = (uint32_t)in->share;
	bi->tokens = in->tokens;
	bi->age_ms = in->age_ms;
	bi->held = in->held;
	bi->cuda_handle = (Bufbroker__CudaHandle)in->cuda_handle;
}

/* Answer with a Grant for buf, the memory's fd attached. */
static void grant(req_ctx *r, broker_buf *buf)
{
	broker_granted gr;
	broker_error err;
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Grant g = BUFBROKER__GRANT__INIT;
	Bufbroker__BufferInfo bi;

	int rc = broker_grant(r->c->h->b, r->c->bc, buf, &gr, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	fill_info(&bi, &gr.info);
	g.info = &bi;
	if (gr.ex.has_ipc || gr.ex.cuda_handle == BB_CUDA_HANDLE_VMM) {
		if (gr.ex.has_ipc) {
			g.ipc_handle.data = gr.ex.ipc_handle;
			g.ipc_handle.len = sizeof(gr.ex.ipc_handle);
		} else {
			g.allocation_size = gr.ex.allocation_size;
			g.allocation_fd = gr.allocation_fd;
		}
		g.offset = gr.ex.offset;
		g.device_uuid.data = gr.ex.device_uuid;
		g.device_uuid.len = sizeof(gr.ex.device_uuid);
		g.allocation = gr.ex.allocation;
	}
	resp.result_case = BUFBROKER__RESPONSE__RESULT_GRANT;
	resp.grant = &g;
	reply(r, &resp, gr.ex.fd);
}

/* ---- ops --------------------------------------------------------------------- */

static void do_hello(req_ctx *r, const Bufbroker__Hello *h)
{
	session *c = r->c;
	char msg[160];
	if (c->hello) {
		reply_error(r, BB_ERR_PROTOCOL, "Hello was already sent on this connection");
		return;
	}
	if (h->version_major != BB_PROTO_MAJOR) {
		snprintf(msg, sizeof(msg),
			 "protocol version %u.%u is not supported; this daemon speaks %d.%d",
			 h->version_major, h->version_minor, BB_PROTO_MAJOR, BB_PROTO_MINOR);
		reply_error(r, BB_ERR_PROTOCOL, msg);
		close_after(c, "protocol version mismatch");
		return;
	}
	uint64_t floor = 0, mask = 0;
	if (h->resume_session || h->resume_secret.len) {
		broker_conn *restored;
		broker_error err;
		int rc = broker_session_resume(c->h->b, h->resume_session, h->resume_secret.data,
					       h->resume_secret.len, c->uid, &restored, &floor,
					       &mask, &err);
		log_info("event=session_resume conn=%llu uid=%u pid=%u session=%llu code=%s",
			 (unsigned long long)c->serial, c->uid, c->pid,
			 (unsigned long long)h->resume_session, bb_err_name(rc));
		if (rc) {
			reply_error(r, rc, err.msg); /* unhelloed: a plain Hello may follow */
			return;
		}
		/* The empty connection opened at accept goes; the restored one,
		 * with its holds, tokens and PENDING buffers, is this one's. */
		if (c->bc)
			broker_conn_close(c->h->b, c->bc);
		c->bc = restored;
		c->resumed = true;
	}
	c->hello = true;
	/* What it can be granted: a client older than 1.2 cannot map VMM
	 * buffers. */
	c->minor = h->version_minor < BB_PROTO_MINOR ? h->version_minor : BB_PROTO_MINOR;
	if (c->bc)
		broker_conn_set_minor(c->bc, c->minor);
	/* Kept whole characters only: Clients answers carry it (UTF-8). */
	const char *name = h->client_name ? h->client_name : "";
	size_t n = bb_utf8_prefix(name, sizeof(c->name) - 1);
	memcpy(c->name, name, n);
	c->name[n] = '\0';
	/* Keep log lines parseable: no quotes or control characters. */
	for (char *p = c->name; *p; p++)
		if ((unsigned char)*p < 0x20 || *p == '"' || *p == '\\')
			*p = '?';
	log_debug("event=hello conn=%llu uid=%u pid=%u client=\"%s\" version=%u.%u",
		  (unsigned long long)c->serial, c->uid, c->pid, c->name, h->version_major,
		  h->version_minor);

	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__HelloReply hr = BUFBROKER__HELLO_REPLY__INIT;
	hr.version_major = BB_PROTO_MAJOR;
	hr.version_minor = BB_PROTO_MINOR;
	hr.server_version = BB_VERSION_STRING;
	hr.uid = c->uid;
	hr.gid = c->gid;
	hr.pid = c->pid;
	hr.max_datagram = c->h->max_datagram;
	unsigned char secret[BB_TOKEN_SIZE];
	if (broker_keeps_state(c->h->b) && c->bc) {
		/* The session and what resumes it after a restart. */
		hr.session_id = broker_conn_session(c->bc);
		broker_conn_secret(c->bc, secret);
		hr.session_secret.data = secret;
		hr.session_secret.len = sizeof(secret);
		hr.resumed = c->resumed;
		hr.last_applied = floor;
		hr.applied_mask = mask;
	}
	resp.result_case = BUFBROKER__RESPONSE__RESULT_HELLO;
	resp.hello = &hr;
	reply(r, &resp, -1);
}

/* Allocate and answer, or BACKEND_GROW (nothing answered) when the backend
 * is making the memory. */
static int alloc_try(req_ctx *r, uint64_t size, int kind, int32_t device, const char *name,
		     uint32_t share, int cuda_handle, int fd)
{
	broker_error err;
	broker_buf *buf;
	bool handle_refused = false;
	if (share > BB_SHARE_ANY) {
		/* The broker's int cannot hold every uint32 the wire can. */
		char msg[64];
		snprintf(msg, sizeof(msg), "unknown share policy %" PRIu32, share);
		reply_error(r, BB_ERR_INVALID, msg);
		return BB_ERR_INVALID;
	}
	if (r->c->minor < 2 && kind == BB_CUDA) {
		/* A 1.1 client maps legacy handles only: what it gets, whatever
		 * the daemon's default (it cannot ask for a kind). */
		cuda_handle = BB_CUDA_HANDLE_LEGACY;
	}
	broker_alloc_req req = {
		.size = size,
		.kind = (bb_kind)kind,
		.device = device,
		.name = name,
		.share = (int)share,
		.import_fd = fd,
		.cuda_handle = cuda_handle,
		.handle_refused = &handle_refused,
	};
	int rc = broker_alloc(r->c->h->b, r->c->bc, &req, &buf, &err);
	if (rc == BACKEND_GROW)
		return rc;
	if (rc == BB_ERR_UNSUPPORTED && handle_refused && r->c->minor < 2) {
		/* Legacy, the one kind it maps, cannot be had: say why the
		 * other kind would not do either. */
		size_t n = strlen(err.msg);
		snprintf(err.msg + n, sizeof(err.msg) - n,
			 "; this client speaks protocol 1.%u, which maps legacy CUDA buffers "
			 "only: upgrade libbufbroker",
			 r->c->minor);
	}
	if (rc) {
		reply_error(r, rc, err.msg);
		return rc;
	}
	log_debug("event=alloc conn=%llu uid=%u size=%" PRIu64 " imported=%d",
		  (unsigned long long)r->c->serial, r->c->uid, size, fd >= 0);
	grant(r, buf);
	return 0;
}

static void do_alloc(req_ctx *r, uint64_t size, int kind, int32_t device, const char *name,
		     uint32_t share, int cuda_handle, int fd)
{
	session *c = r->c;
	if (alloc_try(r, size, kind, device, name, share, cuda_handle, fd) != BACKEND_GROW)
		return;
	/* The backend is making memory (a new CUDA slab): answer once a
	 * backend job is done. Later requests on this connection are answered
	 * meanwhile, as with Wait; the transport bounds how many park (it
	 * reads no further beyond its limit). */
	park_alloc pa = {
		.owner = c,
		.req_id = r->id,
		.quiet = r->quiet,
		.size = size,
		.kind = kind,
		.device = device,
		.share = share,
		.cuda_handle = cuda_handle,
		.name = (char *)name,
	};
	if (park_alloc_add(c->h->park, &pa)) {
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	c->parked_allocs++;
	parked_add(c, 1);
	log_debug("event=alloc_parked conn=%llu uid=%u size=%" PRIu64 " device=%d",
		  (unsigned long long)c->serial, c->uid, size, device);
}

/* A parked alloc left the lot (answered or dropped). */
static void alloc_unparked(session *c)
{
	c->parked_allocs--;
	parked_add(c, -1);
}

/* One parked alloc's retry: true when it was answered. */
static bool retry_alloc(void *ctx, const park_alloc *pa)
{
	handler *h = ctx;
	session *c = pa->owner;
	req_ctx r = {
		.c = c, .id = pa->req_id, .quiet = pa->quiet, .opc = BUFBROKER__REQUEST__OP_ALLOC};
	if (c->reply.closing(c->reply.ctx)) {
		metrics_answered(h->counters, r.opc, BB_ERR_DISCONNECTED);
		alloc_unparked(c);
		return true;
	}
	broker_conn_note_request(c->bc, pa->req_id); /* applied with its effect */
	if (alloc_try(&r, pa->size, pa->kind, pa->device, pa->name, pa->share, pa->cuda_handle,
		      -1) == BACKEND_GROW)
		return false;
	alloc_unparked(c);
	return true;
}

void handler_retry_allocs(handler *h)
{
	if (h->stopping || !park_allocs_count(h->park))
		return;
	park_allocs_retry(h->park, retry_alloc, h);
}

static void do_open(req_ctx *r, const Bufbroker__Open *o)
{
	broker *b = r->c->h->b;
	broker_error err;
	broker_buf *buf;
	int rc;
	if (o->target_case == BUFBROKER__OPEN__TARGET_NAME)
		rc = broker_open_name(b, r->c->bc, o->name, &buf, &err);
	else if (o->target_case == BUFBROKER__OPEN__TARGET_ID)
		rc = broker_open_id(b, r->c->bc, o->id, &buf, &err);
	else
		rc = BB_ERR_INVALID,
		snprintf(err.msg, sizeof(err.msg), "Open needs an id or a name");
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	grant(r, buf);
}

static void do_refs(req_ctx *r, uint64_t id, uint32_t count, bool retain)
{
	broker *b = r->c->h->b;
	broker_error err;
	uint64_t refs = 0;
	uint32_t held = 0;
	int rc = retain ? broker_retain(b, r->c->bc, id, count, &refs, &held, &err)
			: broker_release(b, r->c->bc, id, count, &refs, &held, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__RefsReply rr = BUFBROKER__REFS_REPLY__INIT;
	rr.refs = refs;
	rr.held = held;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_REFS;
	resp.refs = &rr;
	reply(r, &resp, -1);
}

static void do_take(req_ctx *r, const Bufbroker__Take *t)
{
	broker *b = r->c->h->b;
	broker_error err;
	unsigned char tok[BB_TOKEN_SIZE];
	int rc = broker_take(b, r->c->bc, t->id, t->retain, tok, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	tokens_changed(r->c->h);
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__TakeReply tr = BUFBROKER__TAKE_REPLY__INIT;
	tr.token.data = tok;
	tr.token.len = sizeof(tok);
	resp.result_case = BUFBROKER__RESPONSE__RESULT_TAKE;
	resp.take = &tr;
	reply(r, &resp, -1);
}

static void do_adopt(req_ctx *r, const Bufbroker__Adopt *a)
{
	broker *b = r->c->h->b;
	broker_error err;
	broker_buf *buf;
	if (a->token.len != BB_TOKEN_SIZE) {
		char msg[64];
		snprintf(msg, sizeof(msg), "a token is %d bytes, not %zu", BB_TOKEN_SIZE,
			 a->token.len);
		reply_error(r, BB_ERR_INVALID, msg);
		return;
	}
	int rc = broker_adopt(b, r->c->bc, a->token.data, &buf, &err);
	tokens_changed(r->c->h);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	grant(r, buf);
}

/* A VMM allocation's fd again, for a connection holding one of its
 * buffers. */
static void do_allocation_fd(req_ctx *r, const Bufbroker__AllocationFd *a)
{
	backend_export ex;
	broker_error err;
	int rc = broker_allocation_fd(r->c->h->b, r->c->bc, a->allocation, &ex, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__AllocationFdReply ar = BUFBROKER__ALLOCATION_FD_REPLY__INIT;
	ar.allocation = ex.allocation;
	ar.allocation_size = ex.allocation_size;
	ar.device_uuid.data = ex.device_uuid;
	ar.device_uuid.len = sizeof(ex.device_uuid);
	resp.result_case = BUFBROKER__RESPONSE__RESULT_ALLOCATION_FD;
	resp.allocation_fd = &ar;
	reply(r, &resp, ex.fd);
}

static void do_settle(req_ctx *r, uint64_t id, const char *error)
{
	broker *b = r->c->h->b;
	broker_error err;
	int rc = error ? broker_set_error(b, r->c->bc, id, error, &err)
		       : broker_set_ready(b, r->c->bc, id, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	reply_ok(r);
}

/* ---- Wait ------------------------------------------------------------------- */

/* Answer a Wait with the buffer's state. */
static void wait_reply(session *c, uint64_t req_id, bb_state state, const char *error)
{
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	Bufbroker__WaitReply wr = BUFBROKER__WAIT_REPLY__INIT;
	st.message = "";
	wr.state = (Bufbroker__State)state;
	wr.error = (char *)(error ? error : "");
	resp.id = req_id;
	resp.status = &st;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_WAIT;
	resp.wait = &wr;
	c->reply.send(c->reply.ctx, &resp, -1);
}

/* A parked wait ended (park.h): answer it, unless its session is going. */
static void wait_done(void *owner, uint64_t req_id, int code, bb_state state, const char *error)
{
	session *c = owner;
	metrics_answered(c->h->counters, BUFBROKER__REQUEST__OP_WAIT, code);
	if (code == 0)
		wait_reply(c, req_id, state, error);
	else if (code != BB_ERR_DISCONNECTED)
		send_status(c, req_id, code, error);
	parked_add(c, -1);
}

static void do_wait(req_ctx *r, const Bufbroker__Wait *wq)
{
	session *c = r->c;
	broker_error err;
	bb_state state;
	char error[256];
	if (r->quiet) {
		reply_error(r, BB_ERR_INVALID, "Wait cannot be no_reply");
		return;
	}
	int rc = park_wait_start(c->h->park, &c->waits, c->bc, wq->id, r->id, wq->timeout_ms,
				 wait_done, c, &state, error, &err);
	if (rc == 1) {
		metrics_answered(c->h->counters, r->opc, BB_OK);
		wait_reply(c, r->id, state, error);
	} else if (rc == BB_ERR_TIMEOUT) {
		metrics_answered(c->h->counters, r->opc, rc);
		send_status(c, r->id, rc, err.msg);
	} else if (rc < 0) {
		reply_error(r, rc, err.msg);
	} else {
		parked_add(c, 1);
	}
}

void handler_session_drop_parked(session *c)
{
	park_waits_drop(c->h->park, &c->waits);
	uint32_t n = park_allocs_drop(c->h->park, c);
	for (uint32_t i = 0; i < n; i++) {
		metrics_answered(c->h->counters, BUFBROKER__REQUEST__OP_ALLOC, BB_ERR_DISCONNECTED);
		alloc_unparked(c);
	}
}

/* ---- reporting ----------------------------------------------------------------- */

static void do_stat(req_ctx *r, const Bufbroker__Stat *st)
{
	broker *b = r->c->h->b;
	broker_error err;
	broker_info info;
	int rc;
	if (st->target_case == BUFBROKER__STAT__TARGET_NAME)
		rc = broker_stat_name(b, r->c->bc, st->name, &info, &err);
	else if (st->target_case == BUFBROKER__STAT__TARGET_ID)
		rc = broker_stat_id(b, r->c->bc, st->id, &info, &err);
	else
		rc = BB_ERR_INVALID,
		snprintf(err.msg, sizeof(err.msg), "Stat needs an id or a name");
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__BufferInfo bi;
	fill_info(&bi, &info);
	resp.result_case = BUFBROKER__RESPONSE__RESULT_INFO;
	resp.info = &bi;
	reply(r, &resp, -1);
}

/* Accumulates List rows until the next would overflow the datagram. */
typedef struct list_acc {
	uint64_t after_id; /* skip ids up to this */
	size_t budget;     /* bytes left for rows */
	size_t n, cap;     /* rows */
	broker_info *rows; /* copies (BufferInfo points into them) */
	bool truncated;    /* a row did not fit */
} list_acc;

static int list_row(const broker_info *info, void *arg)
{
	list_acc *a = arg;
	if (info->id <= a->after_id)
		return 0;
	Bufbroker__BufferInfo bi;
	fill_info(&bi, info);
	/* Row size plus its tag and length prefix. */
	size_t need = bufbroker__buffer_info__get_packed_size(&bi) + 4;
	if (need > a->budget) {
		a->truncated = true;
		return 1;
	}
	if (a->n == a->cap) {
		size_t cap = a->cap ? a->cap * 2 : 64;
		broker_info *rows = realloc(a->rows, cap * sizeof(*rows));
		if (!rows) {
			a->truncated = true;
			return 1;
		}
		a->rows = rows;
		a->cap = cap;
	}
	a->rows[a->n++] = *info;
	a->budget -= need;
	return 0;
}

static void do_list(req_ctx *r, const Bufbroker__List *l)
{
	broker *b = r->c->h->b;
	list_acc a = {.after_id = l->after_id, .budget = r->c->h->max_datagram - 64};
	broker_list(b, r->c->bc, list_row, &a);

	Bufbroker__BufferInfo *infos = calloc(a.n ? a.n : 1, sizeof(*infos));
	Bufbroker__BufferInfo **ptrs = calloc(a.n ? a.n : 1, sizeof(*ptrs));
	if (!infos || !ptrs) {
		free(infos);
		free(ptrs);
		free(a.rows);
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	for (size_t i = 0; i < a.n; i++) {
		fill_info(&infos[i], &a.rows[i]);
		ptrs[i] = &infos[i];
	}
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__ListReply lr = BUFBROKER__LIST_REPLY__INIT;
	lr.n_buffers = a.n;
	lr.buffers = ptrs;
	lr.truncated = a.truncated;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_LIST;
	resp.list = &lr;
	reply(r, &resp, -1);
	free(infos);
	free(ptrs);
	free(a.rows);
}

static void do_server_status(req_ctx *r)
{
	snapshot snap;
	if (snapshot_take(r->c->h->src, &snap, false) < 0) {
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	const broker_totals *t = &snap.totals;
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__ServerStatusReply ss = BUFBROKER__SERVER_STATUS_REPLY__INIT;
	Bufbroker__KindTotals kt[BB_KIND_COUNT], *ktp[BB_KIND_COUNT];
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		Bufbroker__KindTotals *x = &kt[k - 1];
		bufbroker__kind_totals__init(x);
		x->kind = (Bufbroker__Kind)k;
		x->buffers = t->buffers[k];
		x->bytes = t->bytes[k];
		ktp[k - 1] = x;
	}
	ss.server_version = BB_VERSION_STRING;
	ss.version_major = BB_PROTO_MAJOR;
	ss.version_minor = BB_PROTO_MINOR;
	ss.uptime_ms = snap.uptime_ms;
	ss.connections = t->connections;
	ss.n_kinds = BB_KIND_COUNT;
	ss.kinds = ktp;
	ss.tokens = t->tokens;
	ss.waits = t->waits;
	ss.pid = (uint32_t)getpid();
	ss.restarts = snap.restart.restarts;
	ss.restored_buffers = snap.restart.restored_buffers;
	ss.absent_sessions = snap.restart.absent_sessions;
	ss.journal_bytes = snap.restart.journal_bytes;
	ss.restart_protected = snap.restart.protected_by_store;
	ss.unprotected_buffers = snap.restart.unprotected;

	/* The devices, as many as a datagram holds (each row is < 500 bytes,
	 * vmm_unavailable included: 64 fit the default datagram). */
	Bufbroker__DeviceInfo di[SNAPSHOT_DEVICES_MAX], *dip[SNAPSHOT_DEVICES_MAX];
	int n = snap.n_devices;
	for (int i = 0; i < n; i++) {
		backend_device *d = &snap.devices[i];
		bufbroker__device_info__init(&di[i]);
		di[i].ordinal = d->ordinal;
		di[i].name = d->name;
		di[i].uuid.data = d->uuid;
		di[i].uuid.len = sizeof(d->uuid);
		di[i].total_bytes = d->total;
		di[i].free_bytes = d->free;
		di[i].used_bytes = d->used;
		di[i].reserved_bytes = d->reserved;
		di[i].limit_bytes = d->limit;
		di[i].vmm = d->vmm != 0;
		di[i].vmm_unavailable = d->vmm ? "" : d->vmm_why;
		di[i].vmm_allocations = d->vmm_allocations;
		dip[i] = &di[i];
	}
	ss.n_devices = (size_t)n;
	ss.devices = dip;
	ss.cuda = (char *)snap.cuda_why;

	resp.result_case = BUFBROKER__RESPONSE__RESULT_SERVER_STATUS;
	resp.server_status = &ss;
	reply(r, &resp, -1);
	snapshot_release(&snap);
}

/* ---- admin --------------------------------------------------------------------- */

/* The name of process pid as /proc/PID/comm gives it, or "-" when it cannot
 * be read (the process is gone, or lives in a PID namespace we cannot see).
 * Control characters become '?', as in log lines, and so do bytes that are
 * not UTF-8 (a process may name itself anything, and the kernel cuts the
 * name at 15 bytes, inside a character if need be). */
static void proc_comm(uint32_t pid, char *out, size_t cap)
{
	char path[48];
	snprintf(path, sizeof(path), "/proc/%u/comm", pid);
	FILE *f = pid ? fopen(path, "re") : NULL;
	if (!f || !fgets(out, (int)cap, f) || !out[0] || out[0] == '\n')
		snprintf(out, cap, "-");
	if (f)
		fclose(f);
	out[strcspn(out, "\n")] = '\0';
	for (char *p = out; *p; p++)
		if ((unsigned char)*p < 0x20 || *p == 0x7f)
			*p = '?';
	bb_utf8_scrub(out);
}

/* One Clients row and the text it points to. */
typedef struct client_row {
	Bufbroker__ClientInfo ci; /* points into process and the conn's name */
	char process[32];         /* /proc/PID/comm (16 bytes at most on Linux) */
} client_row;

static void do_clients(req_ctx *r, const Bufbroker__Clients *q)
{
	session *me = r->c;
	handler *h = me->h;
	/* Root sees every connection; others, their own uid's. */
	bool all = me->uid == 0;
	size_t n = 0, budget = h->max_datagram - 64;
	bool truncated = false;
	session *c;

	DL_FOREACH (h->sessions, c)
		n++;
	client_row *rows = calloc(n ? n : 1, sizeof(*rows));
	Bufbroker__ClientInfo **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
	if (!rows || !ptrs) {
		free(rows);
		free(ptrs);
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	n = 0;
	/* The list is in connection-number order: sessions are appended. */
	DL_FOREACH (h->sessions, c) {
		if (!c->bc || c->reply.closing(c->reply.ctx) || c->serial <= q->after_serial ||
		    (!all && c->uid != me->uid))
			continue;
		client_row *row = &rows[n];
		broker_conn_stats st;
		broker_conn_stats_get(h->b, c->bc, &st);
		proc_comm(c->pid, row->process, sizeof(row->process));
		bufbroker__client_info__init(&row->ci);
		row->ci.serial = c->serial;
		row->ci.uid = c->uid;
		row->ci.gid = c->gid;
		row->ci.pid = c->pid;
		row->ci.process = row->process;
		row->ci.client_name = c->name;
		row->ci.buffers = st.buffers;
		row->ci.bytes = st.bytes;
		row->ci.tokens = st.tokens;
		row->ci.waits = st.waits;
		row->ci.age_ms = st.age_ms;
		row->ci.self = c == me;
		/* Row size plus its tag and length prefix. */
		size_t need = bufbroker__client_info__get_packed_size(&row->ci) + 4;
		if (need > budget) {
			truncated = true;
			break;
		}
		budget -= need;
		ptrs[n] = &row->ci;
		n++;
	}
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__ClientsReply cr = BUFBROKER__CLIENTS_REPLY__INIT;
	cr.n_clients = n;
	cr.clients = ptrs;
	cr.truncated = truncated;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_CLIENTS;
	resp.clients = &cr;
	reply(r, &resp, -1);
	free(rows);
	free(ptrs);
}

/* Bytes of report the broker's check may write; later problems are only
 * counted. */
#define CHECK_REPORT_MAX (16 * 1024)

/* Append line and a newline to report (cap bytes, NUL-terminated) as far
 * as it fits. */
static void report_line(char *report, size_t cap, const char *line)
{
	size_t used = strlen(report);
	if (used + 1 < cap)
		snprintf(report + used, cap - used, "%s\n", line);
}

/* Checks the broker cannot make itself: its totals against what each
 * backend holds, and its connection and wait counts against the sessions'.
 * Appends a line per problem to report (cap bytes); returns how many. */
static int check_edges(handler *h, char *report, size_t cap)
{
	broker_totals t;
	int problems = 0;
	char line[256];

	broker_totals_get(h->b, &t);
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		backend *be = k == BB_HOST ? h->src->host : h->src->cuda;
		const char *kind = bb_kind_name(k);
		uint64_t n = 0, bytes = 0;
		if (!be && (t.buffers[k] || t.bytes[k])) {
			snprintf(line, sizeof(line),
				 "the broker counts %" PRIu64 " %s buffers (%" PRIu64
				 " bytes) but no %s backend serves them",
				 t.buffers[k], kind, t.bytes[k], kind);
		} else if (be && be->usage) {
			if (be->check) {
				size_t used = strlen(report);
				problems += be->check(be, report + used, cap - used);
			}
			be->usage(be, &n, &bytes);
			if (n == t.buffers[k] && bytes == t.bytes[k])
				continue;
			snprintf(line, sizeof(line),
				 "the %s backend holds %" PRIu64 " buffers of %" PRIu64
				 " bytes; the broker counts %" PRIu64 " of %" PRIu64,
				 kind, n, bytes, t.buffers[k], t.bytes[k]);
		} else {
			continue;
		}
		problems++;
		report_line(report, cap, line);
	}
	uint64_t conns = 0, waits = 0;
	session *c;
	DL_FOREACH (h->sessions, c) {
		if (!c->bc)
			continue;
		conns++;
		waits += park_waits_count(&c->waits);
	}
	/* Sessions restored from a kept state and not resumed have no socket. */
	uint32_t absent = broker_absent_sessions(h->b);
	if (conns + absent != t.connections || waits != t.waits) {
		snprintf(line, sizeof(line),
			 "the server has %" PRIu64
			 " connections (and %u absent sessions) with %" PRIu64
			 " parked waits; the broker counts %u with %" PRIu64,
			 conns, absent, waits, t.connections, t.waits);
		problems++;
		report_line(report, cap, line);
	}
	return problems;
}

int handler_check(handler *h, char *report, size_t cap)
{
	int problems = broker_check(h->b, report, cap);
	return problems + check_edges(h, report, cap);
}

/* Admin ops (Check, Upgrade) are for root and the daemon's own uid: true,
 * or false once r is answered BB_ERR_DENIED. */
static bool admin_allowed(req_ctx *r, const char *op)
{
	uint32_t daemon_uid = (uint32_t)geteuid();
	char msg[128];

	if (r->c->uid == 0 || r->c->uid == daemon_uid)
		return true;
	snprintf(msg, sizeof(msg), "%s is allowed to root and to uid %u (the daemon's)", op,
		 daemon_uid);
	reply_error(r, BB_ERR_DENIED, msg);
	return false;
}

static void do_check(req_ctx *r)
{
	session *me = r->c;
	handler *h = me->h;

	if (!admin_allowed(r, "Check"))
		return;
	char *report = malloc(CHECK_REPORT_MAX);
	char **lines = calloc(CHECK_REPORT_MAX / 2, sizeof(*lines));
	if (!report || !lines) {
		free(report);
		free(lines);
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	int problems = handler_check(h, report, CHECK_REPORT_MAX);

	broker_totals t;
	broker_totals_get(h->b, &t);
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__CheckReply cr = BUFBROKER__CHECK_REPLY__INIT;
	cr.problems = (uint32_t)problems;
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		cr.buffers += t.buffers[k];
		cr.bytes += t.bytes[k];
	}
	cr.connections = t.connections;
	/* One string per line, as many as fit in the datagram; problems
	 * still counts them all. */
	size_t budget = h->max_datagram - 128;
	char *save = NULL;
	for (char *ln = strtok_r(report, "\n", &save); ln; ln = strtok_r(NULL, "\n", &save)) {
		size_t need = strlen(ln) + 4;
		if (need > budget)
			break;
		budget -= need;
		lines[cr.n_report++] = ln;
	}
	cr.report = lines;
	if (problems)
		log_warn("event=check_failed conn=%llu uid=%u pid=%u problems=%d",
			 (unsigned long long)me->serial, me->uid, me->pid, problems);
	else
		log_debug("event=check_ok conn=%llu uid=%u buffers=%" PRIu64 " bytes=%" PRIu64
			  " connections=%u",
			  (unsigned long long)me->serial, me->uid, cr.buffers, cr.bytes,
			  t.connections);
	resp.result_case = BUFBROKER__RESPONSE__RESULT_CHECK;
	resp.check = &cr;
	reply(r, &resp, -1);
	free(lines);
	free(report);
}

/* Upgrade: the preflight runs here (the loop waits for it, at most
 * UPGRADE_PREFLIGHT_MS); a binary that passes is answered 0 and executed
 * once this loop turn ends (docs/RESTART.md, "Planned upgrade by execve"). */
static void do_upgrade(req_ctx *r, const Bufbroker__Upgrade *u)
{
	session *me = r->c;
	handler *h = me->h;
	char why[768], esc[800];

	if (!admin_allowed(r, "Upgrade"))
		return;
	if (!h->upgrade.prepare) {
		reply_error(
			r, BB_ERR_UNSUPPORTED,
			"the daemon keeps no state journal (--restart, [restart] journal = on): "
			"an upgrade would lose every buffer");
		return;
	}
	int err = h->upgrade.prepare(h->upgrade.ctx, u->binary, why, sizeof(why));
	if (err) {
		reply_error(r, err, why);
		return;
	}
	log_info("event=upgrade_requested conn=%llu uid=%u pid=%u binary=\"%s\"",
		 (unsigned long long)me->serial, me->uid, me->pid,
		 log_escape(u->binary && u->binary[0] ? u->binary : "(its own)", esc, sizeof(esc)));
	r->quiet = false;
	reply_ok(r);
	h->upgrade.start(h->upgrade.ctx);
}

/* ---- dispatch ------------------------------------------------------------------ */

/* The sentence that refuses a peer no allow-list admits, into buf. */
static void denied_message(const session *c, char *buf, size_t len)
{
	snprintf(buf, len,
		 "uid %u is not allowed to use this daemon (it is not on --allow-uids, and "
		 "gid %u and its other groups are not on --allow-gids)",
		 c->uid, c->gid);
}

/* The ops whose request id the state journal records as applied
 * (docs/RESTART.md, "Exactly once"). */
static bool changes_state(Bufbroker__Request__OpCase op)
{
	switch (op) {
	case BUFBROKER__REQUEST__OP_ALLOC:
	case BUFBROKER__REQUEST__OP_IMPORT_FD:
	case BUFBROKER__REQUEST__OP_OPEN:
	case BUFBROKER__REQUEST__OP_RETAIN:
	case BUFBROKER__REQUEST__OP_RELEASE:
	case BUFBROKER__REQUEST__OP_TAKE:
	case BUFBROKER__REQUEST__OP_ADOPT:
	case BUFBROKER__REQUEST__OP_SET_READY:
	case BUFBROKER__REQUEST__OP_SET_ERROR: return true;
	default: return false;
	}
}

/* The answer to a request applied before a restart and sent again after
 * the resume (docs/RESTART.md, "Exactly once"): from the result ring for
 * the ops that have a result, the current counts for Retain and Release,
 * a plain success for SetReady and SetError. */
static void answer_applied(req_ctx *r, const Bufbroker__Request *req, const broker_applied *done)
{
	char msg[160];
	uint64_t id = 0;
	bool refs = false;
	switch (req->op_case) {
	case BUFBROKER__REQUEST__OP_RETAIN: id = req->retain->id, refs = true; break;
	case BUFBROKER__REQUEST__OP_RELEASE: id = req->release->id, refs = true; break;
	case BUFBROKER__REQUEST__OP_SET_READY:
	case BUFBROKER__REQUEST__OP_SET_ERROR: reply_ok(r); return;
	default: break;
	}
	if (refs) {
		/* Applied once; its answer is the counts as they are now. */
		broker_info info = {0};
		broker_error err;
		if (broker_stat_id(r->c->h->b, r->c->bc, id, &info, &err))
			info.refs = info.held = 0; /* its last count went: the buffer is gone */
		Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
		Bufbroker__RefsReply rr = BUFBROKER__REFS_REPLY__INIT;
		rr.refs = info.refs;
		rr.held = info.held;
		resp.result_case = BUFBROKER__RESPONSE__RESULT_REFS;
		resp.refs = &rr;
		reply(r, &resp, -1);
		return;
	}
	if (!done->found) {
		snprintf(msg, sizeof(msg),
			 "request %" PRIu64 " was applied before the daemon restarted, and its "
			 "answer is no longer kept (ids more than 64 apart)",
			 r->id);
		reply_error(r, BB_ERR_PROTOCOL, msg);
	} else if (done->status) {
		snprintf(msg, sizeof(msg),
			 "request %" PRIu64 " was answered %s before the daemon restarted", r->id,
			 bb_err_name(done->status));
		reply_error(r, done->status, msg);
	} else if (req->op_case == BUFBROKER__REQUEST__OP_TAKE) {
		Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
		Bufbroker__TakeReply tr = BUFBROKER__TAKE_REPLY__INIT;
		tr.token.data = (uint8_t *)done->token;
		tr.token.len = sizeof(done->token);
		resp.result_case = BUFBROKER__RESPONSE__RESULT_TAKE;
		resp.take = &tr;
		reply(r, &resp, -1);
	} else if (done->buf) {
		grant(r, done->buf); /* the count it got then; no new one */
	} else {
		snprintf(msg, sizeof(msg),
			 "request %" PRIu64 " was applied before the daemon restarted; the buffer "
			 "it granted is no longer held by this session",
			 r->id);
		reply_error(r, BB_ERR_NOT_FOUND, msg);
	}
}

void handler_request(session *c, const Bufbroker__Request *req, int fd, const char *invalid)
{
	req_ctx r = {.c = c, .id = req->id, .quiet = req->no_reply, .opc = req->op_case};

	if (c->denied) {
		/* Whatever it asks first (a Hello, from any client library):
		 * the answer names the reason, then the connection closes. */
		char msg[160];
		if (fd >= 0)
			close(fd);
		denied_message(c, msg, sizeof(msg));
		r.quiet = false;
		reply_error(&r, BB_ERR_DENIED, msg);
		close_after(c, msg);
		return;
	}
	if (fd >= 0 && req->op_case != BUFBROKER__REQUEST__OP_IMPORT_FD) {
		close(fd);
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL,
			    "unexpected file descriptor: only ImportFd carries one");
		return;
	}
	if (!c->hello && req->op_case != BUFBROKER__REQUEST__OP_HELLO) {
		if (fd >= 0)
			close(fd);
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL, "the first request must be Hello");
		close_after(c, "request before Hello");
		return;
	}
	if (req->id == 0) {
		/* Its answer could not be told from one to no request. */
		if (fd >= 0)
			close(fd);
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL,
			    "request id 0 is reserved for answers to no particular request; "
			    "number requests from 1");
		return;
	}
	if (invalid) {
		char msg[160];
		if (fd >= 0)
			close(fd);
		snprintf(msg, sizeof(msg), "%s: strings must be UTF-8 without NUL bytes", invalid);
		reply_error(&r, BB_ERR_INVALID, msg);
		return;
	}

	if (c->bc && changes_state(req->op_case)) {
		broker_applied done;
		if (crash_after && ++crash_count == crash_after)
			crash_armed = true;
		if (broker_conn_applied(c->h->b, c->bc, req->id, &done)) {
			/* Sent again after a resume, and applied before the
			 * restart: answered, not applied twice. */
			if (fd >= 0)
				close(fd);
			answer_applied(&r, req, &done);
			return;
		}
		broker_conn_note_request(c->bc, req->id); /* applied with its effect */
	} else if (c->bc) {
		broker_conn_seen(c->bc, req->id);
	}
	switch (req->op_case) {
	case BUFBROKER__REQUEST__OP_HELLO: do_hello(&r, req->hello); break;
	case BUFBROKER__REQUEST__OP_ALLOC: {
		const Bufbroker__Alloc *a = req->alloc;
		do_alloc(&r, a->size, a->kind, a->device, a->name, a->share, (int)a->cuda_handle,
			 -1);
		break;
	}
	case BUFBROKER__REQUEST__OP_IMPORT_FD: {
		const Bufbroker__ImportFd *a = req->import_fd;
		if (fd < 0)
			reply_error(&r, BB_ERR_INVALID,
				    "ImportFd needs the memfd attached to the request");
		else if (a->kind != BUFBROKER__KIND__KIND_HOST)
			reply_error(&r, BB_ERR_INVALID,
				    "only host buffers can be imported from an fd");
		else
			do_alloc(&r, a->size, a->kind, a->device, a->name, a->share,
				 BB_CUDA_HANDLE_DEFAULT, fd);
		if (fd >= 0)
			close(fd); /* the backend kept its own duplicate */
		break;
	}
	case BUFBROKER__REQUEST__OP_OPEN: do_open(&r, req->open); break;
	case BUFBROKER__REQUEST__OP_RETAIN:
		do_refs(&r, req->retain->id, req->retain->count, true);
		break;
	case BUFBROKER__REQUEST__OP_RELEASE:
		do_refs(&r, req->release->id, req->release->count, false);
		break;
	case BUFBROKER__REQUEST__OP_TAKE: do_take(&r, req->take); break;
	case BUFBROKER__REQUEST__OP_ADOPT: do_adopt(&r, req->adopt); break;
	case BUFBROKER__REQUEST__OP_SET_READY: do_settle(&r, req->set_ready->id, NULL); break;
	case BUFBROKER__REQUEST__OP_SET_ERROR:
		do_settle(&r, req->set_error->id,
			  req->set_error->message && req->set_error->message[0]
				  ? req->set_error->message
				  : "failed");
		break;
	case BUFBROKER__REQUEST__OP_WAIT: do_wait(&r, req->wait); break;
	case BUFBROKER__REQUEST__OP_STAT: do_stat(&r, req->stat); break;
	case BUFBROKER__REQUEST__OP_LIST: do_list(&r, req->list); break;
	case BUFBROKER__REQUEST__OP_SERVER_STATUS: do_server_status(&r); break;
	case BUFBROKER__REQUEST__OP_CLIENTS: do_clients(&r, req->clients); break;
	case BUFBROKER__REQUEST__OP_CHECK: do_check(&r); break;
	case BUFBROKER__REQUEST__OP_ALLOCATION_FD: do_allocation_fd(&r, req->allocation_fd); break;
	case BUFBROKER__REQUEST__OP_UPGRADE: do_upgrade(&r, req->upgrade); break;
	default:
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL, "unknown or missing op");
		break;
	}
	crash_point(); /* a no_reply request, or a parked one */
}

/* ---- sessions ------------------------------------------------------------------ */

session *handler_session_open(handler *h, uint64_t serial, uint32_t uid, uint32_t gid, uint32_t pid,
			      bool denied, const handler_reply *reply)
{
	session *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->h = h;
	c->reply = *reply;
	c->serial = serial;
	c->uid = uid;
	c->gid = gid;
	c->pid = pid;
	DL_APPEND(h->sessions, c);
	if (denied) {
		/* Refused at its Hello, so that the client learns why; until
		 * then it holds no broker connection (it cannot take a slot
		 * from the peers the lists admit), and only so many wait. */
		char msg[160];
		c->denied = true;
		h->denied_pending++;
		metrics_refused(h->counters, METRICS_LIMIT_ALLOW_LIST);
		denied_message(c, msg, sizeof(msg));
		log_warn("event=connection_denied conn=%llu uid=%u gid=%u pid=%u error=\"%s\"",
			 (unsigned long long)serial, uid, gid, pid, msg);
		if (h->denied_pending > HANDLER_DENIED_PENDING_MAX) {
			send_status(c, 0, BB_ERR_DENIED, msg);
			close_after(c, msg);
		}
		return c;
	}
	broker_error err;
	c->bc = broker_conn_open(h->b, uid, gid, pid, &err);
	if (!c->bc) {
		log_warn("event=connection_refused conn=%llu uid=%u pid=%u error=\"%s\"",
			 (unsigned long long)serial, uid, pid, err.msg);
		send_status(c, 0, BB_ERR_NO_MEMORY, err.msg);
		close_after(c, err.msg);
		return c;
	}
	log_info("event=connection_opened conn=%llu uid=%u gid=%u pid=%u",
		 (unsigned long long)serial, uid, gid, pid);
	return c;
}

void handler_session_close(session *c, const char *why)
{
	handler *h = c->h;
	if (c->denied)
		h->denied_pending--;
	handler_session_drop_parked(c);
	if (c->bc) {
		uint64_t buffers, bytes;
		broker_conn_holdings(c->bc, &buffers, &bytes);
		broker_conn_close(h->b, c->bc);
		c->bc = NULL;
		log_info(
			"event=connection_closed conn=%llu uid=%u pid=%u client=\"%s\" released_buffers=%llu "
			"released_bytes=%llu reason=\"%s\"",
			(unsigned long long)c->serial, c->uid, c->pid, c->name,
			(unsigned long long)buffers, (unsigned long long)bytes,
			why && why[0] ? why : "daemon stopping");
		tokens_changed(h);
	}
	DL_DELETE(h->sessions, c);
	free(c);
}

/* ---- the layer ----------------------------------------------------------------- */

handler *handler_new(uv_loop_t *loop, const snapshot_sources *src, park *park,
		     metrics_counters *counters, uint32_t max_datagram)
{
	handler *h = calloc(1, sizeof(*h));
	if (!h)
		return NULL;
	h->loop = loop;
	h->src = src;
	h->b = src->b;
	h->park = park;
	h->counters = counters;
	h->max_datagram = max_datagram;
	const char *crash = getenv("BUFBROKERD_TEST_CRASH_AFTER");
	crash_once = getenv("BUFBROKERD_TEST_CRASH_ONCE");
	if (crash && crash[0] && !(crash_once && access(crash_once, F_OK) == 0)) {
		crash_after = strtoull(crash, NULL, 10);
		log_warn("event=test_crash_point_set after=%llu (BUFBROKERD_TEST_CRASH_AFTER: "
			 "tests only)",
			 (unsigned long long)crash_after);
	}
	uv_timer_init(loop, &h->token_timer);
	h->token_timer.data = h;
	return h;
}

void handler_set_upgrade(handler *h, const handler_upgrade *u)
{
	h->upgrade = u ? *u : (handler_upgrade){0};
}

void handler_stop(handler *h)
{
	h->stopping = true;
	uv_timer_stop(&h->token_timer);
}

void handler_free(handler *h)
{
	free(h);
}
