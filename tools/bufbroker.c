/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bufbroker: the operator's view of a running bufbrokerd.
 *
 *   bufbroker [-s PATH] [--json] status
 *   bufbroker [-s PATH] [--json] ls [--uid UID] [--name GLOB] [--state STATE] [--kind KIND]
 *   bufbroker [-s PATH] [--json] stat ID | NAME | --id ID | --name NAME
 *   bufbroker [-s PATH] [--json] clients
 *   bufbroker [-s PATH] top [-n N]
 *   bufbroker [-s PATH] [--json] check
 *   bufbroker [-s PATH] [--json] upgrade [--binary PATH]
 *   bufbroker help [COMMAND]  (or COMMAND --help)
 *
 * The public API has no List, ServerStatus, Stat by name, Clients or Check,
 * so this tool speaks the wire protocol through the library's raw request
 * path (bbc_call). Human output is for people and may change; the --json output
 * (one object per command, on one line) is the interface for scripts.
 *
 * Exit status (help_exit): 0 success, 1 the daemon answered with an error,
 * 2 the command line is wrong, 3 the daemon could not be reached, 4 no such
 * buffer.
 */
#include <errno.h>
#include <fnmatch.h>
#include <getopt.h>
#include <grp.h>
#include <inttypes.h>
#include <libgen.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "size.h"
#include "bufbroker/bufbroker.h"
#include "client_internal.h"
#include "cuda_api.h"
#include "kinds.h"
#include "wire.h"

enum {
	EXIT_DAEMON = 1,      /* the daemon answered with an error; check found a problem */
	EXIT_USAGE = 2,       /* the command line is wrong */
	EXIT_UNREACHABLE = 3, /* no connection to the daemon, or it broke */
	EXIT_NOT_FOUND = 4,   /* no buffer of that id or name (that this user may see) */
};

/* The command line, once parsed. */
struct cli {
	const char *socket;    /* -s, --socket; NULL: the library's default */
	bool json;             /* --json */
	bool help;             /* -h, --help: print the command's help (or the overview) */
	const char *command;   /* status, ls, stat, clients, top, check, help */
	const char *target;    /* stat's positional argument, or NULL */
	const char *id_arg;    /* stat --id */
	const char *name_arg;  /* stat --name, ls --name (a glob) */
	const char *uid_arg;   /* ls --uid */
	const char *state_arg; /* ls --state */
	const char *kind_arg;  /* ls --kind */
	const char *count_arg; /* top -n */
	const char *binary;    /* upgrade --binary */
};

/* ls filters, once checked; a row must pass every one that is set. */
struct ls_filter {
	bool has_uid;     /* --uid given */
	uint32_t uid;     /* owner uid */
	const char *glob; /* --name: fnmatch(3) pattern; unnamed buffers never match */
	int state;        /* --state: a Bufbroker__State, or -1 */
	int kind;         /* --kind: a Bufbroker__Kind, or -1 */
};

/* A command: what `bufbroker help` lists and `bufbroker help NAME` prints. */
struct command {
	const char *name;     /* as typed */
	const char *args;     /* its synopsis after "bufbroker [-s PATH] " */
	const char *summary;  /* one line for the overview */
	const char *details;  /* its help, after the synopsis */
	bool not_found_exits; /* it names a buffer: exit 4 when there is none */
};

static const struct command commands[] = {
	{"status", "[--json] status",
	 "the daemon's version, uptime, connections, totals and CUDA devices",
	 "The daemon's version and protocol, pid, uptime, open connections (this\n"
	 "command's own included), live buffers and bytes per kind, live tokens,\n"
	 "parked waits, and each CUDA device it serves (or why it serves none).\n",
	 false},
	{"ls", "[--json] ls [--uid UID] [--name GLOB] [--state STATE] [--kind KIND]",
	 "every buffer this user may see, filtered",
	 "Every buffer this user may see (its share policy admits you, or you hold\n"
	 "it; root sees all). Filters, all of which a buffer must pass:\n"
	 "  --uid UID         owner (a number or a user name)\n"
	 "  --name GLOB       name matching a shell pattern (unnamed buffers never do)\n"
	 "  --state STATE     pending, ready or failed\n"
	 "  --kind KIND       host or cuda\n",
	 false},
	{"stat", "[--json] stat ID | NAME | --id ID | --name NAME", "one buffer in full",
	 "One buffer in full: what ls shows plus its tokens, owner uid and gid, share\n"
	 "policy, age and, for a failed buffer, its error. An argument of digits\n"
	 "only is an id, anything else a name; --id ID and --name NAME say which.\n",
	 true},
	{"clients", "[--json] clients", "the open connections and what each holds",
	 "The open connections (root: all; others: their own uid's) with uid, pid,\n"
	 "process, client name, buffers and bytes held, tokens, parked waits, age.\n",
	 false},
	{"top", "top [-n N]", "a live view, redrawn every second",
	 "A live view redrawn every second: the daemon's totals and devices, the\n"
	 "connections holding the most, the largest buffers. q or Ctrl-C quits.\n"
	 "It has no --json form.\n"
	 "  -n N              stop after N frames (for a log or a script)\n",
	 false},
	{"check", "[--json] check", "verify the daemon's reference counts and totals",
	 "Ask the daemon to verify its reference counts and totals (root or the\n"
	 "daemon's uid): prints ok with the totals, or each problem and exits 1.\n",
	 false},
	{"upgrade", "[--json] upgrade [--binary PATH]",
	 "re-execute the daemon in place, keeping every buffer",
	 "Make the daemon re-execute its binary (or PATH) in the same process,\n"
	 "keeping every buffer, reference and token and its socket (root or the\n"
	 "daemon's uid; the daemon must keep its state: --restart). The binary\n"
	 "must first say it reads the daemon's state (PATH --check-journal-version),\n"
	 "else nothing happens. Waits until the new image serves, then prints its\n"
	 "pid and what it restored. Clients pause and resume their sessions.\n"
	 "  --binary PATH     the binary to run (default: the daemon's own, the file\n"
	 "                    at the path it was started from)\n",
	 false},
	{"help", "help [COMMAND]", "this text, or a command's help",
	 "This overview, or the help of COMMAND (as 'bufbroker COMMAND --help').\n", false},
};

#define NCOMMANDS (sizeof(commands) / sizeof(commands[0]))

static const struct command *command_find(const char *name)
{
	for (size_t i = 0; i < NCOMMANDS; i++)
		if (strcmp(commands[i].name, name) == 0)
			return &commands[i];
	return NULL;
}

/* The options every command takes. */
static void help_options(FILE *f)
{
	fprintf(f,
		"Options:\n"
		"  -s, --socket PATH  the daemon's socket; default $BUFBROKER_SOCKET, else\n"
		"                     $XDG_RUNTIME_DIR/%s, else\n"
		"                     %s\n"
		"  --json             one JSON object on stdout instead of text\n"
		"  --version          print the version and exit\n"
		"  -h, --help         print the help (of the command given) and exit\n",
		BB_USER_SOCKET_NAME, BB_SYSTEM_SOCKET);
}

/* The exit statuses; a command that names no buffer never exits 4. */
static void help_exit(FILE *f, bool not_found)
{
	fprintf(f,
		"Exit status:\n"
		"  0  success\n"
		"  1  the daemon answered with an error (or check found a problem)\n"
		"  2  the command line is wrong\n"
		"  3  the daemon could not be reached: no socket, nobody listening, no\n"
		"     permission, the connection refused or broken\n"
		"%s",
		not_found ? "  4  not found: no buffer of that id or name that you may see\n" : "");
}

/* The overview: bufbroker --help, bufbroker help. */
static void usage(FILE *f)
{
	fputs("Usage: bufbroker [-s PATH] [--json] COMMAND [ARGS]\n\nCommands:\n", f);
	for (size_t i = 0; i < NCOMMANDS; i++)
		fprintf(f, "  %-9s %s\n", commands[i].name, commands[i].summary);
	fputs("\n'bufbroker help COMMAND' or 'bufbroker COMMAND --help' tells more.\n\n", f);
	help_options(f);
	fputc('\n', f);
	help_exit(f, true);
}

