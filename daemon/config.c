/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's settings: one table of keys, the INI file through inih, the
 * flags, and the comparison a SIGHUP makes.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/un.h>
#include <unistd.h>

#include <ini.h>
#include <pwd.h>

#include "wire.h"

/* ---- the keys ---------------------------------------------------------------- */

enum key_type {
	KEY_PATH,  /* a socket path: not empty, fits sockaddr_un */
	KEY_GROUP, /* a group that exists; empty: leave the socket's group alone */
	KEY_MODE,  /* octal permissions */
	KEY_U32,   /* a number (K/M/G/T suffixes allowed), min..max */
	KEY_U64,
	KEY_BOOL,   /* true/false, yes/no, on/off, 1/0 */
	KEY_LEVEL,  /* error, warn, info, debug */
	KEY_LISTEN, /* HOST:PORT; empty: no listener */
	KEY_UIDS,   /* a server_allow of users: numbers or names, comma-separated */
	KEY_GIDS,   /* ... of groups */
	KEY_HANDLE, /* a CUDA handle kind (int): legacy, auto, vmm */
	KEY_FORBID, /* a CUDA handle kind forbidden (int): none, legacy, vmm */
};

typedef struct key {
	const char *section; /* [section] */
	const char *name;    /* name = ... */
	const char *flag;    /* the long option that sets it too, or NULL */
	enum key_type type;
	size_t off;        /* offsetof(config, ...) of the value */
	uint64_t min, max; /* numbers: the range accepted */
	bool invert;       /* KEY_BOOL stored negated ([cuda] enabled is !no_cuda) */
	bool live;         /* a SIGHUP applies it */
} key;

#define OFF(field) offsetof(config, field)
#define LIM(field) offsetof(config, server.limits.field)

static const key keys[] = {
	{"socket", "path", "socket", KEY_PATH, OFF(own_path), 0, 0, false, false},
	{"socket", "mode", "socket-mode", KEY_MODE, OFF(server.socket_mode), 0, 07777, false,
	 false},
	{"socket", "group", "socket-group", KEY_GROUP, OFF(own_group), 0, 0, false, false},
	{"access", "allow_uids", "allow-uids", KEY_UIDS, OFF(server.allow_uids), 0, 0, false, true},
	{"access", "allow_gids", "allow-gids", KEY_GIDS, OFF(server.allow_gids), 0, 0, false, true},
	{"limits", "uid_host_bytes", "uid-host-bytes", KEY_U64, LIM(uid_bytes[BB_HOST]), 0,
	 UINT64_MAX, false, true},
	{"limits", "uid_cuda_bytes", "uid-cuda-bytes", KEY_U64, LIM(uid_bytes[BB_CUDA]), 0,
	 UINT64_MAX, false, true},
	{"limits", "uid_buffers", "uid-buffers", KEY_U64, LIM(uid_buffers), 0, UINT64_MAX, false,
	 true},
	{"limits", "max_connections", "max-connections", KEY_U32, LIM(connections), 1, UINT32_MAX,
	 false, true},
	{"limits", "max_host_buffers", "max-host-buffers", KEY_U64, LIM(host_buffers), 0,
	 UINT64_MAX, false, true},
	{"limits", "conn_tokens", "conn-tokens", KEY_U32, LIM(conn_tokens), 0, UINT32_MAX, false,
	 true},
	{"limits", "conn_waits", "conn-waits", KEY_U32, LIM(conn_waits), 0, UINT32_MAX, false,
	 true},
	{"limits", "uid_tokens", "uid-tokens", KEY_U64, LIM(uid_tokens), 0, UINT64_MAX, false,
	 true},
	{"limits", "queue_bytes", "queue-bytes", KEY_U64, OFF(server.queue_bytes), 4096, UINT64_MAX,
	 false, true},
	{"limits", "send_timeout_ms", "send-timeout", KEY_U64, OFF(server.send_timeout_ms), 1,
	 UINT64_MAX, false, true},
	{"limits", "conn_inflight", "conn-inflight", KEY_U32, OFF(server.conn_inflight), 1,
	 UINT32_MAX, false, true},
	{"limits", "max_datagram", "max-datagram", KEY_U32, OFF(server.max_datagram), 1024,
	 16u << 20, false, false},
	{"limits", "host_pool_memfds", "host-pool-memfds", KEY_U32, OFF(server.host_pool), 0,
	 BACKEND_HOST_POOL_MAX, false, true},
	{"tokens", "ttl_ms", "token-ttl", KEY_U64, LIM(token_ttl_ms), 1, UINT64_MAX, false, true},
	{"cuda", "enabled", "no-cuda", KEY_BOOL, OFF(server.no_cuda), 0, 0, true, false},
	{"cuda", "slab_bytes", "cuda-slab-bytes", KEY_U64, OFF(server.cuda.slab_bytes),
	 BACKEND_CUDA_SLAB_MIN, 1ULL << 40, false, false},
	{"cuda", "cache_bytes", "cuda-cache-bytes", KEY_U64, OFF(server.cuda.cache_bytes), 0,
	 UINT64_MAX, false, false},
	{"cuda", "device_bytes", "cuda-device-bytes", KEY_U64, OFF(server.cuda.device_bytes), 1,
	 UINT64_MAX, false, false},
	{"cuda", "handle", "cuda-handle", KEY_HANDLE, OFF(server.cuda.handle_default), 0, 0, false,
	 true},
	{"cuda", "forbid", "cuda-forbid", KEY_FORBID, OFF(server.cuda.handle_forbid), 0, 0, false,
	 true},
	{"cuda", "max_vmm_allocations", "max-cuda-vmm-allocations", KEY_U64,
	 OFF(server.cuda.vmm_allocations), 0, 1ULL << 20, false, false},
	{"log", "level", "log-level", KEY_LEVEL, OFF(log_level), 0, 0, false, true},
	{"metrics", "listen", "metrics-listen", KEY_LISTEN, OFF(own_metrics), 0, 0, false, false},
	{"restart", "journal", "restart", KEY_BOOL, OFF(server.journal), 0, 0, false, false},
	{"restart", "strict", "restart-strict", KEY_BOOL, OFF(server.restart_strict), 0, 0, false,
	 false},
	{"restart", "grace_ms", "restart-grace", KEY_U64, OFF(server.restart_grace_ms), 0,
	 UINT64_MAX, false, false},
};

