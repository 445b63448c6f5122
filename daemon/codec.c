/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The wire codec: flatwire for Retain, Release and RefsReply, protobuf-c
 * (unpacking into a bump arena) for everything else, and the check of the
 * strings protobuf-c unpacked.
 */
#include "codec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "flatwire.h"
#include "utf8.h"

/* Messages nest no deeper than this in a Request (Request > op): deeper
 * ones are not walked for strings. */
#define CODEC_NEST_MAX 4

/* Unpacked requests live here (more spills to malloc): a few hundred bytes
 * each but for a long List cursor or a long name. */
#define CODEC_ARENA_BYTES (64 * 1024)

struct codec {
	uint32_t max_datagram; /* the largest datagram either way */
	bb_arena arena;        /* what protobuf-c unpacks requests into */
	unsigned char *abuf;   /* the arena's block, CODEC_ARENA_BYTES */
	unsigned char *sbuf;   /* the send buffer, max_datagram bytes */
};

codec *codec_new(uint32_t max_datagram)
{
	codec *cd = calloc(1, sizeof(*cd));
	if (!cd)
		return NULL;
	cd->max_datagram = max_datagram;
	cd->abuf = malloc(CODEC_ARENA_BYTES);
	cd->sbuf = malloc(max_datagram);
	if (!cd->abuf || !cd->sbuf) {
		codec_free(cd);
		return NULL;
	}
	bb_arena_init(&cd->arena, cd->abuf, CODEC_ARENA_BYTES);
	return cd;
}

void codec_free(codec *cd)
{
	if (!cd)
		return;
	free(cd->abuf);
	free(cd->sbuf);
	free(cd);
}

/* The flat path: a Retain or Release in the plainest encoding, laid out as
 * protobuf-c would unpack it, with no allocation. */
static bool decode_flat(const unsigned char *data, size_t len, codec_request *out)
{
	flat_refs_req fr;
	if (!flat_refs_req_decode(data, len, &fr))
		return false;
	out->flat = (Bufbroker__Request)BUFBROKER__REQUEST__INIT;
	out->flat.id = fr.id;
	out->flat.no_reply = fr.no_reply;
	if (fr.op == FLAT_OP_RETAIN) {
		out->flat_op.retain = (Bufbroker__Retain)BUFBROKER__RETAIN__INIT;
		out->flat_op.retain.id = fr.buf_id;
		out->flat_op.retain.count = fr.count;
		out->flat.op_case = BUFBROKER__REQUEST__OP_RETAIN;
		out->flat.retain = &out->flat_op.retain;
	} else {
		out->flat_op.release = (Bufbroker__Release)BUFBROKER__RELEASE__INIT;
		out->flat_op.release.id = fr.buf_id;
		out->flat_op.release.count = fr.count;
		out->flat.op_case = BUFBROKER__REQUEST__OP_RELEASE;
		out->flat.release = &out->flat_op.release;
	}
	out->req = &out->flat;
	out->unpacked = NULL;
	return true;
}

/* The varint at *p (before end), moving *p past it; false when it runs
 * past end or over ten bytes. */
static bool read_varint(const unsigned char **p, const unsigned char *end, uint64_t *out)
{
	uint64_t v = 0;
	for (unsigned shift = 0; shift < 70 && *p < end; shift += 7) {
		unsigned char b = *(*p)++;
		v |= (uint64_t)(b & 0x7f) << shift;
		if (!(b & 0x80)) {
			*out = v;
			return true;
		}
	}
	return false;
}

/* Check every string field in the n bytes at p, a message of type desc,
 * and in the messages nested in it: UTF-8 with no NUL byte (protobuf-c
 * checks neither, and unpacks "a\0b" as "a"). It walks the encoding, not
 * the unpacked message, to see each value whole. 0, or -1 with the first
 * bad field named in err. */
