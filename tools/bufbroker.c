/*
 * bufbroker: the operator's view of a running bufbrokerd.
 *
 *   bufbroker [--socket PATH] [--json] status
 *   bufbroker [--socket PATH] [--json] ls
 *   bufbroker [--socket PATH] [--json] stat ID | NAME | --id ID | --name NAME
 *
 * The public API has no List, ServerStatus or Stat by name, so this tool
 * speaks the wire protocol through the library's raw request path
 * (bbc_call). Human output is for people and may change; the --json output
 * (one object per command, on one line) is the interface for scripts.
 *
 * Exit status: 0 success, 1 the daemon (or the connection to it) failed,
 * 2 the command line is wrong.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bufbroker/bufbroker.h"
#include "client_internal.h"
#include "cuda_api.h"
#include "wire.h"

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2 };

/* The command line, once parsed. */
struct cli {
	const char *socket;   /* --socket; NULL: the library's default */
	bool json;            /* --json */
	const char *command;  /* status, ls, stat, help */
	const char *target;   /* stat's positional argument, or NULL */
	const char *id_arg;   /* stat --id */
	const char *name_arg; /* stat --name */
};

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: bufbroker [--socket PATH] [--json] COMMAND\n"
		"\n"
		"Commands:\n"
		"  status            the daemon's version, uptime, connections, totals and\n"
		"                    CUDA devices\n"
		"  ls                every buffer this user may see\n"
		"  stat ID|NAME      one buffer; digits only means an id\n"
		"  stat --id ID      one buffer by id\n"
		"  stat --name NAME  one buffer by name\n"
		"  help              this text\n"
		"\n"
		"Options:\n"
		"  --socket PATH     the daemon's socket; default $BUFBROKER_SOCKET, else\n"
		"                    $XDG_RUNTIME_DIR/%s, else\n"
		"                    %s\n"
		"  --json            one JSON object on stdout instead of text\n"
		"  --version         print the version and exit\n"
		"  -h, --help        print this text and exit\n"
		"\n"
		"Exit status: 0 ok, 1 daemon error, 2 usage error.\n",
		BB_USER_SOCKET_NAME, BB_SYSTEM_SOCKET);
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Say what is wrong with the command line; returns EXIT_USAGE. */
static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fputs("bufbroker: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'bufbroker --help'.\n", stderr);
	return EXIT_USAGE;
}

static int daemon_error(int err)
{
	const char *msg = bb_last_error();

	fprintf(stderr, "bufbroker: %s\n", msg && *msg ? msg : bb_strerror(err));
	return EXIT_DAEMON;
}

/* ---- formatting ------------------------------------------------------- */

/* "512 B", "4.0 KiB", "64.0 MiB", "1.5 GiB". */
static void fmt_size(uint64_t n, char *out, size_t cap)
{
	static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
	const int last = (int)(sizeof(units) / sizeof(units[0])) - 1;
	double v = (double)n;
	int u = 0;

	if (n < 1024) {
		snprintf(out, cap, "%" PRIu64 " B", n);
		return;
	}
	while (v >= 1024.0 && u < last) {
		v /= 1024.0;
		u++;
	}
	/* 1023.97 KiB would round to "1024.0 KiB"; say "1.0 MiB" instead. */
	if (v >= 1023.95 && u < last) {
		v /= 1024.0;
		u++;
	}
	snprintf(out, cap, "%.1f %s", v, units[u]);
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

static const char *kind_str(Bufbroker__Kind k)
{
	switch (k) {
	case BUFBROKER__KIND__KIND_HOST: return "host";
	case BUFBROKER__KIND__KIND_CUDA: return "cuda";
	default: return "unknown";
	}
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

static void json_buffer(const Bufbroker__BufferInfo *b)
{
	printf("{\"id\":%" PRIu64 ",\"name\":", b->id);
	json_str(b->name);
	printf(",\"kind\":\"%s\",\"device\":%" PRId32 ",\"size\":%" PRIu64
	       ",\"state\":\"%s\",\"refs\":%" PRIu64 ",\"tokens\":%" PRIu32
	       ",\"owner_uid\":%" PRIu32 ",\"owner_gid\":%" PRIu32
	       ",\"share\":\"%s\",\"age_ms\":%" PRIu64 ",\"error\":",
	       kind_str(b->kind), b->device, b->size, state_str(b->state), b->refs, b->tokens,
	       b->owner_uid, b->owner_gid, share_str(b->share), b->age_ms);
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
		       ",\"limit_bytes\":%" PRIu64 "}",
		       d->total_bytes, d->free_bytes, d->used_bytes, d->reserved_bytes,
		       d->limit_bytes);
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
	}
}