#define NKEYS (sizeof(keys) / sizeof(keys[0]))

static const char *const sections[] = {"socket", "access", "limits",  "tokens",
				       "cuda",   "log",    "metrics", "restart"};

static bool known_section(const char *s)
{
	for (size_t i = 0; i < sizeof(sections) / sizeof(sections[0]); i++)
		if (strcmp(s, sections[i]) == 0)
			return true;
	return false;
}

static const key *find_key(const char *section, const char *name)
{
	for (size_t i = 0; i < NKEYS; i++)
		if (strcmp(keys[i].section, section) == 0 && strcmp(keys[i].name, name) == 0)
			return &keys[i];
	return NULL;
}

static void *field(config *c, const key *k)
{
	return (char *)c + k->off;
}

static const void *cfield(const config *c, const key *k)
{
	return (const char *)c + k->off;
}

/* The server_config's borrowed strings point at the owned ones. */
static void link_strings(config *c)
{
	c->server.socket_path = c->own_path;
	c->server.socket_group = c->own_group;
	c->metrics_listen = c->own_metrics;
}

/* ---- problems ---------------------------------------------------------------- */

static void problem(config_problems *probs, int line, const char *keytext, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static void problem(config_problems *probs, int line, const char *keytext, const char *fmt, ...)
{
	if (probs->n == probs->cap) {
		size_t cap = probs->cap ? 2 * probs->cap : 8;
		config_problem *l = realloc(probs->list, cap * sizeof(*l));
		if (!l)
			return; /* the count still says something went wrong */
		probs->list = l;
		probs->cap = cap;
	}
	config_problem *p = &probs->list[probs->n++];
	p->line = line;
	snprintf(p->key, sizeof(p->key), "%s", keytext ? keytext : "");
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(p->why, sizeof(p->why), fmt, ap);
	va_end(ap);
}

const char *config_problem_format(const config_problems *probs, const config_problem *p, char *buf,
				  size_t len)
{
	char where[600] = "";
	if (probs->file && p->line > 0)
		snprintf(where, sizeof(where), "%s:%d: ", probs->file, p->line);
	else if (probs->file && p->key[0] != '-')
		snprintf(where, sizeof(where), "%s: ", probs->file);
	snprintf(buf, len, "%s%s%s%s", where, p->key, p->key[0] ? ": " : "", p->why);
	return buf;
}

void config_problems_log(const config_problems *probs)
{
	for (size_t i = 0; i < probs->n; i++) {
		const config_problem *p = &probs->list[i];
		char file[300], why[300], keyname[64], sec[32], name[32];
		/* "[limits] uid_buffers" is written limits.uid_buffers, as in
		 * config_changed; a flag keeps its "--name". */
		if (sscanf(p->key, "[%31[^]]] %31s", sec, name) == 2)
			snprintf(keyname, sizeof(keyname), "%s.%s", sec, name);
		else
			snprintf(keyname, sizeof(keyname), "%s", p->key[0] ? p->key : "-");
		log_error("event=config_invalid file=\"%s\" line=%d key=%s error=\"%s\"",
			  log_escape(probs->file ? probs->file : "", file, sizeof(file)), p->line,
			  keyname, log_escape(p->why, why, sizeof(why)));
	}
}

void config_problems_free(config_problems *probs)
{
	free(probs->list);
	probs->list = NULL;
	probs->n = probs->cap = 0;
}

/* ---- values ------------------------------------------------------------------- */

/* A non-negative integer with an optional K/M/G/T binary suffix (also
 * Ki/KiB/KB...). 0, -1 not a number, -2 too large for 64 bits. */
static int parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!isdigit((unsigned char)s[0]))
		return -1;
	unsigned long long v = strtoull(s, &end, 10);
	if (end == s)
		return -1;
	if (errno == ERANGE)
		return -2;
	int shift = 0;
	switch (*end) {
	case 'K':
	case 'k':
		shift = 10;
		end++;
		break;
	case 'M':
	case 'm':
		shift = 20;
		end++;
		break;
	case 'G':
	case 'g':
		shift = 30;
		end++;
		break;
	case 'T':
	case 't':
		shift = 40;
		end++;
		break;
	default: break;
	}
	if (*end == 'i' && shift)
		end++;
	if (*end == 'B' && shift)
		end++;
	if (*end)
		return -1;
	if (shift && v > (UINT64_MAX >> shift))
		return -2;
	*out = (uint64_t)v << shift;
	return 0;
}