/* One command's help: bufbroker help NAME, bufbroker NAME --help. */
static void command_help(FILE *f, const struct command *cmd)
{
	if (strcmp(cmd->name, "help") == 0) {
		usage(f);
		return;
	}
	fprintf(f, "Usage: bufbroker [-s PATH] %s\n\n%s\n", cmd->args, cmd->details);
	help_options(f);
	fputc('\n', f);
	help_exit(f, cmd->not_found_exits);
}

/* The command on the line once it is known, for usage_error's advice. */
static const struct command *g_command;

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Say what is wrong with the command line; returns EXIT_USAGE. */
static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fputs("bufbroker: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	if (g_command && strcmp(g_command->name, "help") != 0)
		fprintf(stderr, "\nTry 'bufbroker %s --help'.\n", g_command->name);
	else
		fputs("\nTry 'bufbroker --help'.\n", stderr);
	return EXIT_USAGE;
}

/* Say what the daemon (or the library) said; the exit status for err. */
static int daemon_error(int err)
{
	const char *msg = bb_last_error();

	fprintf(stderr, "bufbroker: %s\n", msg && *msg ? msg : bb_strerror(err));
	switch (err) {
	case BB_ERR_NOT_FOUND: return EXIT_NOT_FOUND;
	case BB_ERR_DISCONNECTED: return EXIT_UNREACHABLE;
	default: return EXIT_DAEMON;
	}
}

/* The socket at path refused this user: who may use it, and how to join
 * them. The socket's group (its directory's when the socket cannot be
 * seen); a packaged daemon gives it to the group bufbroker. */
static void socket_denied_hint(const char *path)
{
	char dir[4096];
	struct stat st;
	const struct group *g = NULL;

	snprintf(dir, sizeof(dir), "%s", path);
	bool seen = stat(path, &st) == 0 || stat(dirname(dir), &st) == 0;
	if (seen && st.st_gid != 0)
		g = getgrgid(st.st_gid);
	if (g)
		fprintf(stderr,
			"bufbroker: hint: the socket is for the members of the group '%s'; join it\n"
			"  with 'sudo usermod -aG %s $USER', then log in again (or run 'newgrp %s')\n",
			g->gr_name, g->gr_name, g->gr_name);
	else
		fprintf(stderr,
			"bufbroker: hint: %s; a packaged bufbrokerd gives\n"
			"  it to the group 'bufbroker' (--socket-group): join it with\n"
			"  'sudo usermod -aG bufbroker $USER', then log in again\n",
			seen && st.st_gid == 0 ? "only root may use this socket"
					       : "this socket is not yours to use");
}

/* bb_connect to path (NULL: the default) failed with err: say why, with a
 * hint when the socket's permissions refused this user. */
static int connect_error(int err, const char *path)
{
	char dflt[4096];

	daemon_error(err);
	if (!path)
		path = bbc_default_socket(dflt, sizeof(dflt));
	/* DENIED also answers a peer no allow-list admits: that is the
	 * daemon's word, and the socket was writable. */
	if (err == BB_ERR_DENIED && access(path, W_OK) != 0 && errno == EACCES)
		socket_denied_hint(path);
	return EXIT_UNREACHABLE;
}

/* daemon_error for an op added in protocol minor 1: an older daemon does
 * not know it and says "unknown or missing op". */
static int daemon_error_v1_1(int err, const char *command)
{
	if (err == BB_ERR_PROTOCOL) {
		fprintf(stderr,
			"bufbroker: the daemon does not support '%s' (it needs protocol %d.1 or "
			"later): %s\n",
			command, BB_PROTO_MAJOR, bb_last_error());
		return EXIT_DAEMON;
	}
	return daemon_error(err);
}

/* ---- formatting ------------------------------------------------------- */

/* "512 B", "4.0 KiB", "64.0 MiB", "1.5 GiB". */
static void fmt_size(uint64_t n, char *out, size_t cap)
{
	bb_size_format(n, out, cap);
}

