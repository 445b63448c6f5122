/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The planned upgrade (docs/RESTART.md, "Planned upgrade by execve"): the
 * daemon re-executes a binary in the same process (same pid), handing the
 * new image the listening socket, the state journal and every buffer's fd
 * the way systemd hands a service its stored fds (LISTEN_FDS,
 * LISTEN_FDNAMES, LISTEN_PID), plus BUFBROKERD_UPGRADE=1. The new image
 * starts as after a crash (restart.h, restart_start); the clients' sockets
 * were close-on-exec and the clients resume their sessions.
 *
 * Triggered by the admin op Upgrade (the handler's hooks, handler.h) or by
 * SIGUSR2 (the daemon's own binary). Before anything changes the binary
 * must pass a preflight: `PATH --check-journal-version` (posix_spawn, no
 * fds) must say it reads this daemon's journal layout.
 *
 * Layer: below server (which owns the listening socket and the kept state
 * and creates it), above conn. Everything here runs on the loop thread.
 */
#ifndef BB_UPGRADE_H
#define BB_UPGRADE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <uv.h>

#include "handler.h"

/* How long the preflight binary may take to answer (the loop waits). */
#define UPGRADE_PREFLIGHT_MS 5000
/* The most output of the preflight that is kept (and quoted in answers). */
#define UPGRADE_OUTPUT_MAX 512
/* The line --check-journal-version prints, followed by the layout versions
 * the binary reads, separated by spaces: "journal versions: 2 1". */
#define UPGRADE_VERSIONS_PREFIX "journal versions:"
/* The new image's environment: set to "1" in a daemon that an upgrade
 * started; names the memfd holding LISTEN_FDNAMES (which may exceed the
 * kernel's 128 KiB per environment string with many buffers). */
#define UPGRADE_ENV "BUFBROKERD_UPGRADE"
#define UPGRADE_ENV_FDNAMES "BUFBROKERD_UPGRADE_FDNAMES"

/* Walks the fds a new image needs (restart_each_fd's shape): calls fn with
 * each (name, fd), the journal first; returns how many it gave. */
typedef size_t (*upgrade_each_fd)(void *ctx, int (*fn)(void *fctx, const char *name, int fd),
				  void *fctx);

/* What the upgrade hands over, from the server. */
typedef struct upgrade_env {
	uv_loop_t *loop;      /* SIGUSR2 and the end-of-turn exec run on it */
	int listen_fd;        /* the listening socket: LISTEN_FDS' first fd */
	upgrade_each_fd each; /* the kept state's fds, named */
	void *each_ctx;
} upgrade_env;

typedef struct upgrade upgrade;

/* At the very start of main: keep argv (the new image gets the same) and
 * resolve the running binary (/proc/self/exe), so that an upgrade without
 * --binary runs the file at that path even once the package manager has
 * replaced it. argv must live as long as the process. */
void upgrade_save_argv(int argc, char **argv);
/* In a new image, before the server starts: when UPGRADE_ENV_FDNAMES names
 * a memfd, its contents become LISTEN_FDNAMES and the memfd is closed.
 * Returns whether this process was started by an upgrade (UPGRADE_ENV),
 * and unsets both variables. */
bool upgrade_take_env(void);
/* --check-journal-version: print UPGRADE_VERSIONS_PREFIX and the journal
 * layout versions this binary reads. */
void upgrade_print_journal_versions(FILE *out);

/* Handle SIGUSR2 and be ready for the handler's Upgrade (upgrade_hooks).
 * env is copied. NULL out of memory. */
upgrade *upgrade_new(const upgrade_env *env);
/* The hooks the handler's Upgrade op calls (handler_set_upgrade). */
handler_upgrade upgrade_hooks(upgrade *u);
/* Stop SIGUSR2 and close the handles; free u in their close callback
 * (the loop must run once more). NULL: nothing. */
void upgrade_close(upgrade *u);

/* The preflight: binary (NULL or "": the one resolved at start; else an
 * absolute path) is run as `binary --check-journal-version`, without the
 * daemon's fds, for at most UPGRADE_PREFLIGHT_MS, and must exit 0 and list
 * this daemon's JOURNAL_VERSION. 0 with the path in path (len bytes), or
 * a BB_ERR_* code with why: BB_ERR_INVALID (not an absolute path),
 * BB_ERR_NOT_FOUND (cannot be executed: the errno's text),
 * BB_ERR_UNSUPPORTED (it does not read this layout: its output),
 * BB_ERR_SYSTEM (a pipe, a spawn). */
int upgrade_preflight(const char *binary, char *path, size_t path_len, char *why, size_t len);
/* Re-execute path with the argv saved at start: the listening socket and
 * each fd env->each gives are moved to 3, 4, ... (FD_CLOEXEC cleared; every
 * other fd keeps it and closes), LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID and
 * UPGRADE_ENV set. Returns only when that failed: every fd is back at its
 * number with its flags, and a BB_ERR_* code with why. */
int upgrade_exec(const upgrade_env *env, const char *path, char *why, size_t len);

#endif /* BB_UPGRADE_H */
