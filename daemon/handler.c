/*
 * The request layer: turn one decoded Request into broker calls and one
 * Response (or none, for no_reply requests; or later, for a parked Wait).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <utlist.h>

#include "flatwire.h"
#include "kinds.h"
#include "log.h"
#include "ops.h"
#include "server.h"
#include "wire.h"

/* The request being answered. */
typedef struct req_ctx {
	conn *c;         /* who asked */
	uint64_t id;     /* Request.id */
	bool quiet;      /* Request.no_reply */
	const char *op;  /* op name, for logs */
	int opc;         /* Request.op_case, for metrics */
} req_ctx;

const char *handler_status_name(int code)
{
	return bb_err_name(code);
}

static void reply_error(req_ctx *r, int code, const char *msg)
{
	conn *c = r->c;
	metrics_answered(&c->srv->counters, r->opc, code);
	if (code != BB_ERR_TIMEOUT && log_enabled(LOG_INFO)) {
		char esc[512];
		log_info("event=request_failed conn=%llu uid=%u pid=%u op=%s code=%s error=\"%s\"",
			 (unsigned long long)c->serial, c->uid, c->pid, r->op, bb_err_name(code),
			 log_escape(msg, esc, sizeof(esc)));
	}
	if (!r->quiet)
		conn_send_status(c, r->id, code, msg);
}

static void reply(req_ctx *r, Bufbroker__Response *resp, int fd)
{
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	metrics_answered(&r->c->srv->counters, r->opc, BB_OK);
	if (r->quiet)
		return;
	st.message = "";
	resp->id = r->id;
	resp->status = &st;
	conn_send(r->c, resp, fd);
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
}

/* Answer with a Grant for buf, the memory's fd attached. */
static void grant(req_ctx *r, broker_buf *buf)
{
	server *s = r->c->srv;
	broker_info info;
	backend_export ex;
	broker_error err;
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Grant g = BUFBROKER__GRANT__INIT;
	Bufbroker__BufferInfo bi;

	broker_buf_info(s->b, buf, r->c->bc, &info);
	int rc = broker_buf_export(s->b, buf, &ex, &err);
	if (rc) {
		/* The caller got a count it will never learn of: give it back. */
		broker_release(s->b, r->c->bc, info.id, 1, NULL, NULL, NULL);
		reply_error(r, rc, err.msg);
		return;
	}
	/* A process of another uid may keep the fd: never reuse its memfd. */
	if (ex.fd >= 0 && info.owner_uid != r->c->uid)
		backend_host_exposed(s->host, ex.fd);
	fill_info(&bi, &info);
	g.info = &bi;
	if (ex.has_ipc) {
		g.ipc_handle.data = ex.ipc_handle;
		g.ipc_handle.len = sizeof(ex.ipc_handle);
		g.offset = ex.offset;
		g.device_uuid.data = ex.device_uuid;
		g.device_uuid.len = sizeof(ex.device_uuid);
		g.allocation = ex.allocation;
	}
	resp.result_case = BUFBROKER__RESPONSE__RESULT_GRANT;
	resp.grant = &g;
	reply(r, &resp, ex.fd);
}

/* RefsReply is the commonest answer: packed by flatwire, into the same
 * bytes protobuf-c would make, at a fraction of the cost. */
static void refs_reply(req_ctx *r, uint64_t refs, uint32_t held)
{
	flat_refs_resp fr = {.id = r->id, .refs = refs, .held = held};
	unsigned char buf[FLAT_MAX_BYTES];
	metrics_answered(&r->c->srv->counters, r->opc, BB_OK);
	if (r->quiet)
		return;
	conn_send_packed(r->c, buf, flat_refs_resp_encode(&fr, buf), -1);
}

/* ---- ops --------------------------------------------------------------------- */

static void do_hello(req_ctx *r, const Bufbroker__Hello *h)
{
	conn *c = r->c;
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
		conn_doom(c, "protocol version mismatch");
		return;
	}
	c->hello = true;
	snprintf(c->name, sizeof(c->name), "%s", h->client_name ? h->client_name : "");
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
	hr.max_datagram = c->srv->cfg.max_datagram;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_HELLO;
	resp.hello = &hr;
	reply(r, &resp, -1);
}

/* Allocate and answer, or BACKEND_GROW (nothing answered) when the backend
 * is making the memory. */
