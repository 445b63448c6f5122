/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bufbrokerd: read the configuration (defaults, then the file, then the
 * flags), start the server on a libuv loop, reload the file on SIGHUP, run
 * until SIGTERM/SIGINT, then free everything and exit 0.
 */
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "server.h"
#include "upgrade.h"
#include "wire.h"

static void usage(FILE *out)
{
	fprintf(out,
		"Usage: bufbrokerd [OPTION]...\n"
		"       bufbrokerd --check-config FILE\n"
		"       bufbrokerd --check-journal-version\n"
		"Own host and device buffers and their reference counts across processes.\n"
		"\n"
		"  --config FILE          read settings from FILE (default\n"
		"                         $BUFBROKERD_CONFIG, else %s,\n"
		"                         when it exists); flags override it; SIGHUP\n"
		"                         re-reads it\n"
		"  --check-config FILE    report every problem in FILE and exit 1, or print\n"
		"                         \"FILE: ok\" and exit 0\n"
		"  --check-journal-version\n"
		"                         print the state journal layouts this binary\n"
		"                         reads and exit 0 (the preflight of an upgrade)\n"
		"  --socket PATH          listen here (default %s as root,\n"
		"                         $XDG_RUNTIME_DIR/%s otherwise);\n"
		"                         ignored when systemd passes a socket (LISTEN_FDS)\n"
		"  --socket-mode OCTAL    permissions of the socket file (default 0660)\n"
		"  --socket-group NAME    group of the socket file (default: unchanged)\n"
		"  --allow-uids LIST      only these users (numbers or names, comma-separated)\n"
		"                         may use the daemon, with those --allow-gids admits;\n"
		"                         root and the daemon's own uid always may (default:\n"
		"                         everyone who can open the socket)\n"
		"  --allow-gids LIST      only members of these groups (primary or\n"
		"                         supplementary) may use the daemon, with those\n"
		"                         --allow-uids admits (default: everyone)\n"
		"  --token-ttl MS         an unadopted token releases after this (default 60000)\n"
		"  --max-connections N    open connections in all (default 1024)\n"
		"  --uid-host-bytes BYTES host bytes one uid may hold (default half of RAM)\n"
		"  --uid-cuda-bytes BYTES CUDA bytes one uid may hold, all devices (default 1T)\n"
		"  --uid-buffers N        live buffers one uid may own (default 65536)\n"
		"  --max-host-buffers N   live host buffers in all, one file descriptor each\n"
		"                         (default 0: what the open-file limit leaves)\n"
		"  --conn-tokens N        live tokens one connection may make (default 4096)\n"
		"  --uid-tokens N         live tokens one uid may have made, its closed\n"
		"                         connections' included (default 65536)\n"
		"  --conn-waits N         parked waits per connection (default 1024)\n"
		"  --conn-inflight N      requests of one connection parked at once (Waits,\n"
		"                         Allocs waiting for device memory) before the daemon\n"
		"                         stops reading it until one is answered (default 2048)\n"
		"  --queue-bytes BYTES    queued output per connection before it is dropped\n"
		"                         (default 4194304)\n"
		"  --send-timeout MS      a connection whose queued output cannot be sent for\n"
		"                         this long is dropped (default 30000)\n"
		"  --max-datagram BYTES   largest request accepted (default %d)\n"
		"  --host-pool-memfds N   memfds of freed host buffers kept for reuse by\n"
		"                         the same uid (default 64, at most 1024); 0: none,\n"
		"                         each is closed when its buffer is freed\n"
		"  --cuda-slab-bytes BYTES\n"
		"                         CUDA buffers are carved out of allocations (slabs)\n"
		"                         of this size, rounded up to 2 MiB (default 64M, at\n"
		"                         least 1M); a larger buffer gets its own allocation\n"
		"  --cuda-cache-bytes BYTES\n"
		"                         empty slabs kept per device for reuse (default 256M)\n"
		"  --cuda-device-bytes BYTES\n"
		"                         device memory the daemon may hold per device\n"
		"                         (default 90%% of each device's memory)\n"
		"  --cuda-handle KIND     what a CUDA alloc that names no handle kind gets:\n"
		"                         legacy (default: a CUDA IPC handle), vmm (a\n"
		"                         cuMemCreate allocation whose fd the daemon sends:\n"
		"                         crosses containers) or auto (vmm where the device\n"
		"                         and driver allow it, else legacy)\n"
		"  --cuda-forbid KIND     never give this kind: none (default), legacy or vmm;\n"
		"                         asking for it is refused (BB_ERR_UNSUPPORTED)\n"
		"  --max-cuda-vmm-allocations N\n"
		"                         VMM allocations held at once, all devices; each is\n"
		"                         an open file of the daemon's (default 1024)\n"
		"  --no-cuda              serve host buffers only: do not load the CUDA driver\n"
		"                         ($BUFBROKER_CUDA_LIBRARY, default libcuda.so.1)\n"
		"  --metrics-listen ADDRESS:PORT\n"
		"                         serve Prometheus metrics over HTTP there, e.g.\n"
		"                         127.0.0.1:9464 (default: off)\n"
		"  --restart[=on|off]     keep the state journal and the buffers' fds so that\n"
		"                         buffers survive a restart (systemd's fd store);\n"
		"                         SIGUSR2 or 'bufbroker upgrade' then re-executes\n"
		"                         the binary in place (bufbrokerd(8), UPGRADE)\n"
		"  --restart-strict       a kept state that is refused fails the start\n"
		"                         (default: start empty)\n"
		"  --restart-grace MS     how long a restored session waits to be resumed\n"
		"                         (default 10000)\n"
		"  --log-level LEVEL      error, warn, info (default) or debug\n"
		"  --version              print the version and exit\n"
		"  --help                 print this help and exit\n"
		"\n"
		"BYTES and N take an optional K, M, G or T suffix (powers of 1024).\n"
		"See bufbrokerd(8) for the configuration file's keys.\n",
		BB_CONFIG_FILE, BB_SYSTEM_SOCKET, BB_USER_SOCKET_NAME, BB_MAX_DATAGRAM);
}