/* Strip one pair of surrounding double quotes: path = "/run/x.sock". */
static void unquote(const char *v, char *buf, size_t len)
{
	size_t n = strlen(v);
	if (n >= 2 && v[0] == '"' && v[n - 1] == '"')
		snprintf(buf, len, "%.*s", (int)(n - 2), v + 1);
	else
		snprintf(buf, len, "%s", v);
}

/* "IPV4:PORT", "[IPV6]:PORT" or "localhost:PORT": the addresses the metrics
 * endpoint binds (literals only; it looks no name up). */
static bool listen_addr_ok(const char *s)
{
	const char *colon = strrchr(s, ':');
	if (!colon || !isdigit((unsigned char)colon[1]) || strlen(colon + 1) > 5)
		return false;
	for (const char *p = colon + 1; *p; p++)
		if (!isdigit((unsigned char)*p))
			return false;
	if (atoi(colon + 1) > 65535)
		return false;
	char host[INET6_ADDRSTRLEN + 2];
	size_t n = (size_t)(colon - s);
	if (n == 0 || n >= sizeof(host))
		return false;
	memcpy(host, s, n);
	host[n] = '\0';
	unsigned char addr[sizeof(struct in6_addr)];
	if (strcmp(host, "localhost") == 0 || inet_pton(AF_INET, host, addr) == 1)
		return true;
	if (host[0] == '[' && host[n - 1] == ']') {
		host[n - 1] = '\0';
		return inet_pton(AF_INET6, host + 1, addr) == 1;
	}
	return false;
}

static int set_string(char **slot, const char *v, char *why, size_t len)
{
	char *copy = v[0] ? strdup(v) : NULL;
	if (v[0] && !copy) {
		snprintf(why, len, "out of memory");
		return -1;
	}
	free(*slot);
	*slot = copy;
	return 0;
}

/* An allow-list: numbers or names (users for uids, groups for gids),
 * separated by commas or blanks; "" clears it. Names are looked up now
 * (at start and at each reload), so the daemon checks numbers only. 0, or
 * -1 with why; out is unchanged then. */