/* "250ms" below a second, else "3h 2m 5s" (with days when there are any). */
static void fmt_duration(uint64_t ms, char *out, size_t cap)
{
	uint64_t s = ms / 1000, d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60;

	if (ms < 1000)
		snprintf(out, cap, "%" PRIu64 "ms", ms);
	else if (d)
		snprintf(out, cap, "%" PRIu64 "d %" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", d, h, m,
			 s % 60);
	else if (h)
		snprintf(out, cap, "%" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", h, m, s % 60);
	else if (m)
		snprintf(out, cap, "%" PRIu64 "m %" PRIu64 "s", m, s % 60);
	else
		snprintf(out, cap, "%" PRIu64 "s", s);
}

static const char *state_str(Bufbroker__State s)
{
	switch (s) {
	case BUFBROKER__STATE__STATE_PENDING: return "pending";
	case BUFBROKER__STATE__STATE_READY: return "ready";
	case BUFBROKER__STATE__STATE_FAILED: return "failed";
	default: return "unknown";
	}
}

static const char *share_str(uint32_t share)
{
	switch (share) {
	case BB_SHARE_UID: return "uid";
	case BB_SHARE_GID: return "gid";
	case BB_SHARE_ANY: return "any";
	default: return "unknown";
	}
}

/* Names and error messages come from other users' processes: never let
 * their control characters reach a terminal. */
static void put_text(const char *s)
{
	for (; *s; s++)
		putchar((unsigned char)*s < 0x20 || *s == 0x7f ? '?' : *s);
}

/* Columns a string takes: UTF-8 continuation bytes take none. */
static size_t text_width(const char *s)
{
	size_t w = 0;

	for (; *s; s++)
		w += ((unsigned char)*s & 0xc0) != 0x80;
	return w;
}

/* ---- JSON ------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s, or 0 when it is not one. */
static int utf8_len(const unsigned char *s)
{
	int n, i;
	uint32_t cp;

	if (s[0] < 0x80)
		return 1;
	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		n = 2, cp = s[0] & 0x1f;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		n = 3, cp = s[0] & 0x0f;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		n = 4, cp = s[0] & 0x07;
	else
		return 0;
	for (i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80) /* also stops at the NUL */
			return 0;
		cp = cp << 6 | (s[i] & 0x3f);
	}
	/* Overlong forms, surrogates and code points past U+10FFFF. */
	if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
	    (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	return n;
}

/* A JSON string: quotes and backslashes escaped, control characters as
 * \u00XX, bytes that are not UTF-8 as U+FFFD, so the output always parses. */
static void json_str(const char *s)
{
	const unsigned char *p = (const unsigned char *)(s ? s : "");

	putchar('"');
	while (*p) {
		int n = utf8_len(p);

		if (n == 0) {
			fputs("\\ufffd", stdout);
			p++;
		} else if (*p == '"' || *p == '\\') {
			printf("\\%c", *p++);
		} else if (*p < 0x20) {
			printf("\\u%04x", *p++);
		} else {
			fwrite(p, 1, (size_t)n, stdout);
			p += n;
		}
	}
	putchar('"');
}

/* How a CUDA buffer is shared: "legacy" (IPC handle) or "vmm" (an
 * allocation's file descriptor); "" for a host buffer. A daemon before
 * protocol 1.2 sends no kind: its CUDA buffers are all legacy. */
static const char *handle_str(const Bufbroker__BufferInfo *b)
{
	if (b->kind != BUFBROKER__KIND__KIND_CUDA)
		return "";
	return b->cuda_handle == BUFBROKER__CUDA_HANDLE__CUDA_HANDLE_VMM ? "vmm" : "legacy";
}

static void json_buffer(const Bufbroker__BufferInfo *b)
{
	printf("{\"id\":%" PRIu64 ",\"name\":", b->id);
	json_str(b->name);
	printf(",\"kind\":\"%s\",\"device\":%" PRId32 ",\"cuda_handle\":\"%s\",\"size\":%" PRIu64
	       ",\"state\":\"%s\",\"refs\":%" PRIu64 ",\"tokens\":%" PRIu32
	       ",\"owner_uid\":%" PRIu32 ",\"owner_gid\":%" PRIu32
	       ",\"share\":\"%s\",\"age_ms\":%" PRIu64 ",\"error\":",
	       bb_kind_name(b->kind), b->device, handle_str(b), b->size, state_str(b->state),
	       b->refs, b->tokens, b->owner_uid, b->owner_gid, share_str(b->share), b->age_ms);
	json_str(b->error);
	putchar('}');
}

/* ---- talking to the daemon -------------------------------------------- */

/* Send req and check the answer. 0: *out is a successful response carrying
 * the result want (free it with bbc_response_free). Otherwise a BB_ERR_*
 * code with bb_last_error() set, the daemon's message when it gave one. */
static int cli_call(bb_client *c, Bufbroker__Request *req, Bufbroker__Response__ResultCase want,
		    Bufbroker__Response **out)
{
	Bufbroker__Response *r;
	int err = bbc_call(c, req, -1, &r, NULL);

	if (err)
		return err;
	if (!r->status) {
		err = bbc_fail(BB_ERR_PROTOCOL, "the daemon's answer has no status");
	} else if (r->status->code != 0) {
		const char *msg = r->status->message;

		err = bbc_fail(r->status->code, "%s",
			       msg && *msg ? msg : bb_strerror(r->status->code));
	} else if (r->result_case != want) {
		err = bbc_fail(BB_ERR_PROTOCOL, "the daemon answered with an unexpected result");
	} else {
		*out = r;
		return 0;
	}
	bbc_response_free(r);
	return err;
}

/* ---- commands --------------------------------------------------------- */

/* Add a ServerStatus reply's buffers and bytes to buffers[kind] and
 * bytes[kind]; totals of a kind this CLI does not know are left out. */
static void kind_totals(const Bufbroker__ServerStatusReply *s, uint64_t buffers[BB_KIND_COUNT + 1],
			uint64_t bytes[BB_KIND_COUNT + 1])
{
	for (size_t i = 0; i < s->n_kinds; i++) {
		const Bufbroker__KindTotals *k = s->kinds[i];

		if (bb_kind_valid(k->kind)) {
			buffers[k->kind] += k->buffers;
			bytes[k->kind] += k->bytes;
		}
	}
}

/* "GPU-xxxxxxxx-..." of a DeviceInfo's uuid, or "-" when it is not 16 bytes. */
static const char *device_uuid(const Bufbroker__DeviceInfo *d, char out[48])
{
	if (d->uuid.len != 16)
		return strcpy(out, "-");
	bb_cuda_uuid_format(d->uuid.data, out);
	return out;
}

static void json_devices(const Bufbroker__ServerStatusReply *s)
{
	char uuid[48];
	size_t i;

	fputs(",\"devices\":[", stdout);
	for (i = 0; i < s->n_devices; i++) {
		const Bufbroker__DeviceInfo *d = s->devices[i];

		printf("%s{\"ordinal\":%" PRId32 ",\"name\":", i ? "," : "", d->ordinal);
		json_str(d->name);
		fputs(",\"uuid\":", stdout);
		json_str(device_uuid(d, uuid));
		printf(",\"total_bytes\":%" PRIu64 ",\"free_bytes\":%" PRIu64
		       ",\"used_bytes\":%" PRIu64 ",\"reserved_bytes\":%" PRIu64
		       ",\"limit_bytes\":%" PRIu64 ",\"vmm\":%s,\"vmm_unavailable\":",
		       d->total_bytes, d->free_bytes, d->used_bytes, d->reserved_bytes,
		       d->limit_bytes, d->vmm ? "true" : "false");
		json_str(d->vmm_unavailable);
		printf(",\"vmm_allocations\":%" PRIu64 "}", d->vmm_allocations);
	}
	fputs("],\"cuda\":", stdout);
	json_str(s->cuda);
}

static void text_devices(const Bufbroker__ServerStatusReply *s)
{
	char uuid[48], a[32], b[32], c[32];
	size_t i;

	if (s->cuda && *s->cuda) {
		fputs("cuda            unavailable: ", stdout);
		put_text(s->cuda);
		putchar('\n');
		return;
	}
	printf("cuda devices    %zu\n", s->n_devices);
	for (i = 0; i < s->n_devices; i++) {
		const Bufbroker__DeviceInfo *d = s->devices[i];

		printf("device %-8" PRId32 " ", d->ordinal);
		put_text(d->name);
		printf(", %s\n", device_uuid(d, uuid));
		fmt_size(d->total_bytes, a, sizeof(a));
		fmt_size(d->free_bytes, b, sizeof(b));
		printf("  memory        %s total, %s free\n", a, b);
		fmt_size(d->used_bytes, a, sizeof(a));
		fmt_size(d->reserved_bytes, b, sizeof(b));
		fmt_size(d->limit_bytes, c, sizeof(c));
		printf("  broker        %s in buffers, %s reserved, limit %s\n", a, b, c);
		if (d->vmm) {
			printf("  vmm           yes, %" PRIu64 " allocations held\n",
			       d->vmm_allocations);
		} else {
			fputs("  vmm           no: ", stdout);
			put_text(d->vmm_unavailable);
			putchar('\n');
		}
	}
}

static int cmd_status(bb_client *c, bool json)
{
	Bufbroker__ServerStatus op = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__ServerStatusReply *s;
	uint64_t buffers[BB_KIND_COUNT + 1] = {0}, bytes[BB_KIND_COUNT + 1] = {0}; /* by kind */
	char up[64], sz[32];
	int err;

	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &op;
	err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_SERVER_STATUS, &r);
	if (err)
		return daemon_error(err);
	s = r->server_status;
	kind_totals(s, buffers, bytes);

	if (json) {
		fputs("{\"version\":", stdout);
		json_str(s->server_version);
		printf(",\"protocol\":\"%" PRIu32 ".%" PRIu32 "\",\"pid\":%" PRIu32
		       ",\"uptime_ms\":%" PRIu64 ",\"connections\":%" PRIu32 ",\"tokens\":%" PRIu64
		       ",\"waits\":%" PRIu64 ",\"restarts\":%" PRIu64
		       ",\"restored_buffers\":%" PRIu64 ",\"absent_sessions\":%" PRIu32
		       ",\"journal_bytes\":%" PRIu64 ",\"restart_protected\":%s"
		       ",\"unprotected_buffers\":%" PRIu64 ",\"kinds\":{",
		       s->version_major, s->version_minor, s->pid, s->uptime_ms, s->connections,
		       s->tokens, s->waits, s->restarts, s->restored_buffers, s->absent_sessions,
		       s->journal_bytes, s->restart_protected ? "true" : "false",
		       s->unprotected_buffers);
		for (int k = 1; k <= BB_KIND_COUNT; k++)
			printf("%s\"%s\":{\"buffers\":%" PRIu64 ",\"bytes\":%" PRIu64 "}",
			       k > 1 ? "," : "", bb_kind_name(k), buffers[k], bytes[k]);
		putchar('}');
		json_devices(s);
		fputs("}\n", stdout);
	} else {
		fmt_duration(s->uptime_ms, up, sizeof(up));
		fputs("server version  ", stdout);
		put_text(s->server_version);
		printf("\nprotocol        %" PRIu32 ".%" PRIu32 "\n", s->version_major,
		       s->version_minor);
		printf("pid             %" PRIu32 "\n", s->pid);
		printf("uptime          %s\n", up);
		printf("connections     %" PRIu32 "\n", s->connections);
		for (int k = 1; k <= BB_KIND_COUNT; k++) {
			fmt_size(bytes[k], sz, sizeof(sz));
			printf("%s buffers    %" PRIu64 " (%s, %" PRIu64 " bytes)\n",
			       bb_kind_name(k), buffers[k], sz, bytes[k]);
		}
		printf("live tokens     %" PRIu64 "\n", s->tokens);
		printf("parked waits    %" PRIu64 "\n", s->waits);
		if (s->journal_bytes) {
			fmt_size(s->journal_bytes, sz, sizeof(sz));
			printf("restart         %s; journal %s; %" PRIu64 " restarts, %" PRIu64
			       " buffers restored, %" PRIu32 " sessions absent, %" PRIu64
			       " buffers unprotected\n",
			       s->restart_protected ? "protected (fd store)" : "not protected", sz,
			       s->restarts, s->restored_buffers, s->absent_sessions,
			       s->unprotected_buffers);
		}
		text_devices(s);
	}
	bbc_response_free(r);
	return 0;
}

