/* SPDX-License-Identifier: Apache-2.0 */
/*
 * flatwire against protobuf-c: the flat encoders write the bytes protobuf-c
 * packs, and whatever the flat decoders accept, protobuf-c decodes to the
 * same values (on valid messages and on hundreds of thousands of mutated
 * ones). The flat path may decline anything; it may never disagree.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "bufbroker.pb-c.h"
#include "flatwire.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
	/* xorshift64*: deterministic, so a failure reproduces. */
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

/* Values of every varint length, zero and the extremes included. */
static uint64_t rnd_value(void)
{
	switch (rnd() % 6) {
	case 0: return 0;
	case 1: return 1;
	case 2: return UINT64_MAX;
	case 3: return rnd() & 0x7f;
	default: return rnd() >> (rnd() % 64);
	}
}

static uint32_t rnd_u32(void)
{
	return (uint32_t)(rnd() % 4 == 0 ? UINT32_MAX : rnd_value());
}

static size_t pack_request(const flat_refs_req *f, uint8_t *out)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Retain ret = BUFBROKER__RETAIN__INIT;
	Bufbroker__Release rel = BUFBROKER__RELEASE__INIT;
	req.id = f->id;
	req.no_reply = f->no_reply;
	if (f->op == FLAT_OP_RETAIN) {
		ret.id = f->buf_id;
		ret.count = f->count;
		req.op_case = BUFBROKER__REQUEST__OP_RETAIN;
		req.retain = &ret;
	} else {
		rel.id = f->buf_id;
		rel.count = f->count;
		req.op_case = BUFBROKER__REQUEST__OP_RELEASE;
		req.release = &rel;
	}
	cr_assert_leq(bufbroker__request__get_packed_size(&req), FLAT_MAX_BYTES);
	return bufbroker__request__pack(&req, out);
}

static size_t pack_response(const flat_refs_resp *f, uint8_t *out)
{
	Bufbroker__Response resp = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	Bufbroker__RefsReply rr = BUFBROKER__REFS_REPLY__INIT;
	st.message = "";
	rr.refs = f->refs;
	rr.held = f->held;
	resp.id = f->id;
	resp.status = &st;
	resp.result_case = BUFBROKER__RESPONSE__RESULT_REFS;
	resp.refs = &rr;
	cr_assert_leq(bufbroker__response__get_packed_size(&resp), FLAT_MAX_BYTES);
	return bufbroker__response__pack(&resp, out);
}

static flat_refs_req rnd_request(void)
{
	flat_refs_req f = {.id = rnd_value(),
			   .no_reply = rnd() % 2,
			   .op = rnd() % 2 ? FLAT_OP_RETAIN : FLAT_OP_RELEASE,
			   .buf_id = rnd_value(),
			   .count = rnd_u32()};
	return f;
}

static flat_refs_resp rnd_response(void)
{
	flat_refs_resp f = {.id = rnd_value(), .refs = rnd_value(), .held = rnd_u32()};
	return f;
}

/* Damage msg (len bytes, room for cap) in one of the ways a peer could:
 * flip, insert, delete, truncate, duplicate a stretch, append a field. */
static size_t mutate(uint8_t *msg, size_t len, size_t cap)
{
	size_t at = len ? rnd() % len : 0;
	switch (rnd() % 7) {
	case 0:
		if (len)
			msg[at] ^= (uint8_t)(1u << (rnd() % 8));
		return len;
	case 1:
		if (len)
			msg[at] = (uint8_t)rnd();
		return len;
	case 2:
		if (len < cap) {
			memmove(msg + at + 1, msg + at, len - at);
			msg[at] = (uint8_t)rnd();
			return len + 1;
		}
		return len;
	case 3:
		if (len) {
			memmove(msg + at, msg + at + 1, len - at - 1);
			return len - 1;
		}
		return len;
	case 4: return at;
	case 5: {
		size_t n = 1 + rnd() % 4;
		if (at + n <= len && len + n <= cap) {
			memmove(msg + at + n, msg + at, len - at);
			return len + n;
		}
		return len;
	}
	default:
		/* A one-byte tag (any field, any wire type) and a small
		 * value or length. */
		if (len + 2 <= cap) {
			msg[len] = (uint8_t)(rnd() & 0x7f);
			msg[len + 1] = (uint8_t)(rnd() % 3);
			return len + 2;
		}
		return len;
	}
}

Test(flatwire, request_encoding_is_protobuf_c_s)
{
	for (int i = 0; i < 100000; i++) {
		flat_refs_req f = rnd_request();
		uint8_t a[FLAT_MAX_BYTES], b[FLAT_MAX_BYTES];
		size_t na = flat_refs_req_encode(&f, a), nb = pack_request(&f, b);
		cr_assert_eq(na, nb, "iteration %d: %zu bytes against protobuf-c's %zu", i, na, nb);
		cr_assert(memcmp(a, b, na) == 0, "iteration %d: the bytes differ", i);
	}
}

Test(flatwire, response_encoding_is_protobuf_c_s)
{
	for (int i = 0; i < 100000; i++) {
		flat_refs_resp f = rnd_response();
		uint8_t a[FLAT_MAX_BYTES], b[FLAT_MAX_BYTES];
		size_t na = flat_refs_resp_encode(&f, a), nb = pack_response(&f, b);
		cr_assert_eq(na, nb, "iteration %d: %zu bytes against protobuf-c's %zu", i, na, nb);
		cr_assert(memcmp(a, b, na) == 0, "iteration %d: the bytes differ", i);
	}
}