static int parse_allow(const char *v, bool groups, server_allow *out, char *why, size_t len)
{
	server_allow a = {0};
	char copy[4096], *save = NULL;
	const char *what = groups ? "group" : "user";
	if (strlen(v) >= sizeof(copy)) {
		snprintf(why, len, "is longer than %zu characters", sizeof(copy) - 1);
		return -1;
	}
	unquote(v, copy, sizeof(copy));
	for (char *t = strtok_r(copy, ", \t", &save); t; t = strtok_r(NULL, ", \t", &save)) {
		uint64_t id;
		if (isdigit((unsigned char)t[0])) {
			char *end;
			errno = 0;
			unsigned long long n = strtoull(t, &end, 10);
			if (*end || errno || n >= UINT32_MAX) {
				snprintf(why, len, "\"%.64s\" is not a %s id (0 to %u) or name", t,
					 what, UINT32_MAX - 1);
				return -1;
			}
			id = n;
		} else if (groups) {
			struct group *g = getgrnam(t);
			if (!g) {
				snprintf(why, len, "no group named \"%.64s\"", t);
				return -1;
			}
			id = g->gr_gid;
		} else {
			struct passwd *pw = getpwnam(t);
			if (!pw) {
				snprintf(why, len, "no user named \"%.64s\"", t);
				return -1;
			}
			id = pw->pw_uid;
		}
		if (a.n == SERVER_ALLOW_MAX) {
			snprintf(why, len, "lists more than %d %ss%s", SERVER_ALLOW_MAX, what,
				 groups ? "" : "; allow a group instead ([access] allow_gids)");
			return -1;
		}
		a.ids[a.n++] = (uint32_t)id;
	}
	*out = a;
	return 0;
}

/* Parse v into k's field of c. 0, or -1 with why ("\"lots\" is not a
 * number"); c is unchanged then. */
static int key_set(config *c, const key *k, const char *v, char *why, size_t len)
{
	char s[PATH_MAX];
	uint64_t u;
	switch (k->type) {
	case KEY_PATH: {
		unquote(v, s, sizeof(s));
		size_t max = sizeof(((struct sockaddr_un *)0)->sun_path) - 1;
		if (!s[0]) {
			snprintf(why, len, "is empty; give the socket's path");
			return -1;
		}
		if (strlen(s) > max) {
			snprintf(why, len, "is %zu bytes; a socket path may have at most %zu",
				 strlen(s), max);
			return -1;
		}
		int rc = set_string((char **)field(c, k), s, why, len);
		link_strings(c);
		return rc;
	}
	case KEY_GROUP: {
		unquote(v, s, sizeof(s));
		if (s[0] && !getgrnam(s)) {
			snprintf(why, len, "no group named \"%.100s\"", s);
			return -1;
		}
		int rc = set_string((char **)field(c, k), s, why, len);
		link_strings(c);
		return rc;
	}
	case KEY_LISTEN: {
		unquote(v, s, sizeof(s));
		if (s[0] && !listen_addr_ok(s)) {
			snprintf(
				why, len,
				"\"%.100s\" is not ADDRESS:PORT (an IPv4 address, [IPv6] or localhost, "
				"and a port 0 to 65535; e.g. 127.0.0.1:9464)",
				s);
			return -1;
		}
		int rc = set_string((char **)field(c, k), s, why, len);
		link_strings(c);
		return rc;
	}
	case KEY_MODE: {
		char *end;
		errno = 0;
		long m = v[0] >= '0' && v[0] <= '7' ? strtol(v, &end, 8) : -1;
		if (m < 0 || *end || errno || m > (long)k->max) {
			snprintf(why, len, "\"%s\" is not an octal mode (0000 to 7777)", v);
			return -1;
		}
		*(mode_t *)field(c, k) = (mode_t)m;
		return 0;
	}
	case KEY_U32:
	case KEY_U64: {
		if (!v[0]) {
			snprintf(why, len, "has no value");
			return -1;
		}
		int rc = parse_u64(v, &u);
		if (rc == -1) {
			snprintf(
				why, len,
				"\"%s\" is not a number (digits, optionally followed by K, M, G or "
				"T)",
				v);
			return -1;
		}
		if (rc == -2 || u > k->max) {
			snprintf(why, len, "\"%s\" is too large; the most is %" PRIu64, v, k->max);
			return -1;
		}
		if (u < k->min) {
			snprintf(why, len, "\"%s\" is too small; the least is %" PRIu64, v, k->min);
			return -1;
		}
		if (k->type == KEY_U32)
			*(uint32_t *)field(c, k) = (uint32_t)u;
		else
			*(uint64_t *)field(c, k) = u;
		return 0;
	}
	case KEY_BOOL: {
		static const char *const yes[] = {"true", "yes", "on", "1"};
		static const char *const no[] = {"false", "no", "off", "0"};
		int b = -1;
		for (int i = 0; i < 4; i++) {
			if (strcasecmp(v, yes[i]) == 0)
				b = 1;
			if (strcasecmp(v, no[i]) == 0)
				b = 0;
		}
		if (b < 0) {
			snprintf(why, len, "\"%s\" is not true or false (also yes/no, on/off, 1/0)",
				 v);
			return -1;
		}
		*(bool *)field(c, k) = k->invert ? !b : b;
		return 0;
	}
	case KEY_UIDS:
	case KEY_GIDS:
		return parse_allow(v, k->type == KEY_GIDS, (server_allow *)field(c, k), why, len);
	case KEY_HANDLE:
	case KEY_FORBID: {
		static const struct {
			const char *name;
			int value;
			bool handle, forbid; /* where it may be given */
		} kinds[] = {
			{"none", 0, false, true},
			{"legacy", BB_CUDA_HANDLE_LEGACY, true, true},
			{"auto", BB_CUDA_HANDLE_AUTO, true, false},
			{"vmm", BB_CUDA_HANDLE_VMM, true, true},
		};
		bool forbid = k->type == KEY_FORBID;
		for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
			if (strcasecmp(v, kinds[i].name) == 0 &&
			    (forbid ? kinds[i].forbid : kinds[i].handle)) {
				*(int *)field(c, k) = kinds[i].value;
				return 0;
			}
		}
		snprintf(why, len, "\"%s\" is not %s", v,
			 forbid ? "none, legacy or vmm" : "legacy, auto or vmm");
		return -1;
	}
	case KEY_LEVEL: {
		int l = log_level_parse(v);
		if (l < 0) {
			snprintf(why, len, "\"%s\" is not a level (error, warn, info or debug)", v);
			return -1;
		}
		*(enum log_level *)field(c, k) = (enum log_level)l;
		return 0;
	}
	}
	snprintf(why, len, "internal error: unknown key type");
	return -1;
}