enum {
	COL_ID,
	COL_NAME,
	COL_KIND,
	COL_DEV,
	COL_HANDLE,
	COL_SIZE,
	COL_STATE,
	COL_REFS,
	COL_OWNER,
	NCOLS
};

static const char *const col_title[NCOLS] = {"ID",   "NAME",  "KIND", "DEV",  "HANDLE",
					     "SIZE", "STATE", "REFS", "OWNER"};
static const bool col_right[NCOLS] = {true, false, false, true, false, true, false, true, true};

/* One ls row as text; the name is the only cell that can be long. */
struct ls_row {
	char cell[NCOLS][32];
	const char *name;
};

static void ls_row_fill(const Bufbroker__BufferInfo *b, struct ls_row *row)
{
	snprintf(row->cell[COL_ID], 32, "%" PRIu64, b->id);
	row->name = b->name && *b->name ? b->name : "-";
	snprintf(row->cell[COL_KIND], 32, "%s", bb_kind_name(b->kind));
	if (b->kind == BUFBROKER__KIND__KIND_CUDA)
		snprintf(row->cell[COL_DEV], 32, "%" PRId32, b->device);
	else
		snprintf(row->cell[COL_DEV], 32, "-");
	snprintf(row->cell[COL_HANDLE], 32, "%s", *handle_str(b) ? handle_str(b) : "-");
	fmt_size(b->size, row->cell[COL_SIZE], 32);
	snprintf(row->cell[COL_STATE], 32, "%s", state_str(b->state));
	snprintf(row->cell[COL_REFS], 32, "%" PRIu64, b->refs);
	snprintf(row->cell[COL_OWNER], 32, "%" PRIu32, b->owner_uid);
}

/* One table row: each cell padded to its column's width, right-aligned
 * where right[i], two spaces between columns, no trailing blanks. */
static void print_row(int ncols, const char *const cells[], const size_t width[],
		      const bool right[])
{
	for (int i = 0; i < ncols; i++) {
		size_t pad = width[i] - text_width(cells[i]);

		if (right[i])
			printf("%*s", (int)pad, "");
		put_text(cells[i]);
		if (i == ncols - 1)
			break;
		printf("%*s", (int)(right[i] ? 2 : pad + 2), "");
	}
	putchar('\n');
}

static void ls_print_row(const char *const cells[NCOLS], const size_t width[NCOLS])
{
	print_row(NCOLS, cells, width, col_right);
}

/* Print rows[0..nrows) (each ncols cells) under the titles, each column as
 * wide as its widest cell. */
static void print_table(int ncols, const char *const title[], const bool right[],
			const char *const *const rows[], size_t nrows)
{
	size_t width[16];

	for (int k = 0; k < ncols; k++)
		width[k] = text_width(title[k]);
	for (size_t i = 0; i < nrows; i++)
		for (int k = 0; k < ncols; k++) {
			size_t w = text_width(rows[i][k]);

			if (w > width[k])
				width[k] = w;
		}
	print_row(ncols, title, width, right);
	for (size_t i = 0; i < nrows; i++)
		print_row(ncols, rows[i], width, right);
}

static int by_id(const void *a, const void *b)
{
	uint64_t x = (*(Bufbroker__BufferInfo *const *)a)->id;
	uint64_t y = (*(Bufbroker__BufferInfo *const *)b)->id;

	return (x > y) - (x < y);
}

/* Every page of the daemon's list, in id order. The daemon answers as many
 * rows as fit in one datagram and says when more follow. */
struct ls_pages {
	Bufbroker__Response **pages; /* responses, freed at the end */
	size_t npages;
	Bufbroker__BufferInfo **rows; /* rows of all pages */
	size_t nrows, cap;
};

static void ls_pages_free(struct ls_pages *p)
{
	for (size_t i = 0; i < p->npages; i++)
		bbc_response_free(p->pages[i]);
	free(p->pages);
	free(p->rows);
}

static int ls_fetch(bb_client *c, struct ls_pages *p)
{
	uint64_t after = 0;
	for (;;) {
		Bufbroker__List op = BUFBROKER__LIST__INIT;
		Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
		Bufbroker__Response *r, **pages;
		int err;

		op.after_id = after;
		req.op_case = BUFBROKER__REQUEST__OP_LIST;
		req.list = &op;
		err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_LIST, &r);
		if (err)
			return err;
		pages = realloc(p->pages, (p->npages + 1) * sizeof(*pages));
		if (!pages) {
			bbc_response_free(r);
			return BB_ERR_NO_MEMORY;
		}
		p->pages = pages;
		p->pages[p->npages++] = r;
		Bufbroker__ListReply *l = r->list;
		for (size_t i = 0; i < l->n_buffers; i++) {
			if (p->nrows == p->cap) {
				size_t cap = p->cap ? p->cap * 2 : 64;
				Bufbroker__BufferInfo **rows =
					realloc(p->rows, cap * sizeof(*rows));
				if (!rows)
					return BB_ERR_NO_MEMORY;
				p->rows = rows;
				p->cap = cap;
			}
			p->rows[p->nrows++] = l->buffers[i];
			if (l->buffers[i]->id > after)
				after = l->buffers[i]->id;
		}
		if (!l->truncated || l->n_buffers == 0)
			return 0;
	}
}

static bool ls_match(const Bufbroker__BufferInfo *b, const struct ls_filter *f)
{
	if (f->has_uid && b->owner_uid != f->uid)
		return false;
	if (f->state >= 0 && (int)b->state != f->state)
		return false;
	if (f->kind >= 0 && (int)b->kind != f->kind)
		return false;
	if (f->glob && (!b->name || !*b->name || fnmatch(f->glob, b->name, 0) != 0))
		return false;
	return true;
}

static int cmd_ls(bb_client *c, bool json, const struct ls_filter *f)
{
	struct ls_pages p = {0};
	size_t width[NCOLS], i, kept = 0;
	const char *cells[NCOLS];
	struct ls_row row;
	int err;

	err = ls_fetch(c, &p);
	if (err) {
		ls_pages_free(&p);
		return daemon_error(err);
	}
	/* The daemon has no filters: keep the matching rows here. */
	for (i = 0; i < p.nrows; i++)
		if (ls_match(p.rows[i], f))
			p.rows[kept++] = p.rows[i];
	p.nrows = kept;
	if (p.nrows > 1)
		qsort(p.rows, p.nrows, sizeof(*p.rows), by_id);

	if (json) {
		fputs("{\"buffers\":[", stdout);
		for (i = 0; i < p.nrows; i++) {
			if (i)
				putchar(',');
			json_buffer(p.rows[i]);
		}
		printf("],\"truncated\":false}\n");
		ls_pages_free(&p);
		return 0;
	}

	/* Two passes: the widest cell of each column, then the rows. */
	for (int k = 0; k < NCOLS; k++)
		width[k] = text_width(col_title[k]);
	for (i = 0; i < p.nrows; i++) {
		ls_row_fill(p.rows[i], &row);
		for (int k = 0; k < NCOLS; k++) {
			size_t w = text_width(k == COL_NAME ? row.name : row.cell[k]);

			if (w > width[k])
				width[k] = w;
		}
	}
	ls_print_row(col_title, width);
	for (i = 0; i < p.nrows; i++) {
		ls_row_fill(p.rows[i], &row);
		for (int k = 0; k < NCOLS; k++)
			cells[k] = k == COL_NAME ? row.name : row.cell[k];
		ls_print_row(cells, width);
	}
	ls_pages_free(&p);
	return 0;
}

