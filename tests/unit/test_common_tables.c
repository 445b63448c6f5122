/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The tables in common/: status codes (bb_err_name, bb_strerror), op names
 * from the Request descriptor (bb_op_name) and buffer kinds (bb_kind_*).
 * The names pinned here are the ones the daemon's logs and metrics wrote
 * before the tables existed; operators' alerts and dashboards match them.
 */
#include <criterion/criterion.h>
#include <ctype.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>

#include "bufbroker.pb-c.h"
#include "bufbroker/bufbroker.h"
#include "kinds.h"
#include "ops.h"
#include "status.h"

/* ---- status codes -------------------------------------------------------------- */

Test(status, every_code_has_a_name_and_a_sentence)
{
	for (int code = 0; code > -BB_STATUS_COUNT; code--) {
		const char *name = bb_err_name(code), *text = bb_strerror(code);
		cr_assert(name && *name, "code %d has no name", code);
		cr_assert(text && *text, "code %d has no sentence", code);
		cr_assert_str_neq(name, "UNKNOWN", "code %d", code);
		cr_assert_str_neq(text, "unknown error", "code %d", code);
		for (const char *p = name; *p; p++)
			cr_assert(isupper((unsigned char)*p) || *p == '_', "code %d: %s", code,
				  name);
		for (int other = code - 1; other > -BB_STATUS_COUNT; other--) {
			cr_assert_str_neq(name, bb_err_name(other), "codes %d and %d", code, other);
			cr_assert_str_neq(text, bb_strerror(other), "codes %d and %d", code, other);
		}
	}
}

Test(status, the_count_ends_at_the_last_code)
{
	cr_assert_eq(BB_ERR_SYSTEM, -(BB_STATUS_COUNT - 1));
}

Test(status, names_are_the_constants_as_logs_write_them)
{
	static const struct {
		int code;
		const char *name;
	} want[] = {
		{BB_OK, "OK"},
		{BB_ERR_INVALID, "INVALID"},
		{BB_ERR_NOT_FOUND, "NOT_FOUND"},
		{BB_ERR_DENIED, "DENIED"},
		{BB_ERR_NO_MEMORY, "NO_MEMORY"},
		{BB_ERR_TIMEOUT, "TIMEOUT"},
		{BB_ERR_DISCONNECTED, "DISCONNECTED"},
		{BB_ERR_PROTOCOL, "PROTOCOL"},
		{BB_ERR_FAILED, "FAILED"},
		{BB_ERR_UNSUPPORTED, "UNSUPPORTED"},
		{BB_ERR_STATE, "STATE"},
		{BB_ERR_EXISTS, "EXISTS"},
		{BB_ERR_SYSTEM, "SYSTEM"},
	};
	cr_assert_eq(sizeof(want) / sizeof(want[0]), BB_STATUS_COUNT);
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		cr_assert_str_eq(bb_err_name(want[i].code), want[i].name);
}

Test(status, sentences_are_the_ones_bb_strerror_gave)
{
	cr_assert_str_eq(bb_strerror(BB_OK), "success");
	cr_assert_str_eq(bb_strerror(BB_ERR_NOT_FOUND), "no such buffer, name or token");
	cr_assert_str_eq(bb_strerror(BB_ERR_NO_MEMORY), "out of memory or over a limit");
	cr_assert_str_eq(bb_strerror(BB_ERR_SYSTEM), "a system call failed");
}

Test(status, unknown_codes_give_UNKNOWN_and_unknown_error)
{
	const int bad[] = {1, 2, -BB_STATUS_COUNT, -BB_STATUS_COUNT - 1, -1000, INT_MIN, INT_MAX};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_assert_str_eq(bb_err_name(bad[i]), "UNKNOWN", "code %d", bad[i]);
		cr_assert_str_eq(bb_strerror(bad[i]), "unknown error", "code %d", bad[i]);
	}
}

/* ---- ops ----------------------------------------------------------------------- */

/* Whether field f of Request belongs to the op oneof. */
static bool is_op_field(const ProtobufCFieldDescriptor *f)
{
	return (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
	       f->quantifier_offset == offsetof(Bufbroker__Request, op_case);
}

Test(ops, every_op_field_of_the_descriptor_is_named_by_its_field)
{
	const ProtobufCMessageDescriptor *d = &bufbroker__request__descriptor;
	unsigned ops = 0;
	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		if (!is_op_field(f)) {
			cr_assert_str_eq(bb_op_name((int)f->id), "unknown", "field %s is no op",
					 f->name);
			continue;
		}
		ops++;
		cr_assert_str_eq(bb_op_name((int)f->id), f->name);
	}
	cr_assert_eq(ops, 18, "the schema has %u ops; pin the new ones below", ops);
}