static int cmd_status(bb_client *c, bool json)
{
	Bufbroker__ServerStatus op = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Response *r;
	const Bufbroker__ServerStatusReply *s;
	uint64_t buffers[2] = {0, 0}, bytes[2] = {0, 0}; /* [0] host, [1] cuda */
	char up[64], sz[32];
	size_t i;
	int err;

	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &op;
	err = cli_call(c, &req, BUFBROKER__RESPONSE__RESULT_SERVER_STATUS, &r);
	if (err)
		return daemon_error(err);
	s = r->server_status;

	for (i = 0; i < s->n_kinds; i++) {
		const Bufbroker__KindTotals *k = s->kinds[i];
		int slot = k->kind == BUFBROKER__KIND__KIND_HOST   ? 0
			   : k->kind == BUFBROKER__KIND__KIND_CUDA ? 1
								   : -1;

		if (slot >= 0) {
			buffers[slot] += k->buffers;
			bytes[slot] += k->bytes;
		}
	}

	if (json) {
		fputs("{\"version\":", stdout);
		json_str(s->server_version);
		printf(",\"protocol\":\"%" PRIu32 ".%" PRIu32 "\",\"pid\":%" PRIu32
		       ",\"uptime_ms\":%" PRIu64 ",\"connections\":%" PRIu32 ",\"tokens\":%" PRIu64
		       ",\"waits\":%" PRIu64 ",\"kinds\":{",
		       s->version_major, s->version_minor, s->pid, s->uptime_ms, s->connections,
		       s->tokens, s->waits);
		for (i = 0; i < 2; i++)
			printf("%s\"%s\":{\"buffers\":%" PRIu64 ",\"bytes\":%" PRIu64 "}",
			       i ? "," : "", i ? "cuda" : "host", buffers[i], bytes[i]);
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
		for (i = 0; i < 2; i++) {
			fmt_size(bytes[i], sz, sizeof(sz));
			printf("%s buffers    %" PRIu64 " (%s, %" PRIu64 " bytes)\n",
			       i ? "cuda" : "host", buffers[i], sz, bytes[i]);
		}
		printf("live tokens     %" PRIu64 "\n", s->tokens);
		printf("parked waits    %" PRIu64 "\n", s->waits);
		text_devices(s);
	}
	bbc_response_free(r);
	return 0;
}

enum { COL_ID, COL_NAME, COL_KIND, COL_DEV, COL_SIZE, COL_STATE, COL_REFS, COL_OWNER, NCOLS };

static const char *const col_title[NCOLS] = {"ID",   "NAME",  "KIND", "DEV",
					     "SIZE", "STATE", "REFS", "OWNER"};
static const bool col_right[NCOLS] = {true, false, false, true, true, false, true, true};

/* One ls row as text; the name is the only cell that can be long. */
struct ls_row {
	char cell[NCOLS][32];
	const char *name;
};

static void ls_row_fill(const Bufbroker__BufferInfo *b, struct ls_row *row)
{
	snprintf(row->cell[COL_ID], 32, "%" PRIu64, b->id);
	row->name = b->name && *b->name ? b->name : "-";
	snprintf(row->cell[COL_KIND], 32, "%s", kind_str(b->kind));
	if (b->kind == BUFBROKER__KIND__KIND_CUDA)
		snprintf(row->cell[COL_DEV], 32, "%" PRId32, b->device);
	else
		snprintf(row->cell[COL_DEV], 32, "-");
	fmt_size(b->size, row->cell[COL_SIZE], 32);
	snprintf(row->cell[COL_STATE], 32, "%s", state_str(b->state));
	snprintf(row->cell[COL_REFS], 32, "%" PRIu64, b->refs);
	snprintf(row->cell[COL_OWNER], 32, "%" PRIu32, b->owner_uid);
}