static int cmd_stat(bb_client *c, bool json, uint64_t id, const char *name)
{
	Bufbroker__Stat op = BUFBROKER__STAT__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__BufferInfo *b;
	char sz[32], age[64];
	int err;

	if (name) {
		op.target_case = BUFBROKER__STAT__TARGET_NAME;
		op.name = (char *)name;
	} else {
		op.target_case = BUFBROKER__STAT__TARGET_ID;
		op.id = id;
	}
	req.op_case = BUFBROKER__REQUEST__OP_STAT;
	req.stat = &op;
	err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_INFO, &r);
	if (err)
		return daemon_error(err);
	b = r->info;

	if (json) {
		json_buffer(b);
		putchar('\n');
	} else {
		fmt_size(b->size, sz, sizeof(sz));
		fmt_duration(b->age_ms, age, sizeof(age));
		printf("id        %" PRIu64 "\n", b->id);
		fputs("name      ", stdout);
		put_text(b->name && *b->name ? b->name : "-");
		printf("\nkind      %s\n", bb_kind_name(b->kind));
		printf("device    %" PRId32 "\n", b->device);
		printf("handle    %s\n", *handle_str(b) ? handle_str(b) : "-");
		printf("size      %s (%" PRIu64 " bytes)\n", sz, b->size);
		printf("state     %s\n", state_str(b->state));
		printf("refs      %" PRIu64 "\n", b->refs);
		printf("tokens    %" PRIu32 "\n", b->tokens);
		printf("owner     uid %" PRIu32 ", gid %" PRIu32 "\n", b->owner_uid, b->owner_gid);
		printf("share     %s\n", share_str(b->share));
		printf("age       %s\n", age);
		fputs("error     ", stdout);
		put_text(b->error && *b->error ? b->error : "-");
		putchar('\n');
	}
	bbc_response_free(r);
	return 0;
}

/* ---- clients ------------------------------------------------------------ */

/* Every page of the daemon's Clients answer, in connection order. */
struct clients_pages {
	Bufbroker__Response **pages; /* responses, freed at the end */
	size_t npages;
	Bufbroker__ClientInfo **rows; /* rows of all pages */
	size_t nrows, cap;
};

static void clients_pages_free(struct clients_pages *p)
{
	for (size_t i = 0; i < p->npages; i++)
		bbc_response_free(p->pages[i]);
	free(p->pages);
	free(p->rows);
	memset(p, 0, sizeof(*p));
}

static int clients_fetch(bb_client *c, struct clients_pages *p)
{
	uint64_t after = 0;
	for (;;) {
		Bufbroker__Clients op = BUFBROKER__CLIENTS__INIT;
		Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
		Bufbroker__Response *r, **pages;
		int err;

		op.after_serial = after;
		req.op_case = BUFBROKER__REQUEST__OP_CLIENTS;
		req.clients = &op;
		err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_CLIENTS, &r);
		if (err)
			return err;
		pages = realloc(p->pages, (p->npages + 1) * sizeof(*pages));
		if (!pages) {
			bbc_response_free(r);
			return bbc_fail(BB_ERR_NO_MEMORY, "out of memory");
		}
		p->pages = pages;
		p->pages[p->npages++] = r;
		Bufbroker__ClientsReply *l = r->clients;
		for (size_t i = 0; i < l->n_clients; i++) {
			if (p->nrows == p->cap) {
				size_t cap = p->cap ? p->cap * 2 : 64;
				Bufbroker__ClientInfo **rows =
					realloc(p->rows, cap * sizeof(*rows));
				if (!rows)
					return bbc_fail(BB_ERR_NO_MEMORY, "out of memory");
				p->rows = rows;
				p->cap = cap;
			}
			p->rows[p->nrows++] = l->clients[i];
			if (l->clients[i]->serial > after)
				after = l->clients[i]->serial;
		}
		if (!l->truncated || l->n_clients == 0)
			return 0;
	}
}

enum {
	CC_CONN,
	CC_UID,
	CC_PID,
	CC_PROCESS,
	CC_CLIENT,
	CC_BUFFERS,
	CC_BYTES,
	CC_TOKENS,
	CC_WAITS,
	CC_AGE,
	NCCOLS
};

static const char *const cc_title[NCCOLS] = {"CONN",    "UID",   "PID",    "PROCESS", "CLIENT",
					     "BUFFERS", "BYTES", "TOKENS", "WAITS",   "AGE"};
static const bool cc_right[NCCOLS] = {true, true, true, false, false, true, true, true, true, true};

/* One clients row as text. */
struct client_cells {
	char cell[NCCOLS][72];
	const char *ptr[NCCOLS]; /* cell[i], for print_table */
};

static void client_cells_fill(const Bufbroker__ClientInfo *ci, struct client_cells *row)
{
	snprintf(row->cell[CC_CONN], 72, "%" PRIu64 "%s", ci->serial, ci->self ? "*" : "");
	snprintf(row->cell[CC_UID], 72, "%" PRIu32, ci->uid);
	snprintf(row->cell[CC_PID], 72, "%" PRIu32, ci->pid);
	snprintf(row->cell[CC_PROCESS], 72, "%s", ci->process && *ci->process ? ci->process : "-");
	snprintf(row->cell[CC_CLIENT], 72, "%s",
		 ci->client_name && *ci->client_name ? ci->client_name : "-");
	snprintf(row->cell[CC_BUFFERS], 72, "%" PRIu64, ci->buffers);
	fmt_size(ci->bytes, row->cell[CC_BYTES], 72);
	snprintf(row->cell[CC_TOKENS], 72, "%" PRIu32, ci->tokens);
	snprintf(row->cell[CC_WAITS], 72, "%" PRIu32, ci->waits);
	fmt_duration(ci->age_ms, row->cell[CC_AGE], 72);
	for (int k = 0; k < NCCOLS; k++)
		row->ptr[k] = row->cell[k];
}

/* Print the clients table of rows[0..n). */
static int clients_table(Bufbroker__ClientInfo *const rows[], size_t n)
{
	struct client_cells *cells = calloc(n ? n : 1, sizeof(*cells));
	const char *const **ptrs = calloc(n ? n : 1, sizeof(*ptrs));

	if (!cells || !ptrs) {
		free(cells);
		free(ptrs);
		fputs("bufbroker: out of memory\n", stderr);
		return EXIT_DAEMON;
	}
	for (size_t i = 0; i < n; i++) {
		client_cells_fill(rows[i], &cells[i]);
		ptrs[i] = cells[i].ptr;
	}
	print_table(NCCOLS, cc_title, cc_right, ptrs, n);
	free(cells);
	free(ptrs);
	return 0;
}

static void json_client(const Bufbroker__ClientInfo *ci)
{
	printf("{\"conn\":%" PRIu64 ",\"uid\":%" PRIu32 ",\"gid\":%" PRIu32 ",\"pid\":%" PRIu32
	       ",\"process\":",
	       ci->serial, ci->uid, ci->gid, ci->pid);
	json_str(ci->process);
	fputs(",\"client\":", stdout);
	json_str(ci->client_name);
	printf(",\"buffers\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"tokens\":%" PRIu32
	       ",\"waits\":%" PRIu32 ",\"age_ms\":%" PRIu64 ",\"self\":%s}",
	       ci->buffers, ci->bytes, ci->tokens, ci->waits, ci->age_ms,
	       ci->self ? "true" : "false");
}

static int cmd_clients(bb_client *c, bool json)
{
	struct clients_pages p = {0};
	int err, rc = 0;

	err = clients_fetch(c, &p);
	if (err) {
		clients_pages_free(&p);
		return daemon_error_v1_1(err, "clients");
	}
	if (json) {
		fputs("{\"clients\":[", stdout);
		for (size_t i = 0; i < p.nrows; i++) {
			if (i)
				putchar(',');
			json_client(p.rows[i]);
		}
		fputs("]}\n", stdout);
	} else {
		rc = clients_table(p.rows, p.nrows);
	}
	clients_pages_free(&p);
	return rc;
}

/* ---- check -------------------------------------------------------------- */

