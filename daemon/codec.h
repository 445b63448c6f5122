/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Turn a datagram into a request and a response into bytes: the one place
 * the daemon reads and writes the wire. The commonest messages (Retain,
 * Release and their RefsReply) take flatwire's cheap path, everything else
 * protobuf-c's; either way the caller sees the same Bufbroker__Request and
 * hands in the same Bufbroker__Response, so no other layer knows which
 * encoder ran (flatwire.h: the bytes are identical).
 *
 * A codec is used by one thread at a time (the loop thread): it owns the
 * arena requests are unpacked into and the buffer responses are packed
 * into.
 */
#ifndef BB_CODEC_H
#define BB_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bufbroker.pb-c.h"

typedef struct codec codec;

/* A decoded request: read req. What it points to is valid until
 * codec_request_done. */
typedef struct codec_request {
	const Bufbroker__Request *req; /* the request, however it was decoded */
	Bufbroker__Request *unpacked;  /* protobuf-c's, to free; NULL on the flat path */
	Bufbroker__Request flat;       /* the flat path's request ... */
	union {
		Bufbroker__Retain retain; /* ... and its op */
		Bufbroker__Release release;
	} flat_op;
} codec_request;

/* A codec for datagrams of at most max_datagram bytes. NULL out of
 * memory. */
codec *codec_new(uint32_t max_datagram);
void codec_free(codec *cd);

/* What codec_decode returns for a Request with a bad string. Positive. */
#define CODEC_INVALID 1

/* Decode the len bytes at data (len > 0) into *out. 0; or -1 when they are
 * no Request (err, errlen bytes, says so; nothing to release); or
 * CODEC_INVALID when they are one, but a string in it is not UTF-8 or
 * holds a NUL byte (err names the field): *out is the request all the
 * same, to be refused with BB_ERR_INVALID and its id. At most one request
 * is outstanding: release it with codec_request_done before the next
 * decode. */
int codec_decode(codec *cd, const unsigned char *data, size_t len, codec_request *out, char *err,
		 size_t errlen);
/* Release what decoding *r allocated. */
void codec_request_done(codec *cd, codec_request *r);

/* Encode r (its status set) into the codec's send buffer: *out points at
 * the bytes until the next encode. Returns their length (> 0: every
 * response has a Status), or 0 when r does not fit in one datagram. */
size_t codec_encode(codec *cd, const Bufbroker__Response *r, const unsigned char **out);
/* Encode a response that is only a status (id, code, msg; msg NULL is
 * ""), as codec_encode does. */
size_t codec_encode_status(codec *cd, uint64_t id, int code, const char *msg,
			   const unsigned char **out);

#endif /* BB_CODEC_H */
