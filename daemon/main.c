/*
 * bufbrokerd: parse the command line, start the server on a libuv loop,
 * run until SIGTERM/SIGINT, then free everything and exit 0.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "server.h"
#include "wire.h"

static void usage(FILE *out)
{
	fprintf(out,
		"Usage: bufbrokerd [OPTION]...\n"
		"Own host and device buffers and their reference counts across processes.\n"
		"\n"
		"  --socket PATH          listen here (default %s as root,\n"
		"                         $XDG_RUNTIME_DIR/%s otherwise);\n"
		"                         ignored when systemd passes a socket (LISTEN_FDS)\n"
		"  --socket-mode OCTAL    permissions of the socket file (default 0660)\n"
		"  --socket-group NAME    group of the socket file (default: unchanged)\n"
		"  --token-ttl MS         an unadopted token releases after this (default 60000)\n"
		"  --max-connections N    open connections in all (default 1024)\n"
		"  --uid-host-bytes BYTES host bytes one uid may hold (default half of RAM)\n"
		"  --uid-buffers N        live buffers one uid may own (default 65536)\n"
		"  --conn-tokens N        live tokens one connection may make (default 4096)\n"
		"  --conn-waits N         parked waits per connection (default 1024)\n"
		"  --queue-bytes BYTES    queued output per connection before it is dropped\n"
		"                         (default 4194304)\n"
		"  --max-datagram BYTES   largest request accepted (default %d)\n"
		"  --cuda-slab-bytes BYTES\n"
		"                         CUDA buffers are carved out of allocations (slabs)\n"
		"                         of this size, rounded up to 2 MiB (default 64M, at\n"
		"                         least 1M); a larger buffer gets its own allocation\n"
		"  --cuda-cache-bytes BYTES\n"
		"                         empty slabs kept per device for reuse (default 256M)\n"
		"  --cuda-device-bytes BYTES\n"
		"                         device memory the daemon may hold per device\n"
		"                         (default 90%% of each device's memory)\n"
		"  --no-cuda              serve host buffers only: do not load the CUDA driver\n"
		"                         ($BUFBROKER_CUDA_LIBRARY, default libcuda.so.1)\n"
		"  --log-level LEVEL      error, warn, info (default) or debug\n"
		"  --version              print the version and exit\n"
		"  --help                 print this help and exit\n",
		BB_SYSTEM_SOCKET, BB_USER_SOCKET_NAME, BB_MAX_DATAGRAM);
}

/* A non-negative integer with an optional K/M/G/T binary suffix. */
static int parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!s[0] || s[0] == '-')
		return -1;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -1;
	int shift = 0;
	switch (*end) {
	case 'K': case 'k': shift = 10; end++; break;
	case 'M': case 'm': shift = 20; end++; break;
	case 'G': case 'g': shift = 30; end++; break;
	case 'T': case 't': shift = 40; end++; break;
	default: break;
	}
	if (*end == 'i' && shift)
		end++;
	if (*end == 'B' && shift)
		end++;
	if (*end || (shift && v > (UINT64_MAX >> shift)))
		return -1;
	*out = (uint64_t)v << shift;
	return 0;
}

static int parse_u32(const char *s, uint32_t *out)
{
	uint64_t v;
	if (parse_u64(s, &v) < 0 || v > UINT32_MAX)
		return -1;
	*out = (uint32_t)v;
	return 0;
}

enum {
	OPT_SOCKET = 256, OPT_SOCKET_MODE, OPT_SOCKET_GROUP, OPT_TOKEN_TTL, OPT_MAX_CONNECTIONS,
	OPT_UID_HOST_BYTES, OPT_UID_BUFFERS, OPT_CONN_TOKENS, OPT_CONN_WAITS, OPT_QUEUE_BYTES,
	OPT_MAX_DATAGRAM, OPT_LOG_LEVEL, OPT_VERSION, OPT_HELP, OPT_CUDA_SLAB_BYTES,
	OPT_CUDA_CACHE_BYTES, OPT_CUDA_DEVICE_BYTES, OPT_NO_CUDA,
};

static const struct option options[] = {
	{"socket", required_argument, NULL, OPT_SOCKET},
	{"socket-mode", required_argument, NULL, OPT_SOCKET_MODE},
	{"socket-group", required_argument, NULL, OPT_SOCKET_GROUP},
	{"token-ttl", required_argument, NULL, OPT_TOKEN_TTL},
	{"max-connections", required_argument, NULL, OPT_MAX_CONNECTIONS},
	{"uid-host-bytes", required_argument, NULL, OPT_UID_HOST_BYTES},
	{"uid-buffers", required_argument, NULL, OPT_UID_BUFFERS},
	{"conn-tokens", required_argument, NULL, OPT_CONN_TOKENS},
	{"conn-waits", required_argument, NULL, OPT_CONN_WAITS},
	{"queue-bytes", required_argument, NULL, OPT_QUEUE_BYTES},
	{"max-datagram", required_argument, NULL, OPT_MAX_DATAGRAM},
	{"log-level", required_argument, NULL, OPT_LOG_LEVEL},
	{"cuda-slab-bytes", required_argument, NULL, OPT_CUDA_SLAB_BYTES},
	{"cuda-cache-bytes", required_argument, NULL, OPT_CUDA_CACHE_BYTES},
	{"cuda-device-bytes", required_argument, NULL, OPT_CUDA_DEVICE_BYTES},
	{"no-cuda", no_argument, NULL, OPT_NO_CUDA},
	{"version", no_argument, NULL, OPT_VERSION},
	{"help", no_argument, NULL, OPT_HELP},
	{NULL, 0, NULL, 0},
};