static int cmd_check(bb_client *c, bool json)
{
	Bufbroker__Check op = BUFBROKER__CHECK__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__CheckReply *k;
	char sz[32];
	int err;

	req.op_case = BUFBROKER__REQUEST__OP_CHECK;
	req.check = &op;
	err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_CHECK, &r);
	if (err)
		return daemon_error_v1_1(err, "check");
	k = r->check;
	if (json) {
		printf("{\"ok\":%s,\"problems\":%" PRIu32 ",\"report\":[",
		       k->problems ? "false" : "true", k->problems);
		for (size_t i = 0; i < k->n_report; i++) {
			if (i)
				putchar(',');
			json_str(k->report[i]);
		}
		printf("],\"buffers\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"connections\":%" PRIu32
		       "}\n",
		       k->buffers, k->bytes, k->connections);
	} else if (k->problems == 0) {
		fmt_size(k->bytes, sz, sizeof(sz));
		printf("ok: %" PRIu64 " buffers, %" PRIu64 " bytes (%s), %" PRIu32
		       " connections consistent\n",
		       k->buffers, k->bytes, sz, k->connections);
	} else {
		for (size_t i = 0; i < k->n_report; i++) {
			fputs("problem: ", stdout);
			put_text(k->report[i]);
			putchar('\n');
		}
		if (k->problems > k->n_report)
			printf("(%zu more not shown)\n", (size_t)k->problems - k->n_report);
		printf("check failed: %" PRIu32 " problem%s\n", k->problems,
		       k->problems == 1 ? "" : "s");
	}
	err = k->problems ? EXIT_DAEMON : 0;
	bbc_response_free(r);
	return err;
}

/* ---- upgrade ------------------------------------------------------------- */

/* How long upgrade waits for the new image to answer. */
#define UPGRADE_WAIT_MS 30000
/* An old image still answering this long after it accepted the upgrade
 * did not re-execute: its execve failed (it logs event=upgrade_failed). */
#define UPGRADE_EXEC_MS 2000

static int64_t mono_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* The daemon's ServerStatus over c: 0 and *out (bbc_response_free it), or
 * a BB_ERR_* code. */
static int server_status(bb_client *c, Bufbroker__Response **out)
{
	Bufbroker__ServerStatus op = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;

	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &op;
	return cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_SERVER_STATUS, out);
}

/* Ask for the upgrade, then wait: first for the old image to go (it
 * answers, then re-executes, and this connection, close-on-exec, ends),
 * then for the new one (the same pid) to answer a new connection. c must
 * not reconnect on its own (main turns that off for upgrade). */