static int alloc_try(req_ctx *r, uint64_t size, int kind, int32_t device, const char *name,
		     uint32_t share, int fd)
{
	server *s = r->c->srv;
	broker_error err;
	broker_buf *buf;
	broker_alloc_req req = {
		.size = size,
		.kind = (bb_kind)kind,
		.device = device,
		.name = name,
		.share = share > BB_SHARE_ANY ? -1 : (int)share,
		.import_fd = fd,
	};
	int rc = broker_alloc(s->b, r->c->bc, &req, &buf, &err);
	if (rc == BACKEND_GROW)
		return rc;
	if (rc) {
		reply_error(r, rc, err.msg);
		return rc;
	}
	log_debug("event=alloc conn=%llu uid=%u size=%" PRIu64 " imported=%d",
		  (unsigned long long)r->c->serial, r->c->uid, size, fd >= 0);
	grant(r, buf);
	return 0;
}

static void parked_alloc_free(parked_alloc *pa)
{
	conn *c = pa->c;
	c->parked_allocs--;
	c->inflight--;
	free(pa->name);
	free(pa);
	conn_update(c);
}

static void do_alloc(req_ctx *r, uint64_t size, int kind, int32_t device, const char *name,
		     uint32_t share, int fd)
{
	conn *c = r->c;
	if (alloc_try(r, size, kind, device, name, share, fd) != BACKEND_GROW)
		return;
	/* The backend is making memory (a new CUDA slab): answer once a
	 * backend job is done. Later requests on this connection are answered
	 * meanwhile, as with Wait; conn_inflight bounds how many park (the
	 * connection is not read beyond it). */
	parked_alloc *pa = calloc(1, sizeof(*pa));
	if (!pa || (name && name[0] && !(pa->name = strdup(name)))) {
		free(pa);
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	pa->c = c;
	pa->req_id = r->id;
	pa->quiet = r->quiet;
	pa->size = size;
	pa->kind = kind;
	pa->device = device;
	pa->share = share;
	c->parked_allocs++;
	c->inflight++;
	DL_APPEND(c->srv->allocs, pa);
	conn_update(c);
	log_debug("event=alloc_parked conn=%llu uid=%u size=%" PRIu64 " device=%d",
		  (unsigned long long)c->serial, c->uid, size, device);
}

void handler_retry_allocs(server *s)
{
	if (s->stopping || !s->allocs)
		return;
	/* Detach the list: what parks again during the round goes to the
	 * end of a fresh one, so the order holds and the round ends. */
	parked_alloc *list = s->allocs, *pa, *tmp;
	s->allocs = NULL;
	DL_FOREACH_SAFE(list, pa, tmp)
	{
		DL_DELETE(list, pa);
		req_ctx r = {.c = pa->c,
			     .id = pa->req_id,
			     .quiet = pa->quiet,
			     .op = bb_op_name(BUFBROKER__REQUEST__OP_ALLOC),
			     .opc = BUFBROKER__REQUEST__OP_ALLOC};
		if (pa->c->doomed || pa->c->closed) {
			metrics_answered(&s->counters, r.opc, BB_ERR_DISCONNECTED);
			parked_alloc_free(pa);
			continue;
		}
		int rc = alloc_try(&r, pa->size, pa->kind, pa->device, pa->name, pa->share, -1);
		if (rc != BACKEND_GROW) {
			parked_alloc_free(pa);
			continue;
		}
		DL_APPEND(s->allocs, pa);
	}
}

static void do_open(req_ctx *r, const Bufbroker__Open *o)
{
	server *s = r->c->srv;
	broker_error err;
	broker_buf *buf;
	int rc;
	if (o->target_case == BUFBROKER__OPEN__TARGET_NAME)
		rc = broker_open_name(s->b, r->c->bc, o->name, &buf, &err);
	else if (o->target_case == BUFBROKER__OPEN__TARGET_ID)
		rc = broker_open_id(s->b, r->c->bc, o->id, &buf, &err);
	else
		rc = BB_ERR_INVALID, snprintf(err.msg, sizeof(err.msg), "Open needs an id or a name");
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	grant(r, buf);
}

static void do_refs(req_ctx *r, uint64_t id, uint32_t count, bool retain)
{
	server *s = r->c->srv;
	broker_error err;
	uint64_t refs = 0;
	uint32_t held = 0;
	int rc = retain ? broker_retain(s->b, r->c->bc, id, count, &refs, &held, &err)
			: broker_release(s->b, r->c->bc, id, count, &refs, &held, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	refs_reply(r, refs, held);
}

static void do_take(req_ctx *r, const Bufbroker__Take *t)
{
	server *s = r->c->srv;
	broker_error err;
	unsigned char tok[BB_TOKEN_SIZE];
	int rc = broker_take(s->b, r->c->bc, t->id, t->retain, tok, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	server_tokens_changed(s);
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
	server *s = r->c->srv;
	broker_error err;
	broker_buf *buf;
	if (a->token.len != BB_TOKEN_SIZE) {
		char msg[64];
		snprintf(msg, sizeof(msg), "a token is %d bytes, not %zu", BB_TOKEN_SIZE, a->token.len);
		reply_error(r, BB_ERR_INVALID, msg);
		return;
	}
	int rc = broker_adopt(s->b, r->c->bc, a->token.data, &buf, &err);
	server_tokens_changed(s);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	grant(r, buf);
}

static void do_settle(req_ctx *r, uint64_t id, const char *error)
{
	server *s = r->c->srv;
	broker_error err;
	int rc = error ? broker_set_error(s->b, r->c->bc, id, error, &err)
		       : broker_set_ready(s->b, r->c->bc, id, &err);
	if (rc) {
		reply_error(r, rc, err.msg);
		return;
	}
	reply_ok(r);
}

/* ---- Wait ------------------------------------------------------------------- */

static void wait_reply(conn *c, uint64_t req_id, bb_state state, const char *error)
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
	metrics_answered(&c->srv->counters, BUFBROKER__REQUEST__OP_WAIT, BB_OK);
	conn_send(c, &resp, -1);
}

/* Answer a Wait with just a status. */
static void wait_status(conn *c, uint64_t req_id, int code, const char *msg)
{
	metrics_answered(&c->srv->counters, BUFBROKER__REQUEST__OP_WAIT, code);
	conn_send_status(c, req_id, code, msg);
}

static void wait_free_cb(uv_handle_t *h)
{
	free(h->data);
}

/* Unlink pw from its connection and free it (after its timer closes). */
static void wait_dispose(parked_wait *pw)
{
	conn *c = pw->c;
	DL_DELETE(c->waits, pw);
	c->inflight--;
	if (pw->has_timer) {
		uv_timer_stop(&pw->timer);
		uv_close((uv_handle_t *)&pw->timer, wait_free_cb);
	} else {
		free(pw);
	}
	conn_update(c);
}

static void on_wake(broker_waiter *w, int code, bb_state state, const char *error)
{
	parked_wait *pw = (parked_wait *)w;
	if (code == 0)
		wait_reply(pw->c, pw->req_id, state, error);
	else
		wait_status(pw->c, pw->req_id, code, "the buffer was freed while waiting");
	wait_dispose(pw);
}

static void on_wait_timeout(uv_timer_t *t)
{
	parked_wait *pw = t->data;
	server *s = pw->c->srv;
	broker_wait_cancel(s->b, &pw->w);
	wait_status(pw->c, pw->req_id, BB_ERR_TIMEOUT, "the buffer is still pending");
	wait_dispose(pw);
}

static void do_wait(req_ctx *r, const Bufbroker__Wait *wq)
{
	conn *c = r->c;
	server *s = c->srv;
	broker_error err;
	bb_state state;
	char error[256];
	if (r->quiet) {
		reply_error(r, BB_ERR_INVALID, "Wait cannot be no_reply");
		return;
	}
	parked_wait *pw = calloc(1, sizeof(*pw));
	if (!pw) {
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	pw->w.wake = on_wake;
	pw->c = c;
	pw->req_id = r->id;
	int rc = broker_wait(s->b, c->bc, wq->id, &pw->w, &state, error, &err);
	if (rc < 0) {
		free(pw);
		reply_error(r, rc, err.msg);
		return;
	}
	if (rc == 1) {
		free(pw);
		wait_reply(c, r->id, state, error);
		return;
	}
	if (wq->timeout_ms == 0) {
		broker_wait_cancel(s->b, &pw->w);
		free(pw);
		wait_status(c, r->id, BB_ERR_TIMEOUT, "the buffer is still pending");
		return;
	}
	DL_APPEND(c->waits, pw);
	c->inflight++;
	if (wq->timeout_ms > 0) {
		uv_timer_init(s->loop, &pw->timer);
		pw->timer.data = pw;
		pw->has_timer = true;
		uv_timer_start(&pw->timer, on_wait_timeout, (uint64_t)wq->timeout_ms, 0);
	}
	conn_update(c);
}

void handler_drop_waits(conn *c)
{
	while (c->waits) {
		parked_wait *pw = c->waits;
		broker_wait_cancel(c->srv->b, &pw->w);
		metrics_answered(&c->srv->counters, BUFBROKER__REQUEST__OP_WAIT, BB_ERR_DISCONNECTED);
		wait_dispose(pw);
	}
	parked_alloc *pa, *tmp;
	DL_FOREACH_SAFE(c->srv->allocs, pa, tmp)
	{
		if (pa->c != c)
			continue;
		DL_DELETE(c->srv->allocs, pa);
		metrics_answered(&c->srv->counters, BUFBROKER__REQUEST__OP_ALLOC, BB_ERR_DISCONNECTED);
		parked_alloc_free(pa);
	}
}

/* ---- reporting ----------------------------------------------------------------- */

static void do_stat(req_ctx *r, const Bufbroker__Stat *st)
{
	server *s = r->c->srv;
	broker_error err;
	broker_info info;
	int rc;
	if (st->target_case == BUFBROKER__STAT__TARGET_NAME)
		rc = broker_stat_name(s->b, r->c->bc, st->name, &info, &err);
	else if (st->target_case == BUFBROKER__STAT__TARGET_ID)
		rc = broker_stat_id(s->b, r->c->bc, st->id, &info, &err);
	else
		rc = BB_ERR_INVALID, snprintf(err.msg, sizeof(err.msg), "Stat needs an id or a name");
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
	uint64_t after_id;          /* skip ids up to this */
	size_t budget;              /* bytes left for rows */
	size_t n, cap;              /* rows */
	broker_info *rows;          /* copies (BufferInfo points into them) */
	bool truncated;             /* a row did not fit */
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
	server *s = r->c->srv;
	list_acc a = {.after_id = l->after_id, .budget = s->cfg.max_datagram - 64};
	broker_list(s->b, r->c->bc, list_row, &a);

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
	server *s = r->c->srv;
	broker_totals t;
	broker_totals_get(s->b, &t);
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__ServerStatusReply ss = BUFBROKER__SERVER_STATUS_REPLY__INIT;
	Bufbroker__KindTotals kt[BB_KIND_COUNT], *ktp[BB_KIND_COUNT];
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		Bufbroker__KindTotals *x = &kt[k - 1];
		bufbroker__kind_totals__init(x);
		x->kind = (Bufbroker__Kind)k;
		x->buffers = t.buffers[k];
		x->bytes = t.bytes[k];
		ktp[k - 1] = x;
	}
	ss.server_version = BB_VERSION_STRING;
	ss.version_major = BB_PROTO_MAJOR;
	ss.version_minor = BB_PROTO_MINOR;
	ss.uptime_ms = uv_now(s->loop) - s->started_ms;
	ss.connections = t.connections;
	ss.n_kinds = BB_KIND_COUNT;
	ss.kinds = ktp;
	ss.tokens = t.tokens;
	ss.waits = t.waits;
	ss.pid = (uint32_t)getpid();

	/* The devices, as many as a datagram holds (each row is < 200 bytes). */
	enum { MAX_DEVICES = 64 };
	backend_device devs[MAX_DEVICES];
	Bufbroker__DeviceInfo di[MAX_DEVICES], *dip[MAX_DEVICES];
	int n = s->cuda && s->cuda->devices ? s->cuda->devices(s->cuda, devs, MAX_DEVICES) : 0;
	for (int i = 0; i < n; i++) {
		bufbroker__device_info__init(&di[i]);
		di[i].ordinal = devs[i].ordinal;
		di[i].name = devs[i].name;
		di[i].uuid.data = devs[i].uuid;
		di[i].uuid.len = sizeof(devs[i].uuid);
		di[i].total_bytes = devs[i].total;
		di[i].free_bytes = devs[i].free;
		di[i].used_bytes = devs[i].used;
		di[i].reserved_bytes = devs[i].reserved;
		di[i].limit_bytes = devs[i].limit;
		dip[i] = &di[i];
	}
	ss.n_devices = (size_t)n;
	ss.devices = dip;
	ss.cuda = s->cuda_why;

	resp.result_case = BUFBROKER__RESPONSE__RESULT_SERVER_STATUS;
	resp.server_status = &ss;
	reply(r, &resp, -1);
}

/* ---- admin --------------------------------------------------------------------- */

/* The name of process pid as /proc/PID/comm gives it, or "-" when it cannot
 * be read (the process is gone, or lives in a PID namespace we cannot see).
 * Control characters become '?', as in log lines. */
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
}

/* One Clients row and the text it points to. */
typedef struct client_row {
	Bufbroker__ClientInfo ci; /* points into process and the conn's name */
	char process[32];         /* /proc/PID/comm (16 bytes at most on Linux) */
} client_row;

static void do_clients(req_ctx *r, const Bufbroker__Clients *q)
{
	conn *me = r->c;
	server *s = me->srv;
	/* Root sees every connection; others, their own uid's. */
	bool all = me->uid == 0;
	size_t n = 0, budget = s->cfg.max_datagram - 64;
	bool truncated = false;
	conn *c;

	DL_FOREACH (s->conns, c)
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
	/* The list is in connection-number order: conns are appended. */
	DL_FOREACH (s->conns, c) {
		if (!c->bc || c->doomed || c->serial <= q->after_serial ||
		    (!all && c->uid != me->uid))
			continue;
		client_row *row = &rows[n];
		broker_conn_stats st;
		broker_conn_stats_get(s->b, c->bc, &st);
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
 * backend holds, and its connection and wait counts against the server's.
 * Appends a line per problem to report (cap bytes); returns how many. */
static int check_edges(server *s, char *report, size_t cap)
{
	broker_totals t;
	int problems = 0;
	char line[256];

	broker_totals_get(s->b, &t);
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		backend *be = k == BB_HOST ? s->host : s->cuda;
		const char *kind = bb_kind_name(k);
		uint64_t n = 0, bytes = 0;
		if (!be && (t.buffers[k] || t.bytes[k])) {
			snprintf(line, sizeof(line),
				 "the broker counts %" PRIu64 " %s buffers (%" PRIu64
				 " bytes) but no %s backend serves them",
				 t.buffers[k], kind, t.bytes[k], kind);
		} else if (be && be->usage) {
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
	conn *c;
	parked_wait *pw;
	DL_FOREACH (s->conns, c) {
		if (!c->bc)
			continue;
		conns++;
		DL_FOREACH (c->waits, pw)
			waits++;
	}
	if (conns != t.connections || waits != t.waits) {
		snprintf(line, sizeof(line),
			 "the server has %" PRIu64 " connections with %" PRIu64
			 " parked waits; the broker counts %u with %" PRIu64,
			 conns, waits, t.connections, t.waits);
		problems++;
		report_line(report, cap, line);
	}
	return problems;
}

static void do_check(req_ctx *r)
{
	conn *me = r->c;
	server *s = me->srv;
	uint32_t daemon_uid = (uint32_t)geteuid();
	char msg[128];

	if (me->uid != 0 && me->uid != daemon_uid) {
		snprintf(msg, sizeof(msg), "Check is allowed to root and to uid %u (the daemon's)",
			 daemon_uid);
		reply_error(r, BB_ERR_DENIED, msg);
		return;
	}
	char *report = malloc(CHECK_REPORT_MAX);
	char **lines = calloc(CHECK_REPORT_MAX / 2, sizeof(*lines));
	if (!report || !lines) {
		free(report);
		free(lines);
		reply_error(r, BB_ERR_NO_MEMORY, "daemon out of memory");
		return;
	}
	int problems = broker_check(s->b, report, CHECK_REPORT_MAX);
	problems += check_edges(s, report, CHECK_REPORT_MAX);

	broker_totals t;
	broker_totals_get(s->b, &t);
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
	size_t budget = s->cfg.max_datagram - 128;
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

/* ---- dispatch ------------------------------------------------------------------ */

void handler_denied_message(const conn *c, char *buf, size_t len)
{
	snprintf(buf, len,
		 "uid %u is not allowed to use this daemon (it is not on --allow-uids, and "
		 "gid %u and its other groups are not on --allow-gids)",
		 c->uid, c->gid);
}

int handler_request_flat(conn *c, const unsigned char *data, size_t len, int fd)
{
	flat_refs_req fr;
	/* Everything but a plain Retain or Release from a greeted, admitted
	 * connection takes the general path, with its checks and messages. */
	if (fd >= 0 || c->denied || !c->hello || !flat_refs_req_decode(data, len, &fr))
		return 0;
	bool retain = fr.op == FLAT_OP_RETAIN;
	req_ctx r = {.c = c, .id = fr.id, .quiet = fr.no_reply};
	r.opc = retain ? BUFBROKER__REQUEST__OP_RETAIN : BUFBROKER__REQUEST__OP_RELEASE;
	r.op = bb_op_name(r.opc);
	do_refs(&r, fr.buf_id, fr.count, retain);
	return r.opc;
}

void handler_request(conn *c, const Bufbroker__Request *req, int fd)
{
	req_ctx r = {.c = c,
		     .id = req->id,
		     .quiet = req->no_reply,
		     .op = bb_op_name(req->op_case),
		     .opc = req->op_case};

	if (c->denied) {
		/* Whatever it asks first (a Hello, from any client library):
		 * the answer names the reason, then the connection closes. */
		char msg[160];
		if (fd >= 0)
			close(fd);
		handler_denied_message(c, msg, sizeof(msg));
		r.quiet = false;
		reply_error(&r, BB_ERR_DENIED, msg);
		conn_doom(c, msg);
		return;
	}
	if (fd >= 0 && req->op_case != BUFBROKER__REQUEST__OP_IMPORT_FD) {
		close(fd);
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL, "unexpected file descriptor: only ImportFd carries one");
		return;
	}
	if (!c->hello && req->op_case != BUFBROKER__REQUEST__OP_HELLO) {
		if (fd >= 0)
			close(fd);
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL, "the first request must be Hello");
		conn_doom(c, "request before Hello");
		return;
	}

	switch (req->op_case) {
	case BUFBROKER__REQUEST__OP_HELLO:
		do_hello(&r, req->hello);
		break;
	case BUFBROKER__REQUEST__OP_ALLOC: {
		const Bufbroker__Alloc *a = req->alloc;
		do_alloc(&r, a->size, a->kind, a->device, a->name, a->share, -1);
		break;
	}
	case BUFBROKER__REQUEST__OP_IMPORT_FD: {
		const Bufbroker__ImportFd *a = req->import_fd;
		if (fd < 0)
			reply_error(&r, BB_ERR_INVALID, "ImportFd needs the memfd attached to the request");
		else if (a->kind != BUFBROKER__KIND__KIND_HOST)
			reply_error(&r, BB_ERR_INVALID, "only host buffers can be imported from an fd");
		else
			do_alloc(&r, a->size, a->kind, a->device, a->name, a->share, fd);
		if (fd >= 0)
			close(fd); /* the backend kept its own duplicate */
		break;
	}
	case BUFBROKER__REQUEST__OP_OPEN:
		do_open(&r, req->open);
		break;
	case BUFBROKER__REQUEST__OP_RETAIN:
		do_refs(&r, req->retain->id, req->retain->count, true);
		break;
	case BUFBROKER__REQUEST__OP_RELEASE:
		do_refs(&r, req->release->id, req->release->count, false);
		break;
	case BUFBROKER__REQUEST__OP_TAKE:
		do_take(&r, req->take);
		break;
	case BUFBROKER__REQUEST__OP_ADOPT:
		do_adopt(&r, req->adopt);
		break;
	case BUFBROKER__REQUEST__OP_SET_READY:
		do_settle(&r, req->set_ready->id, NULL);
		break;
	case BUFBROKER__REQUEST__OP_SET_ERROR:
		do_settle(&r, req->set_error->id,
			  req->set_error->message && req->set_error->message[0] ? req->set_error->message
										: "failed");
		break;
	case BUFBROKER__REQUEST__OP_WAIT:
		do_wait(&r, req->wait);
		break;
	case BUFBROKER__REQUEST__OP_STAT:
		do_stat(&r, req->stat);
		break;
	case BUFBROKER__REQUEST__OP_LIST:
		do_list(&r, req->list);
		break;
	case BUFBROKER__REQUEST__OP_SERVER_STATUS:
		do_server_status(&r);
		break;
	case BUFBROKER__REQUEST__OP_CLIENTS:
		do_clients(&r, req->clients);
		break;
	case BUFBROKER__REQUEST__OP_CHECK:
		do_check(&r);
		break;
	default:
		r.quiet = false;
		reply_error(&r, BB_ERR_PROTOCOL, "unknown or missing op");
		break;
	}
}