/* k's value in c as the file would write it. */
static const char *key_format(const config *c, const key *k, char *buf, size_t len)
{
	const void *f = cfield(c, k);
	switch (k->type) {
	case KEY_PATH:
	case KEY_GROUP:
	case KEY_LISTEN: {
		const char *s = *(char *const *)f;
		snprintf(buf, len, "%s", s ? s : "");
		break;
	}
	case KEY_MODE: snprintf(buf, len, "%04o", (unsigned)*(const mode_t *)f); break;
	case KEY_U32: snprintf(buf, len, "%" PRIu32, *(const uint32_t *)f); break;
	case KEY_U64: snprintf(buf, len, "%" PRIu64, *(const uint64_t *)f); break;
	case KEY_BOOL: {
		bool b = *(const bool *)f;
		snprintf(buf, len, "%s", (k->invert ? !b : b) ? "true" : "false");
		break;
	}
	case KEY_LEVEL: snprintf(buf, len, "%s", log_level_name(*(const enum log_level *)f)); break;
	case KEY_HANDLE:
	case KEY_FORBID: {
		int h = *(const int *)f;
		snprintf(buf, len, "%s",
			 h == BB_CUDA_HANDLE_LEGACY ? "legacy"
			 : h == BB_CUDA_HANDLE_AUTO ? "auto"
			 : h == BB_CUDA_HANDLE_VMM  ? "vmm"
						    : "none");
		break;
	}
	case KEY_UIDS:
	case KEY_GIDS: {
		const server_allow *a = f;
		size_t used = 0;
		buf[0] = '\0';
		for (uint32_t i = 0; i < a->n && used < len; i++)
			used += (size_t)snprintf(buf + used, len - used, "%s%" PRIu32, i ? "," : "",
						 a->ids[i]);
		break;
	}
	}
	return buf;
}

/* ---- defaults and flags ------------------------------------------------------ */

void config_init(config *c)
{
	memset(c, 0, sizeof(*c));
	c->server.socket_mode = 0660;
	c->server.max_datagram = BB_MAX_DATAGRAM;
	c->server.queue_bytes = 4u << 20;
	c->server.send_timeout_ms = 30000;
	c->server.conn_inflight = 2048;
	c->server.host_pool = BACKEND_HOST_POOL_DEFAULT;
	c->server.restart_grace_ms = 10000;
	broker_limits_default(&c->server.limits);
	c->server.limits.host_buffers = 0; /* what the open-file limit leaves (server.h) */
	backend_cuda_config_default(&c->server.cuda);
	c->log_level = LOG_INFO;
}

