/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The hot messages without protobuf-c's generic machinery: Retain and
 * Release requests and their RefsReply answers, which are most of what a
 * busy daemon sees. The bytes on the wire are the protobuf encoding of
 * bufbroker.proto, unchanged; this is a second reader and writer for those
 * few shapes, about twenty times cheaper than protobuf-c's descriptor-driven
 * unpack, allocation and free (docs/PERFORMANCE.md, "Changes to the fast
 * path").
 *
 * The decoders accept only the plainest encoding of each message: every
 * field at most once, the wire types bufbroker.proto gives, no unknown
 * fields, values inside their field's range. Anything else returns false and
 * the caller decodes with protobuf-c as before, so what a message means
 * never depends on which reader read it (tests/unit/test_flatwire.c checks
 * both against each other on millions of generated inputs).
 */
#ifndef BB_FLATWIRE_H
#define BB_FLATWIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Request.op numbers (bufbroker.proto) of the two flat requests. */
#define FLAT_OP_RETAIN 14
#define FLAT_OP_RELEASE 15

/* Longest flat request and response: three tags, two lengths and five
 * varints of at most ten bytes each. */
#define FLAT_MAX_BYTES 64

/* A Retain or Release request. */
typedef struct flat_refs_req {
	uint64_t id;     /* Request.id */
	bool no_reply;   /* Request.no_reply */
	int op;          /* FLAT_OP_RETAIN or FLAT_OP_RELEASE */
	uint64_t buf_id; /* Retain.id / Release.id */
	uint32_t count;  /* Retain.count / Release.count */
} flat_refs_req;

/* A successful RefsReply response (Status code 0, message ""). */
typedef struct flat_refs_resp {
	uint64_t id;   /* Response.id */
	uint64_t refs; /* RefsReply.refs */
	uint32_t held; /* RefsReply.held */
} flat_refs_resp;

/* true: the n bytes at p are a Retain or Release request, decoded into
 * *out. false: decode them with protobuf-c (they may still be valid). */
bool flat_refs_req_decode(const uint8_t *p, size_t n, flat_refs_req *out);

/* Encode r into out (FLAT_MAX_BYTES); returns the length. The bytes are
 * the ones protobuf-c packs for the same message. */
size_t flat_refs_req_encode(const flat_refs_req *r, uint8_t *out);

/* true: the n bytes at p are a successful RefsReply response. false:
 * decode them with protobuf-c (an error Status, another result, ...). */
bool flat_refs_resp_decode(const uint8_t *p, size_t n, flat_refs_resp *out);

/* Encode r into out (FLAT_MAX_BYTES); returns the length, the bytes
 * protobuf-c packs for the same message. */
size_t flat_refs_resp_encode(const flat_refs_resp *r, uint8_t *out);

#endif /* BB_FLATWIRE_H */