static int check_strings(const ProtobufCMessageDescriptor *desc, const unsigned char *p, size_t n,
			 int depth, char *err, size_t errlen)
{
	const unsigned char *end = p + n;
	while (p < end) {
		uint64_t key, len;
		if (!read_varint(&p, end, &key))
			goto malformed;
		switch (key & 7) {
		case 0: /* varint */
			if (!read_varint(&p, end, &len))
				goto malformed;
			continue;
		case 1: /* 64-bit */
			if ((size_t)(end - p) < 8)
				goto malformed;
			p += 8;
			continue;
		case 5: /* 32-bit */
			if ((size_t)(end - p) < 4)
				goto malformed;
			p += 4;
			continue;
		case 2: /* length-delimited: strings, bytes, messages, packed */
			if (!read_varint(&p, end, &len) || len > (uint64_t)(end - p))
				goto malformed;
			break;
		default: goto malformed; /* groups: protobuf-c refuses them */
		}
		const unsigned char *v = p;
		p += len;
		const ProtobufCFieldDescriptor *f = NULL;
		if (key >> 3 <= UINT32_MAX)
			f = protobuf_c_message_descriptor_get_field(desc, (unsigned)(key >> 3));
		if (!f) /* an unknown field: not ours to read */
			continue;
		if (f->type == PROTOBUF_C_TYPE_STRING) {
			const char *s = (const char *)v;
			const char *nul = memchr(s, '\0', len);
			size_t bad = bb_utf8_invalid_at(s, len);
			if (nul || bad < len) {
				snprintf(err, errlen, "%s.%s %s at byte %zu of %zu",
					 desc->short_name, f->name,
					 nul ? "holds a NUL byte" : "is not valid UTF-8",
					 nul ? (size_t)(nul - s) : bad, (size_t)len);
				return -1;
			}
		} else if (f->type == PROTOBUF_C_TYPE_MESSAGE && depth < CODEC_NEST_MAX) {
			if (check_strings(f->descriptor, v, len, depth + 1, err, errlen))
				return -1;
		}
	}
	return 0;
malformed:
	/* protobuf-c unpacked it, so this cannot happen; refuse, to be safe. */
	snprintf(err, errlen, "%s could not be read for its strings", desc->short_name);
	return -1;
}

int codec_decode(codec *cd, const unsigned char *data, size_t len, codec_request *out, char *err,
		 size_t errlen)
{
	if (decode_flat(data, len, out))
		return 0; /* Retain and Release: no strings */
	out->unpacked = bufbroker__request__unpack(&cd->arena.pc, len, data);
	if (!out->unpacked) {
		/* Whatever it had allocated, protobuf-c freed. */
		bb_arena_reset(&cd->arena);
		snprintf(err, errlen, "could not decode request (%zu bytes)", len);
		return -1;
	}
	out->req = out->unpacked;
	if (check_strings(&bufbroker__request__descriptor, data, len, 0, err, errlen))
		return CODEC_INVALID;
	return 0;
}

void codec_request_done(codec *cd, codec_request *r)
{
	if (!r->unpacked)
		return;
	/* Only what spilled over the arena needs freeing. */
	if (cd->arena.spilled)
		bufbroker__request__free_unpacked(r->unpacked, &cd->arena.pc);
	bb_arena_reset(&cd->arena);
	r->unpacked = NULL;
	r->req = NULL;
}

/* Whether r is a successful RefsReply, which flatwire packs: a Status of
 * code 0 and no message, and the two numbers. (Responses are the daemon's
 * own: they carry no unknown fields.) */
static inline bool flat_response(const Bufbroker__Response *r)
{
	return r->result_case == BUFBROKER__RESPONSE__RESULT_REFS && r->status &&
	       r->status->code == 0 && (!r->status->message || !r->status->message[0]);
}

size_t codec_encode(codec *cd, const Bufbroker__Response *r, const unsigned char **out)
{
	*out = cd->sbuf;
	if (flat_response(r)) {
		flat_refs_resp fr = {.id = r->id, .refs = r->refs->refs, .held = r->refs->held};
		/* FLAT_MAX_BYTES is far below any datagram limit the daemon
		 * accepts (config.c). */
		return flat_refs_resp_encode(&fr, cd->sbuf);
	}
	size_t len = bufbroker__response__get_packed_size(r);
	if (len > cd->max_datagram)
		return 0;
	return bufbroker__response__pack(r, cd->sbuf);
}

size_t codec_encode_status(codec *cd, uint64_t id, int code, const char *msg,
			   const unsigned char **out)
{
	Bufbroker__Response r = BUFBROKER__RESPONSE__INIT;
	Bufbroker__Status st = BUFBROKER__STATUS__INIT;
	st.code = code;
	st.message = (char *)(msg ? msg : "");
	r.id = id;
	r.status = &st;
	return codec_encode(cd, &r, out);
}