static int bad_value(const char *opt, const char *val)
{
	fprintf(stderr, "bufbrokerd: invalid value \"%s\" for --%s\n", val, opt);
	return 2;
}

int main(int argc, char **argv)
{
	server_config cfg = {
		.socket_mode = 0660,
		.max_datagram = BB_MAX_DATAGRAM,
		.queue_bytes = 4u << 20,
	};
	char default_path[256];
	int opt;
	broker_limits_default(&cfg.limits);
	backend_cuda_config_default(&cfg.cuda);

	while ((opt = getopt_long(argc, argv, "", options, NULL)) != -1) {
		const char *v = optarg;
		uint64_t u64;
		switch (opt) {
		case OPT_SOCKET:
			cfg.socket_path = v;
			break;
		case OPT_SOCKET_MODE: {
			char *end;
			long m = strtol(v, &end, 8);
			if (*end || m < 0 || m > 07777)
				return bad_value("socket-mode", v);
			cfg.socket_mode = (mode_t)m;
			break;
		}
		case OPT_SOCKET_GROUP:
			cfg.socket_group = v;
			break;
		case OPT_TOKEN_TTL:
			if (parse_u64(v, &cfg.limits.token_ttl_ms) < 0 || cfg.limits.token_ttl_ms == 0)
				return bad_value("token-ttl", v);
			break;
		case OPT_MAX_CONNECTIONS:
			if (parse_u32(v, &cfg.limits.connections) < 0 || !cfg.limits.connections)
				return bad_value("max-connections", v);
			break;
		case OPT_UID_HOST_BYTES:
			if (parse_u64(v, &cfg.limits.uid_bytes[BB_HOST]) < 0)
				return bad_value("uid-host-bytes", v);
			break;
		case OPT_UID_BUFFERS:
			if (parse_u64(v, &cfg.limits.uid_buffers) < 0)
				return bad_value("uid-buffers", v);
			break;
		case OPT_CONN_TOKENS:
			if (parse_u32(v, &cfg.limits.conn_tokens) < 0)
				return bad_value("conn-tokens", v);
			break;
		case OPT_CONN_WAITS:
			if (parse_u32(v, &cfg.limits.conn_waits) < 0)
				return bad_value("conn-waits", v);
			break;
		case OPT_QUEUE_BYTES:
			if (parse_u64(v, &cfg.queue_bytes) < 0 || cfg.queue_bytes < 4096)
				return bad_value("queue-bytes", v);
			break;
		case OPT_MAX_DATAGRAM:
			if (parse_u64(v, &u64) < 0 || u64 < 1024 || u64 > (16u << 20))
				return bad_value("max-datagram", v);
			cfg.max_datagram = (uint32_t)u64;
			break;
		case OPT_CUDA_SLAB_BYTES:
			if (parse_u64(v, &cfg.cuda.slab_bytes) < 0 ||
			    cfg.cuda.slab_bytes < BACKEND_CUDA_SLAB_MIN ||
			    cfg.cuda.slab_bytes > (1ULL << 40))
				return bad_value("cuda-slab-bytes", v);
			break;
		case OPT_CUDA_CACHE_BYTES:
			if (parse_u64(v, &cfg.cuda.cache_bytes) < 0)
				return bad_value("cuda-cache-bytes", v);
			break;
		case OPT_CUDA_DEVICE_BYTES:
			if (parse_u64(v, &cfg.cuda.device_bytes) < 0 || cfg.cuda.device_bytes == 0)
				return bad_value("cuda-device-bytes", v);
			break;
		case OPT_NO_CUDA:
			cfg.no_cuda = true;
			break;
		case OPT_LOG_LEVEL: {
			int l = log_level_parse(v);
			if (l < 0)
				return bad_value("log-level", v);
			log_set_level((enum log_level)l);
			break;
		}
		case OPT_VERSION:
			printf("bufbrokerd %s (protocol %d.%d)\n", BB_VERSION_STRING, BB_PROTO_MAJOR,
			       BB_PROTO_MINOR);
			return 0;
		case OPT_HELP:
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "bufbrokerd: unexpected argument \"%s\"\n", argv[optind]);
		usage(stderr);
		return 2;
	}
	if (!cfg.socket_path) {
		const char *xdg = getenv("XDG_RUNTIME_DIR");
		if (geteuid() != 0 && xdg && xdg[0]) {
			snprintf(default_path, sizeof(default_path), "%s/%s", xdg, BB_USER_SOCKET_NAME);
			cfg.socket_path = default_path;
		} else {
			cfg.socket_path = BB_SYSTEM_SOCKET;
		}
	}

	/* Sends use MSG_NOSIGNAL; this also covers anything that doesn't. */
	signal(SIGPIPE, SIG_IGN);

	uv_loop_t loop;
	server s;
	int rc = 0;
	if (uv_loop_init(&loop) < 0) {
		fprintf(stderr, "bufbrokerd: cannot create the event loop\n");
		return 1;
	}
	if (server_start(&s, &loop, &cfg) < 0)
		rc = 1;
	else
		uv_run(&loop, UV_RUN_DEFAULT);
	server_shutdown(&s);
	uv_loop_close(&loop);
	if (rc == 0)
		log_info("event=stopped");
	return rc;
}