void config_free(config *c)
{
	free(c->own_path);
	free(c->own_group);
	free(c->own_metrics);
	c->own_path = c->own_group = c->own_metrics = NULL;
	link_strings(c);
}

int config_finish(config *c, config_problems *probs)
{
	char why[160];
	if (backend_cuda_handles_check(&c->server.cuda, why, sizeof(why)) < 0) {
		problem(probs, 0, NULL, "%s", why);
		return -1;
	}
	if (c->own_path)
		return 0;
	const char *xdg = getenv("XDG_RUNTIME_DIR");
	char path[PATH_MAX];
	if (geteuid() != 0 && xdg && xdg[0])
		snprintf(path, sizeof(path), "%s/%s", xdg, BB_USER_SOCKET_NAME);
	else
		snprintf(path, sizeof(path), "%s", BB_SYSTEM_SOCKET);
	c->own_path = strdup(path);
	link_strings(c);
	if (!c->own_path) {
		problem(probs, 0, NULL, "out of memory");
		return -1;
	}
	return 0;
}

bool config_has_flag(const char *name)
{
	for (size_t i = 0; i < NKEYS; i++)
		if (keys[i].flag && strcmp(keys[i].flag, name) == 0)
			return true;
	return false;
}

int config_apply_flag(config *c, const config_flag *f, config_problems *probs)
{
	char keytext[64], why[256];
	snprintf(keytext, sizeof(keytext), "--%s", f->name);
	for (size_t i = 0; i < NKEYS; i++) {
		if (!keys[i].flag || strcmp(keys[i].flag, f->name) != 0)
			continue;
		if (key_set(c, &keys[i], f->value, why, sizeof(why)) < 0) {
			problem(probs, 0, keytext, "%s", why);
			return -1;
		}
		return 0;
	}
	problem(probs, 0, keytext, "sets no configuration key");
	return -1;
}

/* ---- the file ------------------------------------------------------------------ */

/* inih calls the handler without a line number, so the reader counts lines
 * and classifies each: a line that should be "key = value" and reaches the
 * handler is fine; one that does not is a syntax error (inih only returns
 * the first). Section headers are checked here, so that the keys of an
 * unknown section make one problem, not one each. */
typedef struct parse {
	config *c;
	config_problems *probs;
	FILE *f;
	int line;         /* lines read so far: the line being parsed */
	bool expect_key;  /* the current line should reach the handler */
	bool bad_section; /* inside an unknown or broken [section] */
	int seen[NKEYS];  /* the line each key was set on, or 0 */
} parse;

static char *read_line(char *str, int num, void *stream)
{
	parse *p = stream;
	if (p->expect_key) {
		p->expect_key = false;
		problem(p->probs, p->line, NULL,
			"expected \"key = value\", a [section] or a comment");
	}
	if (!fgets(str, num, p->f))
		return NULL;
	p->line++;
	size_t n = strlen(str);
	if (n && str[n - 1] != '\n' && !feof(p->f)) {
		int ch;
		while ((ch = fgetc(p->f)) != EOF && ch != '\n')
			;
		problem(p->probs, p->line, NULL, "the line is longer than %d characters", num - 3);
		str[0] = '\0';
		return str;
	}
	const char *s = str;
	if (p->line == 1 && strncmp(s, "\xEF\xBB\xBF", 3) == 0)
		s += 3;
	while (isspace((unsigned char)*s))
		s++;
	if (!*s || *s == ';' || *s == '#')
		return str;
	if (*s == '[') {
		const char *close = strchr(s, ']');
		p->bad_section = true;
		if (!close) {
			problem(p->probs, p->line, NULL, "a [section] header needs its closing ]");
			str[0] = '\0'; /* reported; inih need not see it */
			return str;
		}
		char name[64];
		snprintf(name, sizeof(name), "%.*s", (int)(close - s - 1), s + 1);
		if (!known_section(name))
			problem(p->probs, p->line, NULL,
				"unknown section [%s] (the sections are [socket], [access], "
				"[limits], [tokens], [cuda], [log] and [metrics])",
				name);
		else
			p->bad_section = false;
		return str;
	}
	p->expect_key = true;
	return str;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
	parse *p = user;
	char keytext[64], why[256];
	p->expect_key = false;
	if (p->bad_section)
		return 1;
	snprintf(keytext, sizeof(keytext), "[%s] %s", section, name);
	if (!section[0]) {
		problem(p->probs, p->line, name, "is outside any [section]");
		return 1;
	}
	const key *k = find_key(section, name);
	if (!k) {
		char list[200] = "";
		size_t used = 0;
		for (size_t i = 0; i < NKEYS; i++)
			if (strcmp(keys[i].section, section) == 0 && used < sizeof(list))
				used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s",
							 used ? ", " : "", keys[i].name);
		problem(p->probs, p->line, keytext, "unknown key (the keys of [%s] are: %s)",
			section, list);
		return 1;
	}
	size_t i = (size_t)(k - keys);
	if (p->seen[i]) {
		problem(p->probs, p->line, keytext, "is set twice (first on line %d)", p->seen[i]);
		return 1;
	}
	p->seen[i] = p->line;
	if (key_set(p->c, k, value, why, sizeof(why)) < 0)
		problem(p->probs, p->line, keytext, "%s", why);
	return 1;
}