enum { OPT_KEY = 256, OPT_CONFIG, OPT_CHECK_CONFIG, OPT_CHECK_JOURNAL, OPT_VERSION, OPT_HELP };

/* Every option but the last five sets a configuration key (config.c). */
static const struct option options[] = {
	{"socket", required_argument, NULL, OPT_KEY},
	{"socket-mode", required_argument, NULL, OPT_KEY},
	{"socket-group", required_argument, NULL, OPT_KEY},
	{"token-ttl", required_argument, NULL, OPT_KEY},
	{"max-connections", required_argument, NULL, OPT_KEY},
	{"max-host-buffers", required_argument, NULL, OPT_KEY},
	{"uid-host-bytes", required_argument, NULL, OPT_KEY},
	{"uid-cuda-bytes", required_argument, NULL, OPT_KEY},
	{"uid-buffers", required_argument, NULL, OPT_KEY},
	{"conn-tokens", required_argument, NULL, OPT_KEY},
	{"uid-tokens", required_argument, NULL, OPT_KEY},
	{"conn-waits", required_argument, NULL, OPT_KEY},
	{"conn-inflight", required_argument, NULL, OPT_KEY},
	{"send-timeout", required_argument, NULL, OPT_KEY},
	{"allow-uids", required_argument, NULL, OPT_KEY},
	{"allow-gids", required_argument, NULL, OPT_KEY},
	{"queue-bytes", required_argument, NULL, OPT_KEY},
	{"max-datagram", required_argument, NULL, OPT_KEY},
	{"host-pool-memfds", required_argument, NULL, OPT_KEY},
	{"log-level", required_argument, NULL, OPT_KEY},
	{"cuda-slab-bytes", required_argument, NULL, OPT_KEY},
	{"cuda-cache-bytes", required_argument, NULL, OPT_KEY},
	{"cuda-device-bytes", required_argument, NULL, OPT_KEY},
	{"cuda-handle", required_argument, NULL, OPT_KEY},
	{"cuda-forbid", required_argument, NULL, OPT_KEY},
	{"max-cuda-vmm-allocations", required_argument, NULL, OPT_KEY},
	{"no-cuda", no_argument, NULL, OPT_KEY},
	{"metrics-listen", required_argument, NULL, OPT_KEY},
	{"restart", optional_argument, NULL, OPT_KEY},
	{"restart-strict", no_argument, NULL, OPT_KEY},
	{"restart-grace", required_argument, NULL, OPT_KEY},
	{"config", required_argument, NULL, OPT_CONFIG},
	{"check-config", required_argument, NULL, OPT_CHECK_CONFIG},
	{"check-journal-version", no_argument, NULL, OPT_CHECK_JOURNAL},
	{"version", no_argument, NULL, OPT_VERSION},
	{"help", no_argument, NULL, OPT_HELP},
	{NULL, 0, NULL, 0},
};

