/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The status code table: names and sentences for BB_OK and the BB_ERR_*
 * codes, shared by the daemon, the library and the CLI.
 */
#include "status.h"

typedef struct status_row {
	const char *name; /* as logs and metrics write it */
	const char *text; /* what bb_strerror says */
} status_row;

/* Indexed by -code. */
static const status_row rows[] = {
	[-BB_OK] = {"OK", "success"},
	[-BB_ERR_INVALID] = {"INVALID", "invalid argument"},
	[-BB_ERR_NOT_FOUND] = {"NOT_FOUND", "no such buffer, name or token"},
	[-BB_ERR_DENIED] = {"DENIED", "permission denied"},
	[-BB_ERR_NO_MEMORY] = {"NO_MEMORY", "out of memory or over a limit"},
	[-BB_ERR_TIMEOUT] = {"TIMEOUT", "timed out"},
	[-BB_ERR_DISCONNECTED] = {"DISCONNECTED", "disconnected from the daemon"},
	[-BB_ERR_PROTOCOL] = {"PROTOCOL", "protocol error"},
	[-BB_ERR_FAILED] = {"FAILED", "the buffer is in the failed state"},
	[-BB_ERR_UNSUPPORTED] = {"UNSUPPORTED", "not supported"},
	[-BB_ERR_STATE] = {"STATE", "the buffer is in the wrong state"},
	[-BB_ERR_EXISTS] = {"EXISTS", "the name is taken"},
	[-BB_ERR_SYSTEM] = {"SYSTEM", "a system call failed"},
};

_Static_assert(sizeof(rows) / sizeof(rows[0]) == BB_STATUS_COUNT,
	       "BB_STATUS_COUNT is the number of rows: a code without its row, or a row too many");

/* The row of code, NULL for a code not in the table (a gap left by a
 * missing row included). */
static const status_row *row_of(int code)
{
	return code <= 0 && code > -BB_STATUS_COUNT && rows[-code].name ? &rows[-code] : NULL;
}

__attribute__((visibility("default"))) const char *bb_strerror(int err)
{
	const status_row *r = row_of(err);
	return r ? r->text : "unknown error";
}

__attribute__((visibility("default"))) const char *bb_err_name(int err)
{
	const status_row *r = row_of(err);
	return r ? r->name : "UNKNOWN";
}