Test(ops, names_are_the_ones_logs_and_metrics_wrote)
{
	static const struct {
		int op;
		const char *name;
	} want[] = {
		{BUFBROKER__REQUEST__OP_HELLO, "hello"},
		{BUFBROKER__REQUEST__OP_ALLOC, "alloc"},
		{BUFBROKER__REQUEST__OP_IMPORT_FD, "import_fd"},
		{BUFBROKER__REQUEST__OP_OPEN, "open"},
		{BUFBROKER__REQUEST__OP_RETAIN, "retain"},
		{BUFBROKER__REQUEST__OP_RELEASE, "release"},
		{BUFBROKER__REQUEST__OP_TAKE, "take"},
		{BUFBROKER__REQUEST__OP_ADOPT, "adopt"},
		{BUFBROKER__REQUEST__OP_SET_READY, "set_ready"},
		{BUFBROKER__REQUEST__OP_SET_ERROR, "set_error"},
		{BUFBROKER__REQUEST__OP_WAIT, "wait"},
		{BUFBROKER__REQUEST__OP_STAT, "stat"},
		{BUFBROKER__REQUEST__OP_LIST, "list"},
		{BUFBROKER__REQUEST__OP_SERVER_STATUS, "server_status"},
		{BUFBROKER__REQUEST__OP_CLIENTS, "clients"},
		{BUFBROKER__REQUEST__OP_CHECK, "check"},
		{BUFBROKER__REQUEST__OP_ALLOCATION_FD, "allocation_fd"},
		{BUFBROKER__REQUEST__OP_UPGRADE, "upgrade"},
	};
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
		cr_assert_str_eq(bb_op_name(want[i].op), want[i].name);
}

Test(ops, no_op_and_other_numbers_are_unknown)
{
	/* 0: no op set; 1 and 2: Request.id and no_reply, fields but no ops;
	 * 28 and 1000: no field (past the cached range too). */
	const int bad[] = {BUFBROKER__REQUEST__OP__NOT_SET, 1, 2, 28, 63, 64, 1000, -1, INT_MIN};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		cr_assert_str_eq(bb_op_name(bad[i]), "unknown", "op %d", bad[i]);
}

/* ---- kinds --------------------------------------------------------------------- */

Test(kinds, every_kind_of_the_wire_enum_is_named_after_it)
{
	/* KIND_HOST is "host": the enum value's name, lowercase, without KIND_. */
	const ProtobufCEnumDescriptor *d = &bufbroker__kind__descriptor;
	unsigned kinds = 0;
	for (unsigned i = 0; i < d->n_values; i++) {
		const ProtobufCEnumValue *v = &d->values[i];
		if (v->value == BUFBROKER__KIND__KIND_UNSPECIFIED)
			continue;
		char want[32];
		const char *p = v->name + strlen("KIND_");
		size_t n = 0;
		for (; *p && n < sizeof(want) - 1; p++)
			want[n++] = (char)tolower((unsigned char)*p);
		want[n] = '\0';
		kinds++;
		cr_assert(bb_kind_valid(v->value), "%s", v->name);
		cr_assert_str_eq(bb_kind_name(v->value), want);
		cr_assert_eq(bb_kind_parse(want), v->value);
	}
	cr_assert_eq(kinds, BB_KIND_COUNT);
}

Test(kinds, host_and_cuda_are_the_bb_kinds)
{
	cr_assert_str_eq(bb_kind_name(BB_HOST), "host");
	cr_assert_str_eq(bb_kind_name(BB_CUDA), "cuda");
	cr_assert_eq(bb_kind_parse("host"), BB_HOST);
	cr_assert_eq(bb_kind_parse("cuda"), BB_CUDA);
	for (int k = 1; k <= BB_KIND_COUNT; k++)
		cr_assert(bb_kind_valid(k));
}

Test(kinds, other_values_and_names_are_no_kind)
{
	const int bad[] = {0, BB_KIND_COUNT + 1, -1, INT_MIN, INT_MAX};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_assert_not(bb_kind_valid(bad[i]), "kind %d", bad[i]);
		cr_assert_str_eq(bb_kind_name(bad[i]), "unknown", "kind %d", bad[i]);
	}
	const char *names[] = {"", "HOST", "gpu", "unknown", "host ", NULL};
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		cr_assert_eq(bb_kind_parse(names[i]), 0, "'%s'", names[i] ? names[i] : "(null)");
}