/* What the daemon was started with, kept for SIGHUP. */
static struct {
	const char *file;   /* --config FILE, or BB_CONFIG_FILE */
	bool file_given;    /* --config was given: the file must exist */
	config_flag *flags; /* the flags that set keys, in order */
	size_t nflags;
	config running; /* the settings in effect */
	server *s;
	uv_signal_t sighup;
} d;

static void problems_print(const config_problems *probs)
{
	char line[1024];
	for (size_t i = 0; i < probs->n; i++)
		fprintf(stderr, "bufbrokerd: %s\n",
			config_problem_format(probs, &probs->list[i], line, sizeof(line)));
}

/* Defaults, then the file, then the flags, into c (config_free it in any
 * case). Problems go to file_probs and flag_probs; returns their number. */
static size_t load(config *c, config_problems *file_probs, config_problems *flag_probs)
{
	config_init(c);
	size_t n = config_read_file(c, d.file, d.file_given, file_probs);
	for (size_t i = 0; i < d.nflags; i++)
		if (config_apply_flag(c, &d.flags[i], flag_probs) < 0)
			n++;
	if (config_finish(c, flag_probs) < 0)
		n++;
	return n;
}

/* Tell systemd a reload began: RELOADING=1 with MONOTONIC_USEC, the
 * CLOCK_MONOTONIC time in microseconds, as sd_notify(3) asks, so that the
 * service manager holds `systemctl reload` until the READY=1 that
 * reload_done sends. Nothing without $NOTIFY_SOCKET. */
static void reload_begin(void)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	uint64_t usec = (uint64_t)now.tv_sec * 1000000u + (uint64_t)now.tv_nsec / 1000u;
	sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%" PRIu64 "\nSTATUS=reloading", usec);
}

/* Tell systemd the reload is over, applied or not: the daemon serves either
 * way, and STATUS= says which (systemctl status shows it). */
static void reload_done(bool applied)
{
	sd_notify(0, applied ? "READY=1\nSTATUS=serving"
			     : "READY=1\nSTATUS=serving; the last reload failed, see the log");
}

/* SIGHUP: re-read the file; apply what can change live, or, if the file
 * has problems, log them and change nothing. systemd hears RELOADING=1
 * first and READY=1 last. */
static void on_sighup(uv_signal_t *h, int signum)
{
	config fresh;
	config_problems fp = {0}, flp = {0};
	char file[300];
	(void)h;
	(void)signum;
	reload_begin();
	log_escape(d.file, file, sizeof(file));
	char why[512], esc[600];
	bool applied_ok = false;
	size_t n = load(&fresh, &fp, &flp);
	if (n) {
		config_problems_log(&fp);
		config_problems_log(&flp);
		log_error("event=config_reload_failed file=\"%s\" problems=%zu action=none", file,
			  n);
	} else if (server_reload_check(d.s, &fresh.server, why, sizeof(why)) < 0) {
		log_error("event=config_reload_failed file=\"%s\" error=\"%s\" action=none", file,
			  log_escape(why, esc, sizeof(esc)));
	} else {
		size_t applied = config_apply_live(&d.running, &fresh);
		server_reload(d.s, &d.running.server);
		log_info("event=config_reloaded file=\"%s\" applied=%zu", file, applied);
		log_set_level(d.running.log_level);
		config_log_warnings(&d.running);
		applied_ok = true;
	}
	reload_done(applied_ok);
	config_free(&fresh);
	config_problems_free(&fp);
	config_problems_free(&flp);
}

/* --check-config FILE: every problem of the file (and of the flags given
 * with it), or "FILE: ok". */
static int check_config(const char *path)
{
	config c;
	config_problems fp = {0}, flp = {0};
	d.file = path;
	d.file_given = true;
	size_t n = load(&c, &fp, &flp);
	problems_print(&fp);
	problems_print(&flp);
	if (n == 0)
		printf("%s: ok\n", path);
	else
		fprintf(stderr, "bufbrokerd: %s: %zu problem%s\n", path, n, n == 1 ? "" : "s");
	config_free(&c);
	config_problems_free(&fp);
	config_problems_free(&flp);
	return n ? 1 : 0;
}