static int cmd_upgrade(bb_client *c, const struct cli *cli)
{
	Bufbroker__Upgrade op = BUFBROKER__UPGRADE__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	char binary[4096];
	int err;

	if (cli->binary) {
		if (!realpath(cli->binary, binary)) {
			fprintf(stderr, "bufbroker: %s: %s\n", cli->binary, strerror(errno));
			return EXIT_USAGE;
		}
		op.binary = binary;
	}
	err = server_status(c, &r);
	if (err)
		return daemon_error(err);
	uint32_t pid = r->server_status->pid;
	bbc_response_free(r);

	req.op_case = BUFBROKER__REQUEST__OP_UPGRADE;
	req.upgrade = &op;
	err = bbc_call(c, &req, -1, &r, NULL);
	if (!err) {
		const char *msg = r->status ? r->status->message : "";
		if (!r->status || r->status->code != 0)
			err = bbc_fail(r->status ? r->status->code : BB_ERR_PROTOCOL, "%s",
				       msg && *msg ? msg : "the daemon's answer has no status");
		bbc_response_free(r);
	}
	if (err == BB_ERR_PROTOCOL && strstr(bb_last_error(), "unknown or missing op")) {
		fprintf(stderr,
			"bufbroker: the daemon does not support 'upgrade' (it needs protocol %d.3 "
			"or later)\n",
			BB_PROTO_MAJOR);
		return EXIT_DAEMON;
	}
	if (err)
		return daemon_error(err);
	int64_t said_yes = mono_ms();

	/* The old image re-executes at the end of the turn that answered. */
	while (server_status(c, &r) == 0) {
		bbc_response_free(r);
		if (mono_ms() - said_yes > UPGRADE_EXEC_MS) {
			fprintf(stderr, "bufbroker: the daemon accepted the upgrade but still runs "
					"its old image: its execve failed (see its log, "
					"event=upgrade_failed)\n");
			return EXIT_DAEMON;
		}
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	for (;;) {
		bb_client *n = NULL;
		if (bb_connect(cli->socket, &n) == 0 && server_status(n, &r) == 0) {
			const Bufbroker__ServerStatusReply *s = r->server_status;
			int64_t ms = mono_ms() - said_yes;
			if (s->pid != pid) {
				fprintf(stderr,
					"bufbroker: another daemon (pid %" PRIu32
					") answers now: pid %" PRIu32 " did not upgrade in place\n",
					s->pid, pid);
				err = EXIT_DAEMON;
			} else if (cli->json) {
				printf("{\"upgraded\":true,\"pid\":%" PRIu32 ",\"version\":",
				       s->pid);
				json_str(s->server_version);
				printf(",\"restored_buffers\":%" PRIu64 ",\"restarts\":%" PRIu64
				       ",\"ms\":%" PRId64 "}\n",
				       s->restored_buffers, s->restarts, ms);
			} else {
				printf("upgraded: pid %" PRIu32 ", version ", s->pid);
				put_text(s->server_version);
				printf(", %" PRIu64 " buffers restored, serving after %" PRId64
				       " ms\n",
				       s->restored_buffers, ms);
			}
			bbc_response_free(r);
			bb_disconnect(n);
			return err;
		}
		bb_disconnect(n);
		if (mono_ms() - said_yes > UPGRADE_WAIT_MS) {
			fprintf(stderr, "bufbroker: the daemon did not come back within %d s\n",
				UPGRADE_WAIT_MS / 1000);
			return EXIT_UNREACHABLE;
		}
		struct timespec ts = {0, 20 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
}

/* ---- top ---------------------------------------------------------------- */

static volatile sig_atomic_t g_top_stop; /* a signal asked top to end */
static struct termios g_tty_saved;       /* stdin's settings before top */
static bool g_tty_raw;                   /* stdin is in top's mode: restore it */
static bool g_cursor_hidden;             /* stdout's cursor is hidden: show it */

static void top_on_signal(int sig)
{
	(void)sig;
	g_top_stop = 1;
}

/* Put the terminal back as top found it. Safe to call more than once. */
static void top_restore(void)
{
	if (g_tty_raw) {
		tcsetattr(STDIN_FILENO, TCSANOW, &g_tty_saved);
		g_tty_raw = false;
	}
	if (g_cursor_hidden) {
		fputs("\033[?25h", stdout);
		fflush(stdout);
		g_cursor_hidden = false;
	}
}

/* Keys without Enter and without echo; signals (Ctrl-C) still work. */
static void top_tty_setup(void)
{
	struct termios t;

	if (!isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &g_tty_saved) != 0)
		return;
	t = g_tty_saved;
	t.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
	t.c_cc[VMIN] = 0;
	t.c_cc[VTIME] = 0;
	if (tcsetattr(STDIN_FILENO, TCSANOW, &t) == 0)
		g_tty_raw = true;
}

static int by_bytes_held(const void *a, const void *b)
{
	const Bufbroker__ClientInfo *x = *(Bufbroker__ClientInfo *const *)a;
	const Bufbroker__ClientInfo *y = *(Bufbroker__ClientInfo *const *)b;

	if (x->bytes != y->bytes)
		return x->bytes < y->bytes ? 1 : -1;
	if (x->buffers != y->buffers)
		return x->buffers < y->buffers ? 1 : -1;
	return (x->serial > y->serial) - (x->serial < y->serial);
}

static int by_size(const void *a, const void *b)
{
	const Bufbroker__BufferInfo *x = *(Bufbroker__BufferInfo *const *)a;
	const Bufbroker__BufferInfo *y = *(Bufbroker__BufferInfo *const *)b;

	if (x->size != y->size)
		return x->size < y->size ? 1 : -1;
	return (x->id > y->id) - (x->id < y->id);
}

/* Rows each of top's two tables may show: half of what the terminal has
 * left under the header, or 10 each when stdout is not a terminal. */
static size_t top_table_rows(bool tty, size_t header_lines)
{
	struct winsize ws;

	if (!tty || ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0 || ws.ws_row == 0)
		return 10;
	/* Each table: a title, the column titles; a blank line between. */
	size_t used = header_lines + 5;
	return ws.ws_row > used + 2 ? (ws.ws_row - used) / 2 : 1;
}

/* One frame: the status header, the busiest clients, the largest buffers. */
static int top_frame(bb_client *c, bool tty)
{
	Bufbroker__ServerStatus sop = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r = NULL;
	struct clients_pages cp = {0};
	struct ls_pages lp = {0};
	uint64_t buffers[BB_KIND_COUNT + 1] = {0}, bytes[BB_KIND_COUNT + 1] = {0}; /* by kind */
	char up[64], a[32], b[32], d[32], e[32];
	size_t header = 4, limit, i;
	int err;

	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &sop;
	err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_SERVER_STATUS, &r);
	if (err)
		return daemon_error(err);
	err = clients_fetch(c, &cp);
	if (err) {
		bbc_response_free(r);
		clients_pages_free(&cp);
		return daemon_error_v1_1(err, "top");
	}
	err = ls_fetch(c, &lp);
	if (err) {
		bbc_response_free(r);
		clients_pages_free(&cp);
		ls_pages_free(&lp);
		return daemon_error(err);
	}
	const Bufbroker__ServerStatusReply *s = r->server_status;
	kind_totals(s, buffers, bytes);

	if (tty)
		fputs("\033[H\033[2J", stdout); /* home, clear */
	fmt_duration(s->uptime_ms, up, sizeof(up));
	fputs("bufbroker top - bufbrokerd ", stdout);
	put_text(s->server_version);
	printf(", pid %" PRIu32 ", up %s\n", s->pid, up);
	printf("connections %" PRIu32 ", live tokens %" PRIu64 ", parked waits %" PRIu64 "\n",
	       s->connections, s->tokens, s->waits);
	for (int k = 1; k <= BB_KIND_COUNT; k++) {
		fmt_size(bytes[k], a, sizeof(a));
		printf("%s%s %" PRIu64 " buffers, %s", k > 1 ? "; " : "", bb_kind_name(k),
		       buffers[k], a);
	}
	putchar('\n');
	if (s->cuda && *s->cuda) {
		fputs("cuda unavailable: ", stdout);
		put_text(s->cuda);
		putchar('\n');
	} else {
		for (i = 0; i < s->n_devices; i++) {
			const Bufbroker__DeviceInfo *dv = s->devices[i];

			fmt_size(dv->used_bytes, a, sizeof(a));
			fmt_size(dv->reserved_bytes, b, sizeof(b));
			fmt_size(dv->limit_bytes, d, sizeof(d));
			fmt_size(dv->free_bytes, e, sizeof(e));
			printf("device %" PRId32 " ", dv->ordinal);
			put_text(dv->name);
			printf(": %s in buffers, %s reserved, limit %s, %s free\n", a, b, d, e);
		}
		header += s->n_devices ? s->n_devices - 1 : 0;
		if (!s->n_devices)
			puts("cuda devices: none");
	}
	limit = top_table_rows(tty, header);

	if (cp.nrows > 1)
		qsort(cp.rows, cp.nrows, sizeof(*cp.rows), by_bytes_held);
	printf("\nCLIENTS: %zu, busiest first\n", cp.nrows);
	err = clients_table(cp.rows, cp.nrows < limit ? cp.nrows : limit);

	if (!err) {
		size_t n = lp.nrows < limit ? lp.nrows : limit, width[NCOLS];
		struct ls_row *rows = calloc(n ? n : 1, sizeof(*rows));
		const char *cells[NCOLS];

		if (!rows) {
			fputs("bufbroker: out of memory\n", stderr);
			err = EXIT_DAEMON;
		} else {
			if (lp.nrows > 1)
				qsort(lp.rows, lp.nrows, sizeof(*lp.rows), by_size);
			printf("\nBUFFERS: %zu, largest first\n", lp.nrows);
			for (int k = 0; k < NCOLS; k++)
				width[k] = text_width(col_title[k]);
			for (i = 0; i < n; i++) {
				ls_row_fill(lp.rows[i], &rows[i]);
				for (int k = 0; k < NCOLS; k++) {
					size_t w = text_width(k == COL_NAME ? rows[i].name
									    : rows[i].cell[k]);
					if (w > width[k])
						width[k] = w;
				}
			}
			ls_print_row(col_title, width);
			for (i = 0; i < n; i++) {
				for (int k = 0; k < NCOLS; k++)
					cells[k] = k == COL_NAME ? rows[i].name : rows[i].cell[k];
				ls_print_row(cells, width);
			}
			free(rows);
		}
	}
	bbc_response_free(r);
	clients_pages_free(&cp);
	ls_pages_free(&lp);
	return err;
}

/* Wait up to ms for the next frame; false when top should end (q, a
 * signal). */
static bool top_pause(int ms)
{
	struct pollfd pfd = {.fd = STDIN_FILENO, .events = POLLIN};
	int64_t left = ms;

	while (left > 0 && !g_top_stop) {
		struct timespec t0, t1;
		int n;

		clock_gettime(CLOCK_MONOTONIC, &t0);
		n = poll(g_tty_raw ? &pfd : NULL, g_tty_raw ? 1 : 0, (int)left);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		left -= (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
		if (n > 0) {
			char ch[16];
			ssize_t got = read(STDIN_FILENO, ch, sizeof(ch));

			for (ssize_t i = 0; i < got; i++)
				if (ch[i] == 'q' || ch[i] == 'Q')
					return false;
			if (got == 0)
				pfd.fd = -1; /* end of input: keep the pace, stop polling it */
		}
	}
	return !g_top_stop;
}

static int cmd_top(bb_client *c, unsigned long frames)
{
	struct sigaction sa = {.sa_handler = top_on_signal}, old_int, old_term, old_hup;
	struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
	bool tty = isatty(STDOUT_FILENO);
	unsigned long n = 0;
	int rc = 0;

	/* No SA_RESTART: a signal ends the pause at once. */
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, &old_int);
	sigaction(SIGTERM, &sa, &old_term);
	sigaction(SIGHUP, &sa, &old_hup);
	/* A closed stdout ends top through ferror, with the terminal restored. */
	sigaction(SIGPIPE, &ign, &old_pipe);
	static char outbuf[1 << 16];
	setvbuf(stdout, outbuf, _IOFBF, sizeof(outbuf)); /* draw each frame at once */
	top_tty_setup();
	if (tty) {
		fputs("\033[?25l", stdout);
		g_cursor_hidden = true;
	}

	while (!g_top_stop) {
		rc = top_frame(c, tty);
		if (fflush(stdout) != 0 || ferror(stdout))
			break;
		if (rc || (frames && ++n >= frames) || !top_pause(1000))
			break;
	}
	if (g_top_stop)
		rc = 0; /* Ctrl-C is how top is meant to end */
	top_restore();
	sigaction(SIGINT, &old_int, NULL);
	sigaction(SIGTERM, &old_term, NULL);
	sigaction(SIGHUP, &old_hup, NULL);
	sigaction(SIGPIPE, &old_pipe, NULL);
	return rc;
}

/* ---- main ------------------------------------------------------------- */

static bool all_digits(const char *s)
{
	if (!*s)
		return false;
	for (; *s; s++)
		if (*s < '0' || *s > '9')
			return false;
	return true;
}

/* Parse argv into cli. 0, or an exit status (help and version print here). */
static int parse_args(int argc, char **argv, struct cli *cli)
{
	enum {
		OPT_SOCKET = 256,
		OPT_JSON,
		OPT_VERSION,
		OPT_ID,
		OPT_NAME,
		OPT_UID,
		OPT_STATE,
		OPT_KIND,
		OPT_BINARY
	};
	static const struct option longopts[] = {
		{"socket", required_argument, NULL, OPT_SOCKET},
		{"json", no_argument, NULL, OPT_JSON},
		{"version", no_argument, NULL, OPT_VERSION},
		{"help", no_argument, NULL, 'h'},
		{"id", required_argument, NULL, OPT_ID},
		{"name", required_argument, NULL, OPT_NAME},
		{"uid", required_argument, NULL, OPT_UID},
		{"state", required_argument, NULL, OPT_STATE},
		{"kind", required_argument, NULL, OPT_KIND},
		{"binary", required_argument, NULL, OPT_BINARY},
		{NULL, 0, NULL, 0},
	};
	int opt;

	opterr = 0; /* our own messages, without getopt's argv[0] prefix */
	/* Options may come before or after the command. */
	while ((opt = getopt_long(argc, argv, ":hn:s:", longopts, NULL)) != -1) {
		switch (opt) {
		case 's':
		case OPT_SOCKET: cli->socket = optarg; break;
		case OPT_JSON: cli->json = true; break;
		case OPT_ID: cli->id_arg = optarg; break;
		case OPT_NAME: cli->name_arg = optarg; break;
		case OPT_UID: cli->uid_arg = optarg; break;
		case OPT_STATE: cli->state_arg = optarg; break;
		case OPT_KIND: cli->kind_arg = optarg; break;
		case OPT_BINARY: cli->binary = optarg; break;
		case 'n': cli->count_arg = optarg; break;
		case 'h': cli->help = true; break;
		case OPT_VERSION:
			printf("bufbroker %s (protocol %d.%d)\n", BB_VERSION_STRING, BB_PROTO_MAJOR,
			       BB_PROTO_MINOR);
			return -1;
		case ':': return usage_error("option '%s' needs an argument", argv[optind - 1]);
		default:
			/* optopt is the letter of an unknown short option, 0 for a long one. */
			if (optopt)
				return usage_error("unknown option '-%c'", optopt);
			return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	/* --help: the command's help, whatever else the line says. */
	if (cli->help && optind >= argc) {
		usage(stdout);
		return -1;
	}
	if (optind >= argc)
		return usage_error("no command given");
	cli->command = argv[optind++];
	const struct command *cmd = command_find(cli->command);
	if (!cmd)
		return usage_error("unknown command '%s'", cli->command);
	g_command = cmd;
	if (cli->help) {
		command_help(stdout, cmd);
		return -1;
	}
	if (optind < argc)
		cli->target = argv[optind++];
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (strcmp(cli->command, "help") == 0) {
		if (!cli->target) {
			usage(stdout);
			return -1;
		}
		if (!(cmd = command_find(cli->target)))
			return usage_error("no help for '%s': it is not a command", cli->target);
		command_help(stdout, cmd);
		return -1;
	}

	bool is_stat = strcmp(cli->command, "stat") == 0, is_ls = strcmp(cli->command, "ls") == 0;
	if (!is_stat) {
		if (cli->target)
			return usage_error("unexpected argument '%s'", cli->target);
		if (cli->id_arg || (cli->name_arg && !is_ls))
			return usage_error("--id and --name belong to 'stat'%s",
					   cli->id_arg ? "" : " and 'ls'");
	}
	if (!is_ls && (cli->uid_arg || cli->state_arg || cli->kind_arg))
		return usage_error("--uid, --state and --kind belong to 'ls'");
	if (cli->binary && strcmp(cli->command, "upgrade") != 0)
		return usage_error("--binary belongs to 'upgrade'");
	if (strcmp(cli->command, "top") == 0) {
		if (cli->json)
			return usage_error("'top' has no --json form; use status, clients and ls");
	} else if (cli->count_arg) {
		return usage_error("-n belongs to 'top'");
	}
	return 0;
}

/* ls's filters from the command line. 0 or EXIT_USAGE. */
static int ls_filter_parse(const struct cli *cli, struct ls_filter *f)
{
	f->has_uid = false;
	f->glob = cli->name_arg;
	f->state = -1;
	f->kind = -1;
	if (cli->uid_arg) {
		const struct passwd *pw;

		f->has_uid = true;
		if (all_digits(cli->uid_arg)) {
			errno = 0;
			unsigned long long v = strtoull(cli->uid_arg, NULL, 10);
			if (errno == ERANGE || v > UINT32_MAX)
				return usage_error("uid '%s' is out of range", cli->uid_arg);
			f->uid = (uint32_t)v;
		} else if ((pw = getpwnam(cli->uid_arg)) != NULL) {
			f->uid = (uint32_t)pw->pw_uid;
		} else {
			return usage_error("'%s' is neither a uid nor a user name", cli->uid_arg);
		}
	}
	if (cli->state_arg) {
		static const char *const names[] = {"pending", "ready", "failed"};
		for (int i = 0; i < 3; i++)
			if (strcmp(cli->state_arg, names[i]) == 0)
				f->state = i; /* STATE_PENDING 0, READY 1, FAILED 2 */
		if (f->state < 0)
			return usage_error("--state is pending, ready or failed, not '%s'",
					   cli->state_arg);
	}
	if (cli->kind_arg) {
		f->kind = bb_kind_parse(cli->kind_arg);
		if (!f->kind)
			return usage_error("--kind is host or cuda, not '%s'", cli->kind_arg);
	}
	return 0;
}

/* top -n: frames to draw, 0 for no end. 0 or EXIT_USAGE. */
static int top_frames_parse(const struct cli *cli, unsigned long *frames)
{
	*frames = 0;
	if (!cli->count_arg)
		return 0;
	errno = 0;
	if (!all_digits(cli->count_arg) || (*frames = strtoul(cli->count_arg, NULL, 10)) == 0 ||
	    errno == ERANGE)
		return usage_error("-n takes a number of frames, 1 or more, not '%s'",
				   cli->count_arg);
	return 0;
}

/* The buffer stat names: exactly one of an id and a name. */
static int stat_target(const struct cli *cli, uint64_t *id, const char **name)
{
	const char *id_text = cli->id_arg;
	int given = !!cli->target + !!cli->id_arg + !!cli->name_arg;

	*name = cli->name_arg;
	if (given != 1)
		return usage_error("stat needs exactly one of ID, NAME, --id ID and --name NAME");
	if (cli->target) {
		if (all_digits(cli->target))
			id_text = cli->target;
		else
			*name = cli->target;
	}
	if (id_text) {
		if (!all_digits(id_text))
			return usage_error("'%s' is not a buffer id", id_text);
		errno = 0;
		*id = strtoull(id_text, NULL, 10);
		if (errno == ERANGE)
			return usage_error("buffer id '%s' is out of range", id_text);
	} else if (!**name || strlen(*name) > BB_NAME_MAX) {
		return usage_error("'%s' is not a buffer name (1 to %d bytes)", *name, BB_NAME_MAX);
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct cli cli = {0};
	struct ls_filter filter = {.state = -1, .kind = -1};
	bb_client *c;
	const char *name = NULL;
	uint64_t id = 0;
	unsigned long frames = 0;
	int rc, err;

	rc = parse_args(argc, argv, &cli);
	if (rc)
		return rc < 0 ? 0 : rc;
	if (strcmp(cli.command, "stat") == 0)
		rc = stat_target(&cli, &id, &name);
	else if (strcmp(cli.command, "ls") == 0)
		rc = ls_filter_parse(&cli, &filter);
	else if (strcmp(cli.command, "top") == 0)
		rc = top_frames_parse(&cli, &frames);
	if (rc)
		return rc;

	/* upgrade watches its connection end: it must not come back. */
	if (strcmp(cli.command, "upgrade") == 0)
		setenv("BUFBROKER_RECONNECT", "0", 1);
	err = bb_connect(cli.socket, &c);
	if (err)
		return connect_error(err, cli.socket);
	if (strcmp(cli.command, "status") == 0)
		rc = cmd_status(c, cli.json);
	else if (strcmp(cli.command, "ls") == 0)
		rc = cmd_ls(c, cli.json, &filter);
	else if (strcmp(cli.command, "clients") == 0)
		rc = cmd_clients(c, cli.json);
	else if (strcmp(cli.command, "top") == 0)
		rc = cmd_top(c, frames);
	else if (strcmp(cli.command, "check") == 0)
		rc = cmd_check(c, cli.json);
	else if (strcmp(cli.command, "upgrade") == 0)
		rc = cmd_upgrade(c, &cli);
	else
		rc = cmd_stat(c, cli.json, id, name);
	bb_disconnect(c);

	if (fflush(stdout) != 0 || ferror(stdout)) {
		fprintf(stderr, "bufbroker: cannot write the output: %s\n", strerror(errno));
		return EXIT_DAEMON;
	}
	return rc;
}
