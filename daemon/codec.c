/*
 * The wire codec: flatwire for Retain, Release and RefsReply, protobuf-c
 * (unpacking into a bump arena) for everything else.
 */
#include "codec.h"

#include <stdio.h>
#include <stdlib.h>

#include "arena.h"
#include "flatwire.h"

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

int codec_decode(codec *cd, const unsigned char *data, size_t len, codec_request *out, char *err,
		 size_t errlen)
{
	if (decode_flat(data, len, out))
		return 0;
	out->unpacked = bufbroker__request__unpack(&cd->arena.pc, len, data);
	if (!out->unpacked) {
		/* Whatever it had allocated, protobuf-c freed. */
		bb_arena_reset(&cd->arena);
		snprintf(err, errlen, "could not decode request (%zu bytes)", len);
		return -1;
	}
	out->req = out->unpacked;
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