size_t config_read_file(config *c, const char *path, bool required, config_problems *probs)
{
	size_t before = probs->n;
	probs->file = path;
	parse p = {.c = c, .probs = probs};
	p.f = fopen(path, "re");
	if (!p.f) {
		if (errno == ENOENT && !required)
			return 0;
		problem(probs, 0, NULL, "cannot read it: %s", strerror(errno));
		return probs->n - before;
	}
	int rc = ini_parse_stream(read_line, &p, on_key, &p);
	if (ferror(p.f))
		problem(probs, 0, NULL, "read error: %s", strerror(errno));
	fclose(p.f);
	/* A syntax error the reader did not foresee (there should be none). */
	if (rc != 0 && probs->n == before)
		problem(probs, rc > 0 ? rc : 0, NULL, "syntax error");
	return probs->n - before;
}

void config_log_warnings(const config *c)
{
	const server_config *s = &c->server;
	if (s->conn_inflight <= s->limits.conn_waits)
		log_warn("event=config_warning key=limits.conn_inflight value=%" PRIu32
			 " error=\"not above limits.conn_waits (%" PRIu32
			 "): a connection whose parked Waits reach it is not read until one is "
			 "answered, so it cannot send the SetReady that would answer them\"",
			 s->conn_inflight, s->limits.conn_waits);
}

/* ---- reload ---------------------------------------------------------------------- */

/* v, double-quoted when a key=value reader needs it to be. */
static const char *log_value(const char *v, char *buf, size_t len)
{
	char esc[300];
	if (v[0] && !strpbrk(v, " \t\"\\="))
		return v;
	snprintf(buf, len, "\"%s\"", log_escape(v, esc, sizeof(esc)));
	return buf;
}

size_t config_apply_live(config *running, const config *fresh)
{
	char restart[512] = "";
	size_t applied = 0, used = 0;
	for (size_t i = 0; i < NKEYS; i++) {
		const key *k = &keys[i];
		char was[PATH_MAX], now[PATH_MAX];
		key_format(running, k, was, sizeof(was));
		key_format(fresh, k, now, sizeof(now));
		if (strcmp(was, now) == 0)
			continue;
		if (!k->live) {
			if (used < sizeof(restart))
				used += (size_t)snprintf(restart + used, sizeof(restart) - used,
							 "%s%s.%s", used ? "," : "", k->section,
							 k->name);
			continue;
		}
		/* Live keys are all plain values: numbers, a level, a list. */
		size_t size = k->type == KEY_U32     ? sizeof(uint32_t)
			      : k->type == KEY_LEVEL ? sizeof(enum log_level)
			      : k->type == KEY_HANDLE || k->type == KEY_FORBID ? sizeof(int)
			      : k->type == KEY_UIDS || k->type == KEY_GIDS ? sizeof(server_allow)
									   : sizeof(uint64_t);
		memcpy(field(running, k), cfield(fresh, k), size);
		char a[PATH_MAX + 8], b[PATH_MAX + 8];
		log_info("event=config_changed key=%s.%s old=%s new=%s", k->section, k->name,
			 log_value(was, a, sizeof(a)), log_value(now, b, sizeof(b)));
		applied++;
	}
	if (restart[0])
		log_warn("event=config_restart_needed keys=%s", restart);
	return applied;
}