/* If flat accepts msg, protobuf-c must decode it to the same request. */
static bool check_request(const uint8_t *msg, size_t len)
{
	flat_refs_req f;
	if (!flat_refs_req_decode(msg, len, &f))
		return false;
	Bufbroker__Request *r = bufbroker__request__unpack(NULL, len, msg);
	cr_assert_not_null(r, "flat accepted %zu bytes protobuf-c rejects", len);
	cr_assert_eq(r->id, f.id);
	cr_assert_eq(r->no_reply, f.no_reply);
	if (f.op == FLAT_OP_RETAIN) {
		cr_assert_eq(r->op_case, BUFBROKER__REQUEST__OP_RETAIN);
		cr_assert_eq(r->retain->id, f.buf_id);
		cr_assert_eq(r->retain->count, f.count);
	} else {
		cr_assert_eq(f.op, FLAT_OP_RELEASE);
		cr_assert_eq(r->op_case, BUFBROKER__REQUEST__OP_RELEASE);
		cr_assert_eq(r->release->id, f.buf_id);
		cr_assert_eq(r->release->count, f.count);
	}
	bufbroker__request__free_unpacked(r, NULL);
	return true;
}

static bool check_response(const uint8_t *msg, size_t len)
{
	flat_refs_resp f;
	if (!flat_refs_resp_decode(msg, len, &f))
		return false;
	Bufbroker__Response *r = bufbroker__response__unpack(NULL, len, msg);
	cr_assert_not_null(r, "flat accepted %zu bytes protobuf-c rejects", len);
	cr_assert_eq(r->id, f.id);
	cr_assert_not_null(r->status);
	cr_assert_eq(r->status->code, 0);
	cr_assert_str_eq(r->status->message, "");
	cr_assert_eq(r->result_case, BUFBROKER__RESPONSE__RESULT_REFS);
	cr_assert_eq(r->refs->refs, f.refs);
	cr_assert_eq(r->refs->held, f.held);
	bufbroker__response__free_unpacked(r, NULL);
	return true;
}

Test(flatwire, decoders_take_every_plain_message)
{
	for (int i = 0; i < 50000; i++) {
		flat_refs_req q = rnd_request(), qd;
		flat_refs_resp p = rnd_response(), pd;
		uint8_t m[FLAT_MAX_BYTES];
		size_t n = pack_request(&q, m);
		cr_assert(check_request(m, n), "iteration %d: a plain request declined", i);
		flat_refs_req_decode(m, n, &qd);
		cr_assert(qd.id == q.id && qd.no_reply == q.no_reply && qd.op == q.op &&
			  qd.buf_id == q.buf_id && qd.count == q.count);
		n = pack_response(&p, m);
		cr_assert(check_response(m, n), "iteration %d: a plain response declined", i);
		flat_refs_resp_decode(m, n, &pd);
		cr_assert(pd.id == p.id && pd.refs == p.refs && pd.held == p.held);
	}
}

Test(flatwire, decoders_never_disagree_with_protobuf_c_on_damaged_input)
{
	int accepted = 0, declined = 0;
	for (int i = 0; i < 200000; i++) {
		uint8_t m[FLAT_MAX_BYTES * 2];
		bool request = i % 2 == 0;
		size_t n;
		if (request) {
			flat_refs_req q = rnd_request();
			n = pack_request(&q, m);
		} else {
			flat_refs_resp p = rnd_response();
			n = pack_response(&p, m);
		}
		for (int k = 1 + (int)(rnd() % 3); k > 0; k--)
			n = mutate(m, n, sizeof(m));
		if (request ? check_request(m, n) : check_response(m, n))
			accepted++;
		else
			declined++;
	}
	/* Both outcomes must have happened, or the test proved nothing. */
	cr_assert_gt(accepted, 1000);
	cr_assert_gt(declined, 1000);
}

Test(flatwire, decoders_decline_what_protobuf_c_must_judge)
{
	flat_refs_req q;
	flat_refs_resp p;
	/* Request.id twice: protobuf-c keeps the last; flat leaves it to it. */
	static const uint8_t dup_id[] = {0x08, 1, 0x08, 2, 0x72, 0};
	/* no_reply = 2 (protobuf-c: true). */
	static const uint8_t wide_bool[] = {0x10, 2, 0x72, 0};
	/* count = 2^32 (protobuf-c keeps the low bits of a uint32). */
	static const uint8_t wide_count[] = {0x72, 6, 0x10, 0x80, 0x80, 0x80, 0x80, 0x10};
	/* Retain and Release both (a oneof: the last wins). */
	static const uint8_t two_ops[] = {0x72, 0, 0x7a, 0};
	/* An unknown field 3. */
	static const uint8_t unknown[] = {0x18, 1, 0x72, 0};
	/* Hello (field 10), another op. */
	static const uint8_t hello[] = {0x52, 0};
	/* A response with an error status. */
	static const uint8_t error[] = {0x08, 1, 0x12, 2, 0x08, 0x7f, 0x62, 0};
	/* A response without a status. */
	static const uint8_t no_status[] = {0x08, 1, 0x62, 0};

	cr_assert_not(flat_refs_req_decode(dup_id, sizeof(dup_id), &q));
	cr_assert_not(flat_refs_req_decode(wide_bool, sizeof(wide_bool), &q));
	cr_assert_not(flat_refs_req_decode(wide_count, sizeof(wide_count), &q));
	cr_assert_not(flat_refs_req_decode(two_ops, sizeof(two_ops), &q));
	cr_assert_not(flat_refs_req_decode(unknown, sizeof(unknown), &q));
	cr_assert_not(flat_refs_req_decode(hello, sizeof(hello), &q));
	cr_assert_not(flat_refs_req_decode(hello, 0, &q), "an empty request has no op");
	cr_assert_not(flat_refs_resp_decode(error, sizeof(error), &p));
	cr_assert_not(flat_refs_resp_decode(no_status, sizeof(no_status), &p));
}
