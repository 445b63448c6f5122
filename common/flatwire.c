/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Flat reader and writer for Retain/Release and RefsReply (see
 * flatwire.h). Field numbers and wire types are bufbroker.proto's; the
 * unit test packs and unpacks the same messages with protobuf-c, so a
 * change to the .proto that this file missed fails there.
 */
#include "flatwire.h"

#include <string.h>

/* Protobuf wire types. */
#define WT_VARINT 0
#define WT_LEN 2

#define TAG(field, wt) (((field) << 3) | (wt))

/* Request and Response fields. */
#define REQ_ID TAG(1, WT_VARINT)
#define REQ_NO_REPLY TAG(2, WT_VARINT)
#define RESP_ID TAG(1, WT_VARINT)
#define RESP_STATUS TAG(2, WT_LEN)
#define RESP_REFS TAG(12, WT_LEN)
/* Retain/Release, Status and RefsReply fields. */
#define F1_VARINT TAG(1, WT_VARINT)
#define F2_VARINT TAG(2, WT_VARINT)
#define F2_LEN TAG(2, WT_LEN)

/* One varint at *p (before end); advances *p. false when it runs past end
 * or past ten bytes (more than 64 bits). Inlined: a request is four of
 * them, and the call cost more than the decoding. */
static inline __attribute__((always_inline)) bool get_varint(const uint8_t **p, const uint8_t *end,
							     uint64_t *v)
{
	uint64_t x = 0;
	const uint8_t *q = *p;
	/* Tags' lengths, counts, small ids: one byte. */
	if (q < end && !(*q & 0x80)) {
		*v = *q;
		*p = q + 1;
		return true;
	}
	for (unsigned shift = 0; shift < 70 && q < end; shift += 7) {
		uint8_t b = *q++;
		if (shift == 63 && b > 1)
			return false;
		x |= (uint64_t)(b & 0x7f) << shift;
		if (!(b & 0x80)) {
			*p = q;
			*v = x;
			return true;
		}
	}
	return false;
}

/* A tag small enough for one byte: every field read here has one. Longer
 * tags (fields above 15) are another message's, and fall back. */
static bool get_tag(const uint8_t **p, const uint8_t *end, unsigned *tag)
{
	if (*p >= end || (**p & 0x80))
		return false;
	*tag = *(*p)++;
	return true;
}

/* A uint32 field: protobuf-c reads only the low bits of a longer varint,
 * so only values that fit are taken here. */
static bool get_u32(const uint8_t **p, const uint8_t *end, uint32_t *v)
{
	uint64_t x;
	if (!get_varint(p, end, &x) || x > UINT32_MAX)
		return false;
	*v = (uint32_t)x;
	return true;
}

/* A bool field: protobuf-c reads any non-zero varint as true; only the
 * canonical one-byte 0 and 1 are taken here. */
static bool get_bool(const uint8_t **p, const uint8_t *end, bool *v)
{
	if (*p >= end || **p > 1)
		return false;
	*v = *(*p)++ == 1;
	return true;
}

/* The length of an embedded message; *sub_end its end. */
static bool get_len(const uint8_t **p, const uint8_t *end, const uint8_t **sub_end)
{
	uint64_t len;
	if (!get_varint(p, end, &len) || len > (uint64_t)(end - *p))
		return false;
	*sub_end = *p + len;
	return true;
}

/* Retain or Release: id = 1, count = 2. */
static bool get_refs_body(const uint8_t *p, const uint8_t *end, uint64_t *id, uint32_t *count)
{
	bool have_id = false, have_count = false;
	unsigned tag;
	*id = 0;
	*count = 0;
	while (p < end) {
		if (!get_tag(&p, end, &tag))
			return false;
		if (tag == F1_VARINT && !have_id) {
			if (!get_varint(&p, end, id))
				return false;
			have_id = true;
		} else if (tag == F2_VARINT && !have_count) {
			if (!get_u32(&p, end, count))
				return false;
			have_count = true;
		} else {
			return false;
		}
	}
	return true;
}

