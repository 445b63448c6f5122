/*
 * Unit tests for what the broker reports to the metrics endpoint: the
 * refusals counted per limit (broker_totals.refused) and the per-uid usage
 * (broker_uid_usage). A heap backend stands in for memory.
 */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "broker.h"

#define UID_A 1000
#define UID_B 2000

static int heap_alloc(backend *be, uint64_t size, int device, uint32_t uid, int share, int *handle,
		      backend_mem *out, char *err, size_t errlen)
{
	(void)be, (void)device, (void)uid, (void)share, (void)handle, (void)err, (void)errlen;
	out->fd = -1;
	out->size = size;
	out->priv = malloc(1);
	return out->priv ? 0 : BB_ERR_NO_MEMORY;
}

static void heap_free(backend *be, backend_mem *mem)
{
	(void)be;
	free(mem->priv);
	mem->priv = NULL;
}

static backend heap = {.name = "heap", .alloc = heap_alloc, .free = heap_free};

static broker *new_broker(const broker_limits *l)
{
	broker_config cfg = {.limits = *l};
	broker *b = broker_new(&cfg);
	cr_assert_not_null(b);
	broker_set_backend(b, BB_HOST, &heap, NULL);
	return b;
}

static uint64_t alloc_host(broker *b, broker_conn *c, uint64_t size, int *rc)
{
	broker_alloc_req req = {
		.size = size, .kind = BB_HOST, .share = BB_SHARE_UID, .import_fd = -1};
	broker_buf *buf = NULL;
	broker_error err;
	broker_info info;
	*rc = broker_alloc(b, c, &req, &buf, &err);
	if (*rc)
		return 0;
	broker_buf_info(b, buf, c, &info);
	return info.id;
}

static void noop_wake(broker_waiter *w, int code, bb_state state, const char *error)
{
	(void)w, (void)code, (void)state, (void)error;
}

Test(broker_metrics, each_limit_refusal_is_counted_once_under_its_name)
{
	broker_limits l;
	broker_limits_default(&l);
	l.connections = 2;
	l.uid_buffers = 2;
	l.uid_bytes[BB_HOST] = 1000;
	l.conn_tokens = 1;
	l.uid_tokens = 1;
	l.conn_waits = 1;
	broker *b = new_broker(&l);
	broker_error err;
	broker_totals t;
	int rc;

	broker_conn *a = broker_conn_open(b, UID_A, UID_A, 1, &err);
	broker_conn *a2 = broker_conn_open(b, UID_A, UID_A, 2, &err);
	cr_assert(a && a2);
	cr_assert_null(broker_conn_open(b, UID_B, UID_B, 3, &err), "a third connection is over 2");

	uint64_t id1 = alloc_host(b, a, 100, &rc);
	cr_assert_eq(rc, 0);
	alloc_host(b, a, 2000, &rc);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "2000 bytes are over uid_bytes 1000");
	uint64_t id2 = alloc_host(b, a, 100, &rc);
	cr_assert_eq(rc, 0);
	alloc_host(b, a2, 100, &rc);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "a third buffer of uid A is over uid_buffers 2");

	unsigned char tok[BB_TOKEN_SIZE];
	cr_assert_eq(broker_take(b, a, id1, true, tok, &err), 0);
	cr_assert_eq(broker_take(b, a, id2, true, tok, &err), BB_ERR_NO_MEMORY,
		     "a second token is over conn_tokens 1");
	/* a2 has made none, but uid A has its one. */
	broker_buf *held;
	cr_assert_eq(broker_open_id(b, a2, id2, &held, &err), 0, "%s", err.msg);
	cr_assert_eq(broker_take(b, a2, id2, true, tok, &err), BB_ERR_NO_MEMORY,
		     "a second token of uid A is over uid_tokens 1");

	broker_waiter w1 = {.wake = noop_wake}, w2 = {.wake = noop_wake};
	bb_state st;
	char msg[256];
	cr_assert_eq(broker_wait(b, a, id1, &w1, &st, msg, &err), 0, "the first wait parks");
	cr_assert_eq(broker_wait(b, a, id2, &w2, &st, msg, &err), BB_ERR_NO_MEMORY,
		     "a second parked wait is over conn_waits 1");

	/* Room for uid A again, but not on the daemon: host_buffers refuses. */
	broker_limits more = l;
	more.uid_buffers = 10;
	more.uid_bytes[BB_HOST] = 1 << 20;
	more.host_buffers = 2;
	broker_set_limits(b, &more);
	alloc_host(b, a, 100, &rc);
	cr_assert_eq(rc, BB_ERR_NO_MEMORY, "a third live host buffer is over host_buffers 2");

	/* Errors that are not limits count nowhere. */
	broker_info info;
	cr_assert_eq(broker_stat_id(b, a, 999, &info, &err), BB_ERR_NOT_FOUND);

	broker_totals_get(b, &t);
	cr_assert_eq(t.refused[BROKER_LIMIT_CONNECTIONS], 1);
	cr_assert_eq(t.refused[BROKER_LIMIT_UID_BYTES], 1);
	cr_assert_eq(t.refused[BROKER_LIMIT_UID_BUFFERS], 1);
	cr_assert_eq(t.refused[BROKER_LIMIT_CONN_TOKENS], 1);
	cr_assert_eq(t.refused[BROKER_LIMIT_CONN_WAITS], 1);
	for (int i = 0; i < BROKER_LIMIT_COUNT; i++)
		cr_assert_eq(t.refused[i], 1, "limit %s: %llu refusals, want 1",
			     broker_limit_name(i), (unsigned long long)t.refused[i]);

	broker_wait_cancel(b, &w1);
	broker_conn_close(b, a);
	broker_conn_close(b, a2);
	broker_free(b);
}

