/*
 * The daemon's settings: built-in defaults, then the INI file
 * (/etc/bufbroker/bufbrokerd.conf or --config FILE, parsed with inih), then
 * the command-line flags, which override the file. Every setting has one
 * key, "section.name", and most have a flag; the table in config.c is the
 * one list of them (docs/OPERATIONS.md mirrors it).
 *
 * Problems are collected, not stopped at: a file is read to its end and
 * every bad line is reported, so `bufbrokerd --check-config` can list them
 * all and a SIGHUP with a bad file can log them all and change nothing.
 */
#ifndef BB_CONFIG_H
#define BB_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "log.h"
#include "server.h"

/* Read when --config is not given; a missing default file is no error. */
#ifndef BB_CONFIG_FILE
#define BB_CONFIG_FILE "/etc/bufbroker/bufbrokerd.conf"
#endif

typedef struct config {
	server_config server;       /* socket, limits, CUDA: what server_start takes */
	enum log_level log_level;   /* [log] level */
	const char *metrics_listen; /* [metrics] listen "HOST:PORT", or NULL: no listener */
	char *own_path;             /* the strings above point here (malloc'ed) */
	char *own_group;
	char *own_metrics;
} config;

/* One problem with the file or a flag. */
typedef struct config_problem {
	int line;      /* line in the file; 0 for a flag or the file as a whole */
	char key[64];  /* "[section] name", "--flag", or "" */
	char why[256]; /* e.g. "\"lots\" is not a number" */
} config_problem;

/* The problems of one load, in the order found. */
typedef struct config_problems {
	const char *file;     /* the file they are in (borrowed), or NULL */
	config_problem *list; /* malloc'ed */
	size_t n, cap;
} config_problems;

/* A flag that sets a key, as getopt_long gives it. */
typedef struct config_flag {
	const char *name;  /* the long option without "--", e.g. "uid-buffers" */
	const char *value; /* its argument ("false" for --no-cuda); borrowed */
} config_flag;

/* The built-in defaults; no strings yet (the socket path is chosen by
 * config_finish). */
void config_init(config *c);
/* Apply the file at path over c. A file that does not exist is a problem
 * only when required. Returns the number of problems added to probs; keys
 * that were valid are applied even when others were not. */
size_t config_read_file(config *c, const char *path, bool required, config_problems *probs);
/* Apply one flag over c. 0, or -1 with a problem added to probs (key
 * "--name"). A name that sets no key is a bug of the caller: -1 too. */
int config_apply_flag(config *c, const config_flag *f, config_problems *probs);
/* Whether name is a long option that config_apply_flag takes. */
bool config_has_flag(const char *name);
/* Fill what depends on the environment: the default socket path
 * (/run/bufbroker/bufbroker.sock as root, $XDG_RUNTIME_DIR/bufbroker.sock
 * otherwise), and check what one key cannot check alone (a CUDA handle
 * default that cuda-forbid forbids). 0, or -1 with the problem added to
 * probs. */
int config_finish(config *c, config_problems *probs);
/* Free the strings; c may be config_init'ed again. */
void config_free(config *c);

/* A running daemon's settings (running) against a file just re-read
 * (fresh): copy into running each key that differs and can change while
 * running, logging one config_changed line per key (key, old and new
 * value); log one config_restart_needed line naming the keys that differ
 * but take effect only at the next start (they stay as they are in
 * running). Returns the number of keys applied. The caller then hands
 * running to server_reload and log_set_level. */
size_t config_apply_live(config *running, const config *fresh);

/* Log a config_warning line for each setting that is valid but unwise
 * (limits.conn_inflight not above limits.conn_waits). */
void config_log_warnings(const config *c);

/* "FILE:LINE: [section] key: why" (or shorter, when there is no line or
 * key) into buf; returns buf. */
const char *config_problem_format(const config_problems *probs, const config_problem *p, char *buf,
				  size_t len);
/* Log each problem as a config_invalid line at level error. */
void config_problems_log(const config_problems *probs);
void config_problems_free(config_problems *probs);

#endif /* BB_CONFIG_H */
