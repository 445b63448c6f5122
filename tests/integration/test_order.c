/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Points of the protocol a client author has to rely on (docs/PROTOCOL.md,
 * "Requests and responses", and Alloc's errors), each proved on the wire
 * with a raw connection: the order of a woken Wait's answer and the answer
 * to the SetReady that woke it, the silence of a refused no_reply Wait, and
 * uid 0 under the per-uid quotas.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "wire.h"

TestSuite(order, .fini = bbt_cleanup, .timeout = 60);

/* A raw connection to d, greeted. */
static int raw_open(const bbt_daemon *d)
{
	int raw = bbt_raw_connect(d->sock);
	cr_assert_geq(raw, 0, "raw connect: %s", strerror(-raw));
	cr_assert_eq(bbt_raw_hello(raw, 1, BB_PROTO_MAJOR), 0, "Hello was refused");
	return raw;
}

/* Send req (op set by the caller) with id and no_reply. */
static void raw_send(int raw, Bufbroker__Request *req, uint64_t id, bool no_reply)
{
	req->id = id;
	req->no_reply = no_reply;
	cr_assert_eq(bbt_raw_send(raw, req, -1), 0, "send of request %llu failed",
		     (unsigned long long)id);
}

/* The next response: its id, status code and result case. */
static uint64_t raw_next(int raw, int *code, int *result)
{
	Bufbroker__Response *resp = NULL;
	int rc = bbt_raw_recv(raw, bbt_ms(3000), &resp, NULL);
	cr_assert_eq(rc, 1, "no response (recv %d: %s)", rc, rc < 0 ? strerror(-rc) : "closed");
	uint64_t id = resp->id;
	*code = resp->status ? resp->status->code : 1;
	*result = (int)resp->result_case;
	bufbroker__response__free_unpacked(resp, NULL);
	return id;
}

/* Ask raw for a 4 KiB host buffer (request id): its status code, and its
 * id in *buf when it was made. */
static int raw_try_alloc(int raw, uint64_t id, uint64_t *buf)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Alloc a = BUFBROKER__ALLOC__INIT;
	Bufbroker__Response *resp = NULL;
	int fd = -1;

	a.size = 4096;
	a.kind = BUFBROKER__KIND__KIND_HOST;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = &a;
	raw_send(raw, &req, id, false);
	cr_assert_eq(bbt_raw_recv(raw, bbt_ms(3000), &resp, &fd), 1, "no answer to Alloc");
	cr_assert_eq(resp->id, id, "the answer is to request %llu, want %llu",
		     (unsigned long long)resp->id, (unsigned long long)id);
	int code = resp->status ? resp->status->code : 1;
	*buf = code == 0 && resp->grant && resp->grant->info ? resp->grant->info->id : 0;
	bufbroker__response__free_unpacked(resp, NULL);
	if (fd >= 0)
		close(fd);
	return code;
}

/* A 4 KiB host buffer made on raw (request id): its id. */
static uint64_t raw_alloc(int raw, uint64_t id)
{
	uint64_t buf;
	int code = raw_try_alloc(raw, id, &buf);
	cr_assert(code == 0 && buf, "Alloc failed with %d", code);
	return buf;
}

Test(order, woken_waits_are_answered_before_the_set_ready_that_woke_them)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *admin = bbt_connect(d);
	int raw = raw_open(d);
	uint64_t buf = raw_alloc(raw, 2);

	cr_assert_eq(bbt_raw_wait(raw, 10, buf, -1), 0);
	cr_assert_eq(bbt_raw_wait(raw, 11, buf, -1), 0);
	cr_assert(bbt_waits_until(admin, 2, 3000, NULL), "the two Waits did not park");

	Bufbroker__Request set = BUFBROKER__REQUEST__INIT;
	Bufbroker__SetReady sr = BUFBROKER__SET_READY__INIT;
	sr.id = buf;
	set.op_case = BUFBROKER__REQUEST__OP_SET_READY;
	set.set_ready = &sr;
	raw_send(raw, &set, 12, false);

	uint64_t want[] = {10, 11, 12};
	int want_result[] = {BUFBROKER__RESPONSE__RESULT_WAIT, BUFBROKER__RESPONSE__RESULT_WAIT,
			     BUFBROKER__RESPONSE__RESULT__NOT_SET};
	for (int i = 0; i < 3; i++) {
		int code, result;
		uint64_t id = raw_next(raw, &code, &result);
		cr_assert_eq(id, want[i], "answer %d is to request %llu, want %llu", i,
			     (unsigned long long)id, (unsigned long long)want[i]);
		cr_assert_eq(code, 0, "request %llu failed with %d", (unsigned long long)id, code);
		cr_assert_eq(result, want_result[i], "request %llu: result %d",
			     (unsigned long long)id, result);
	}
	close(raw);
	bb_disconnect(admin);
	bbt_stop_clean(d);
}

Test(order, a_no_reply_wait_is_refused_without_an_answer)
{
	bbt_daemon *d = bbt_start(NULL);
	bb_client *admin = bbt_connect(d);
	int raw = raw_open(d);
	uint64_t buf = raw_alloc(raw, 2);

	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Wait w = BUFBROKER__WAIT__INIT;
	w.id = buf;
	w.timeout_ms = -1;
	req.op_case = BUFBROKER__REQUEST__OP_WAIT;
	req.wait = &w;
	raw_send(raw, &req, 20, true);

	/* Answered in order: the next answer is to the Stat sent after it. */
	cr_assert_eq(bbt_raw_stat(raw, 21, buf), 0);
	int code, result;
	uint64_t id = raw_next(raw, &code, &result);
	cr_assert_eq(id, 21, "the first answer is to request %llu, want the Stat's (21)",
		     (unsigned long long)id);
	cr_assert_eq(code, 0);
	cr_assert_eq(result, BUFBROKER__RESPONSE__RESULT_INFO);
	/* Refused, not parked: nothing waits on the buffer. */
	cr_assert(bbt_waits_until(admin, 0, 3000, NULL), "the no_reply Wait was parked");
	close(raw);
	bb_disconnect(admin);
	bbt_stop_clean(d);
}

Test(order, uid_0_is_under_the_per_uid_buffer_limit)
{
	if (geteuid() != 0)
		cr_skip_test("needs root: the rule is about uid 0");
	static const char *const args[] = {"--uid-buffers", "2", NULL};
	bbt_daemon *d = bbt_start(args);
	int raw = raw_open(d);
	uint64_t buf;
	raw_alloc(raw, 2);
	raw_alloc(raw, 3);
	int code = raw_try_alloc(raw, 4, &buf);
	cr_assert_eq(code, BB_ERR_NO_MEMORY, "root's third buffer over --uid-buffers 2: status %d",
		     code);
	close(raw);
	bbt_stop_clean(d);
}