int main(int argc, char **argv)
{
	const char *check = NULL;
	int opt, idx;

	/* A SIGHUP or SIGUSR2 before the loop handles it must not end the
	 * daemon (nor SIGUSR2 one whose journal is off: there is no upgrade). */
	signal(SIGHUP, SIG_IGN);
	signal(SIGUSR2, SIG_IGN);
	upgrade_save_argv(argc, argv);
	/* $BUFBROKERD_CONFIG moves the default (the test suite points it at
	 * an empty file so that a host's own config cannot change results). */
	const char *env = getenv("BUFBROKERD_CONFIG");
	d.file = env && env[0] ? env : BB_CONFIG_FILE;
	d.flags = calloc((size_t)argc, sizeof(*d.flags));
	if (!d.flags)
		return 1;
	while ((opt = getopt_long(argc, argv, "", options, &idx)) != -1) {
		switch (opt) {
		case OPT_KEY:
			d.flags[d.nflags].name = options[idx].name;
			/* --no-cuda sets [cuda] enabled false, --restart
			 * [restart] journal true */
			d.flags[d.nflags].value = optarg ? optarg
						  : strcmp(options[idx].name, "no-cuda") == 0
							  ? "false"
							  : "true";
			d.nflags++;
			break;
		case OPT_CONFIG:
			d.file = optarg;
			d.file_given = true;
			break;
		case OPT_CHECK_CONFIG: check = optarg; break;
		case OPT_CHECK_JOURNAL:
			upgrade_print_journal_versions(stdout);
			free(d.flags);
			return 0;
		case OPT_VERSION:
			printf("bufbrokerd %s (protocol %d.%d)\n", BB_VERSION_STRING,
			       BB_PROTO_MAJOR, BB_PROTO_MINOR);
			free(d.flags);
			return 0;
		case OPT_HELP:
			usage(stdout);
			free(d.flags);
			return 0;
		default:
			usage(stderr);
			free(d.flags);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "bufbrokerd: unexpected argument \"%s\"\n", argv[optind]);
		usage(stderr);
		free(d.flags);
		return 2;
	}
	if (check) {
		int rc = check_config(check);
		free(d.flags);
		return rc;
	}

	config_problems fp = {0}, flp = {0};
	size_t n = load(&d.running, &fp, &flp);
	if (n) {
		problems_print(&fp);
		problems_print(&flp);
		/* A bad flag is a bad command line (2); a bad file is not. */
		int rc = flp.n ? 2 : 1;
		config_problems_free(&fp);
		config_problems_free(&flp);
		config_free(&d.running);
		free(d.flags);
		return rc;
	}
	log_set_level(d.running.log_level);
	config_log_warnings(&d.running);
	if (upgrade_take_env())
		log_info("event=upgraded pid=%ld version=%s", (long)getpid(), BB_VERSION_STRING);

	/* Sends use MSG_NOSIGNAL; this also covers anything that doesn't. */
	signal(SIGPIPE, SIG_IGN);

	uv_loop_t loop;
	int rc = 0;
	if (uv_loop_init(&loop) < 0) {
		fprintf(stderr, "bufbrokerd: cannot create the event loop\n");
		config_free(&d.running);
		free(d.flags);
		return 1;
	}
	char file[300];
	log_escape(d.file, file, sizeof(file));
	log_info("event=config_read file=\"%s\" found=%s", file,
		 access(d.file, F_OK) == 0 ? "yes" : "no");
	if (server_start(&d.s, &loop, &d.running.server) < 0) {
		rc = 1;
	} else if (d.running.metrics_listen &&
		   server_metrics_start(d.s, d.running.metrics_listen) < 0) {
		rc = 1; /* asked for metrics and cannot serve them: the log says why */
	} else {
		uv_signal_init(&loop, &d.sighup);
		uv_signal_start(&d.sighup, on_sighup, SIGHUP);
		uv_run(&loop, UV_RUN_DEFAULT);
	}
	server_shutdown(d.s);
	uv_loop_close(&loop);
	if (rc == 0)
		log_info("event=stopped");
	config_free(&d.running);
	free(d.flags);
	return rc;
}