/* Each limit with the broker_limits field it names: #field is the name it
 * must have, and offsetof does not compile for a field that is not there. */
#define LIMIT_FIELD(limit, field)                             \
	{                                                     \
		limit, #field, offsetof(broker_limits, field) \
	}

Test(broker_metrics, limit_names_match_the_limits_fields)
{
	static const struct {
		broker_limit limit;
		const char *field;
		size_t offset;
	} fields[] = {
		LIMIT_FIELD(BROKER_LIMIT_CONNECTIONS, connections),
		LIMIT_FIELD(BROKER_LIMIT_UID_BUFFERS, uid_buffers),
		LIMIT_FIELD(BROKER_LIMIT_UID_BYTES, uid_bytes),
		LIMIT_FIELD(BROKER_LIMIT_CONN_TOKENS, conn_tokens),
		LIMIT_FIELD(BROKER_LIMIT_CONN_WAITS, conn_waits),
		LIMIT_FIELD(BROKER_LIMIT_UID_TOKENS, uid_tokens),
		LIMIT_FIELD(BROKER_LIMIT_HOST_BUFFERS, host_buffers),
	};
	size_t n = sizeof(fields) / sizeof(fields[0]);
	bool seen[BROKER_LIMIT_COUNT] = {false};

	/* Every limit, each once: a new one fails here until it is named. */
	cr_assert_eq(n, BROKER_LIMIT_COUNT, "%zu limits named here, the broker has %d", n,
		     (int)BROKER_LIMIT_COUNT);
	for (size_t i = 0; i < n; i++) {
		cr_assert_lt((unsigned)fields[i].limit, BROKER_LIMIT_COUNT);
		cr_assert_not(seen[fields[i].limit], "limit %d twice", (int)fields[i].limit);
		seen[fields[i].limit] = true;
		const char *name = broker_limit_name(fields[i].limit);
		cr_assert_not_null(name, "limit %d has no name", (int)fields[i].limit);
		cr_assert_str_eq(name, fields[i].field, "limit %d is named %s, its field %s",
				 (int)fields[i].limit, name, fields[i].field);
	}
	cr_assert_null(broker_limit_name(BROKER_LIMIT_COUNT));
}

/* What broker_uid_usage reported, by uid. */
typedef struct usage_seen {
	int rows;
	uint64_t buffers[2];
	uint64_t host_bytes[2];
} usage_seen;

static void collect(uint32_t uid, uint64_t buffers, const uint64_t bytes[BROKER_KINDS], void *arg)
{
	usage_seen *u = arg;
	cr_assert(uid == UID_A || uid == UID_B, "unexpected uid %u", uid);
	int i = uid == UID_A ? 0 : 1;
	u->rows++;
	u->buffers[i] = buffers;
	u->host_bytes[i] = bytes[BB_HOST];
	cr_assert_eq(bytes[BB_CUDA], 0);
}

Test(broker_metrics, uid_usage_reports_each_owner_until_its_last_buffer_goes)
{
	broker_limits l;
	broker_limits_default(&l);
	broker *b = new_broker(&l);
	broker_error err;
	int rc;
	broker_conn *a = broker_conn_open(b, UID_A, UID_A, 1, &err);
	broker_conn *bb = broker_conn_open(b, UID_B, UID_B, 2, &err);
	alloc_host(b, a, 100, &rc);
	alloc_host(b, a, 300, &rc);
	alloc_host(b, bb, 5000, &rc);

	usage_seen u = {0};
	broker_uid_usage(b, collect, &u);
	cr_assert_eq(u.rows, 2);
	cr_assert_eq(u.buffers[0], 2);
	cr_assert_eq(u.host_bytes[0], 400);
	cr_assert_eq(u.buffers[1], 1);
	cr_assert_eq(u.host_bytes[1], 5000);

	broker_conn_close(b, a); /* frees uid A's buffers: nobody else holds them */
	memset(&u, 0, sizeof(u));
	broker_uid_usage(b, collect, &u);
	cr_assert_eq(u.rows, 1, "a uid with no buffers is not reported");
	cr_assert_eq(u.buffers[1], 1);

	broker_conn_close(b, bb);
	broker_free(b);
}