static void ls_print_row(const char *const cells[NCOLS], const size_t width[NCOLS])
{
	for (int i = 0; i < NCOLS; i++) {
		size_t pad = width[i] - text_width(cells[i]);

		if (col_right[i])
			printf("%*s", (int)pad, "");
		put_text(cells[i]);
		if (i == NCOLS - 1)
			break;
		printf("%*s", (int)(col_right[i] ? 2 : pad + 2), "");
	}
	putchar('\n');
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
				Bufbroker__BufferInfo **rows = realloc(p->rows, cap * sizeof(*rows));
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

static int cmd_ls(bb_client *c, bool json)
{
	struct ls_pages p = {0};
	size_t width[NCOLS], i;
	const char *cells[NCOLS];
	struct ls_row row;
	int err;

	err = ls_fetch(c, &p);
	if (err) {
		ls_pages_free(&p);
		return daemon_error(err);
	}
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
		printf("\nkind      %s\n", kind_str(b->kind));
		printf("device    %" PRId32 "\n", b->device);
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
	enum { OPT_SOCKET = 256, OPT_JSON, OPT_VERSION, OPT_ID, OPT_NAME };
	static const struct option longopts[] = {
		{"socket", required_argument, NULL, OPT_SOCKET},
		{"json", no_argument, NULL, OPT_JSON},
		{"version", no_argument, NULL, OPT_VERSION},
		{"help", no_argument, NULL, 'h'},
		{"id", required_argument, NULL, OPT_ID},
		{"name", required_argument, NULL, OPT_NAME},
		{NULL, 0, NULL, 0},
	};
	int opt;

	opterr = 0; /* our own messages, without getopt's argv[0] prefix */
	/* Options may come before or after the command. */
	while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
		switch (opt) {
		case OPT_SOCKET: cli->socket = optarg; break;
		case OPT_JSON: cli->json = true; break;
		case OPT_ID: cli->id_arg = optarg; break;
		case OPT_NAME: cli->name_arg = optarg; break;
		case 'h': usage(stdout); return -1;
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
	if (optind >= argc)
		return usage_error("no command given");
	cli->command = argv[optind++];
	if (optind < argc)
		cli->target = argv[optind++];
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);

	if (strcmp(cli->command, "stat") != 0) {
		if (cli->target)
			return usage_error("unexpected argument '%s'", cli->target);
		if (cli->id_arg || cli->name_arg)
			return usage_error("--id and --name belong to 'stat'");
	}
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
	bb_client *c;
	const char *name = NULL;
	uint64_t id = 0;
	int rc, err;

	rc = parse_args(argc, argv, &cli);
	if (rc)
		return rc < 0 ? 0 : rc;
	if (strcmp(cli.command, "help") == 0) {
		usage(stdout);
		return 0;
	}
	if (strcmp(cli.command, "stat") == 0) {
		rc = stat_target(&cli, &id, &name);
		if (rc)
			return rc;
	} else if (strcmp(cli.command, "status") != 0 && strcmp(cli.command, "ls") != 0) {
		return usage_error("unknown command '%s'", cli.command);
	}

	err = bb_connect(cli.socket, &c);
	if (err)
		return daemon_error(err);
	if (strcmp(cli.command, "status") == 0)
		rc = cmd_status(c, cli.json);
	else if (strcmp(cli.command, "ls") == 0)
		rc = cmd_ls(c, cli.json);
	else
		rc = cmd_stat(c, cli.json, id, name);
	bb_disconnect(c);

	if (fflush(stdout) != 0 || ferror(stdout)) {
		fprintf(stderr, "bufbroker: cannot write the output: %s\n", strerror(errno));
		return EXIT_DAEMON;
	}
	return rc;
}