bool flat_refs_req_decode(const uint8_t *p, size_t n, flat_refs_req *out)
{
	const uint8_t *end = p + n, *sub_end;
	bool have_id = false, have_nr = false;
	unsigned tag;

	memset(out, 0, sizeof(*out));
	while (p < end) {
		if (!get_tag(&p, end, &tag))
			return false;
		if (tag == REQ_ID && !have_id) {
			if (!get_varint(&p, end, &out->id))
				return false;
			have_id = true;
		} else if (tag == REQ_NO_REPLY && !have_nr) {
			if (!get_bool(&p, end, &out->no_reply))
				return false;
			have_nr = true;
		} else if ((tag == TAG(FLAT_OP_RETAIN, WT_LEN) ||
			    tag == TAG(FLAT_OP_RELEASE, WT_LEN)) &&
			   !out->op) {
			if (!get_len(&p, end, &sub_end) ||
			    !get_refs_body(p, sub_end, &out->buf_id, &out->count))
				return false;
			out->op = (int)(tag >> 3);
			p = sub_end;
		} else {
			return false;
		}
	}
	return out->op != 0;
}

static uint8_t *put_varint(uint8_t *q, uint64_t v)
{
	while (v >= 0x80) {
		*q++ = (uint8_t)(v | 0x80);
		v >>= 7;
	}
	*q++ = (uint8_t)v;
	return q;
}

static size_t varint_len(uint64_t v)
{
	size_t n = 1;
	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

/* A two-field body (varint 1, varint 2), proto3: zero fields omitted. */
static size_t body_len(uint64_t f1, uint64_t f2)
{
	return (f1 ? 1 + varint_len(f1) : 0) + (f2 ? 1 + varint_len(f2) : 0);
}

static uint8_t *put_body(uint8_t *q, unsigned tag, uint64_t f1, uint64_t f2)
{
	*q++ = (uint8_t)tag;
	q = put_varint(q, body_len(f1, f2));
	if (f1) {
		*q++ = F1_VARINT;
		q = put_varint(q, f1);
	}
	if (f2) {
		*q++ = F2_VARINT;
		q = put_varint(q, f2);
	}
	return q;
}

size_t flat_refs_req_encode(const flat_refs_req *r, uint8_t *out)
{
	uint8_t *q = out;
	if (r->id) {
		*q++ = REQ_ID;
		q = put_varint(q, r->id);
	}
	if (r->no_reply) {
		*q++ = REQ_NO_REPLY;
		*q++ = 1;
	}
	q = put_body(q, TAG((unsigned)r->op, WT_LEN), r->buf_id, r->count);
	return (size_t)(q - out);
}

/* Status with code 0 and message "": empty, or those two fields spelled
 * out with their zero values. */
static bool get_ok_status(const uint8_t *p, const uint8_t *end)
{
	bool have_code = false, have_msg = false;
	unsigned tag;
	uint64_t v;
	while (p < end) {
		if (!get_tag(&p, end, &tag))
			return false;
		if (tag == F1_VARINT && !have_code) {
			if (!get_varint(&p, end, &v) || v != 0)
				return false;
			have_code = true;
		} else if (tag == F2_LEN && !have_msg) {
			if (!get_varint(&p, end, &v) || v != 0)
				return false;
			have_msg = true;
		} else {
			return false;
		}
	}
	return true;
}

bool flat_refs_resp_decode(const uint8_t *p, size_t n, flat_refs_resp *out)
{
	const uint8_t *end = p + n, *sub_end;
	bool have_id = false, have_status = false, have_refs = false;
	unsigned tag;

	memset(out, 0, sizeof(*out));
	while (p < end) {
		if (!get_tag(&p, end, &tag))
			return false;
		if (tag == RESP_ID && !have_id) {
			if (!get_varint(&p, end, &out->id))
				return false;
			have_id = true;
		} else if (tag == RESP_STATUS && !have_status) {
			if (!get_len(&p, end, &sub_end) || !get_ok_status(p, sub_end))
				return false;
			have_status = true;
			p = sub_end;
		} else if (tag == RESP_REFS && !have_refs) {
			if (!get_len(&p, end, &sub_end) ||
			    !get_refs_body(p, sub_end, &out->refs, &out->held))
				return false;
			have_refs = true;
			p = sub_end;
		} else {
			return false;
		}
	}
	return have_status && have_refs;
}

size_t flat_refs_resp_encode(const flat_refs_resp *r, uint8_t *out)
{
	uint8_t *q = out;
	if (r->id) {
		*q++ = RESP_ID;
		q = put_varint(q, r->id);
	}
	*q++ = RESP_STATUS;
	*q++ = 0;
	q = put_body(q, RESP_REFS, r->refs, r->held);
	return (size_t)(q - out);
}
