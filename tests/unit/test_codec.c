/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's codec (daemon/codec.c): a Request whose strings are not
 * UTF-8, or hold a NUL byte that protobuf-c would cut them at, is told
 * apart from one that does not decode, for every string field the schema
 * has, nested or not; bytes fields and unknown fields are not strings.
 * Unit tests link only the broker core, so this file includes the codec.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "../../daemon/codec.c"

static codec *cd;
static codec_request cr;
static char err[128];

static void setup(void)
{
	cd = codec_new(65536);
	cr_assert_not_null(cd);
}

static void teardown(void)
{
	codec_free(cd);
}

TestSuite(codec, .init = setup, .fini = teardown);

/* Pack req; a '#' in the packed bytes becomes `with` (to put a NUL or a
 * byte that is not UTF-8 into a string protobuf-c packs with strlen). */
static size_t pack(const Bufbroker__Request *req, char with, unsigned char *out)
{
	size_t n = bufbroker__request__pack(req, out);
	unsigned char *hash = memchr(out, '#', n);
	if (hash)
		*hash = (unsigned char)with;
	return n;
}

/* Decode n bytes: codec_decode's answer; the request is released. */
static int decode(const unsigned char *p, size_t n, uint64_t want_id)
{
	err[0] = '\0';
	int rc = codec_decode(cd, p, n, &cr, err, sizeof(err));
	if (rc >= 0) {
		cr_assert_eq(cr.req->id, want_id, "the request's id is lost");
		codec_request_done(cd, &cr);
	}
	return rc;
}

static Bufbroker__Request alloc_named(Bufbroker__Alloc *a, const char *name)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	bufbroker__alloc__init(a);
	a->size = 4096;
	a->kind = BUFBROKER__KIND__KIND_HOST;
	a->name = (char *)name;
	req.id = 17;
	req.op_case = BUFBROKER__REQUEST__OP_ALLOC;
	req.alloc = a;
	return req;
}

Test(codec, utf8_strings_decode)
{
	unsigned char buf[256];
	Bufbroker__Alloc a;
	Bufbroker__Request req = alloc_named(&a, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
	cr_assert_eq(decode(buf, pack(&req, '#', buf), 17), 0, "%s", err);
}

Test(codec, a_name_that_is_not_utf8_is_invalid_not_undecodable)
{
	unsigned char buf[256];
	Bufbroker__Alloc a;
	Bufbroker__Request req = alloc_named(&a, "ab#cd");
	cr_assert_eq(decode(buf, pack(&req, (char)0xff, buf), 17), CODEC_INVALID);
	cr_assert_str_eq(err, "Alloc.name is not valid UTF-8 at byte 2 of 5");
}

Test(codec, a_nul_in_a_string_is_invalid)
{
	unsigned char buf[256];
	Bufbroker__Alloc a;
	Bufbroker__Request req = alloc_named(&a, "ab#cd");
	cr_assert_eq(decode(buf, pack(&req, '\0', buf), 17), CODEC_INVALID);
	cr_assert_str_eq(err, "Alloc.name holds a NUL byte at byte 2 of 5");
}

/* Every string field of every request is checked. */
Test(codec, every_string_field_is_checked)
{
	unsigned char buf[256];
	Bufbroker__Hello h = BUFBROKER__HELLO__INIT;
	Bufbroker__ImportFd im = BUFBROKER__IMPORT_FD__INIT;
	Bufbroker__Open o = BUFBROKER__OPEN__INIT;
	Bufbroker__SetError se = BUFBROKER__SET_ERROR__INIT;
	Bufbroker__Stat st = BUFBROKER__STAT__INIT;
	h.client_name = "w#rker";
	im.name = "x#";
	o.target_case = BUFBROKER__OPEN__TARGET_NAME;
	o.name = "#";
	se.id = 3;
	se.message = "broken #";
	st.target_case = BUFBROKER__STAT__TARGET_NAME;
	st.name = "#";
	const struct {
		Bufbroker__Request__OpCase op;
		void *msg; /* the op's message, for the oneof's pointer */
		char with; /* what the '#' in its string becomes */
		const char *field;
	} cases[] = {
		{BUFBROKER__REQUEST__OP_HELLO, &h, (char)0xc0, "Hello.client_name"},
		{BUFBROKER__REQUEST__OP_IMPORT_FD, &im, (char)0xe2, "ImportFd.name"},
		{BUFBROKER__REQUEST__OP_OPEN, &o, '\0', "Open.name"},
		{BUFBROKER__REQUEST__OP_SET_ERROR, &se, (char)0x80, "SetError.message"},
		{BUFBROKER__REQUEST__OP_STAT, &st, (char)0xf5, "Stat.name"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
		req.id = 5;
		req.op_case = cases[i].op;
		req.hello = cases[i].msg; /* the oneof's members share their place */
		cr_assert_eq(decode(buf, pack(&req, cases[i].with, buf), 5), CODEC_INVALID, "%s",
			     cases[i].field);
		cr_assert_not_null(strstr(err, cases[i].field), "%s", err);
	}
}

/* A token is bytes, not a string; an unknown field is not read. */
Test(codec, bytes_and_unknown_fields_are_not_strings)
{
	unsigned char buf[256];
	unsigned char tok[16];
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Adopt ad = BUFBROKER__ADOPT__INIT;
	memset(tok, 0xff, sizeof(tok));
	tok[3] = 0;
	ad.token.data = tok;
	ad.token.len = sizeof(tok);
	req.id = 9;
	req.op_case = BUFBROKER__REQUEST__OP_ADOPT;
	req.adopt = &ad;
	size_t n = bufbroker__request__pack(&req, buf);
	cr_assert_eq(decode(buf, n, 9), 0, "%s", err);

	/* Field 99 of Request, length-delimited, holding 0xff 0x00. */
	const unsigned char unknown[] = {0x9a, 0x06, 2, 0xff, 0x00};
	memcpy(buf + n, unknown, sizeof(unknown));
	cr_assert_eq(decode(buf, n + sizeof(unknown), 9), 0, "%s", err);
}

Test(codec, bytes_that_are_no_request_stay_a_decode_error)
{
	const unsigned char junk[] = {0xff, 0xff, 0xff};
	cr_assert_eq(decode(junk, sizeof(junk), 0), -1);
	cr_assert_not_null(strstr(err, "could not decode"), "%s", err);
}
