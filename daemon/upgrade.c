/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The planned upgrade by execve (upgrade.h, docs/RESTART.md).
 *
 * The delicate part is handing the fds over at 3, 4, ... as systemd does
 * while keeping a way back: execve may still fail (the binary vanished
 * after the preflight, E2BIG, ENOMEM), and then the daemon must serve on
 * with every fd where libuv and the broker expect it. So the fds are never
 * closed, only renamed (dup2 to a free number, close the old one), each
 * rename logged; undoing the log in reverse puts every fd back at its
 * number with its flags.
 */
#include "upgrade.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "journal.h"
#include "log.h"
#include "status.h"

extern char **environ;

/* The kernel refuses an environment string longer than this (MAX_ARG_STRLEN,
 * 32 pages): LISTEN_FDNAMES goes in a memfd as well, always. */
#define UPGRADE_ENV_STRING_MAX (32 * 4096)

struct upgrade {
	upgrade_env env;     /* what is handed over */
	uv_signal_t sigusr2; /* SIGUSR2: upgrade to the daemon's own binary */
	uv_check_t check;    /* after the turn that answered the Upgrade: exec */
	uv_idle_t idle;      /* while an exec is due: the turn does not block */
	char path[PATH_MAX]; /* the binary that passed the preflight */
	bool due;            /* exec at the end of this turn */
	int closing;         /* handles not yet closed (upgrade_close) */
};

/* Saved at start: argv and the binary's resolved path. */
static char **g_argv;
static char g_self[PATH_MAX];

void upgrade_save_argv(int argc, char **argv)
{
	(void)argc;
	g_argv = argv;
	ssize_t n = readlink("/proc/self/exe", g_self, sizeof(g_self) - 1);
	g_self[n > 0 ? n : 0] = '\0';
}

void upgrade_print_journal_versions(FILE *out)
{
	/* Every layout it reads: the one it writes and the older ones it
	 * converts (journal_read), so that a daemon of any of them may
	 * upgrade to it. */
	fprintf(out, "%s", UPGRADE_VERSIONS_PREFIX);
	for (int v = JOURNAL_VERSION; v >= JOURNAL_VERSION_OLDEST; v--)
		fprintf(out, " %d", v);
	fputc('\n', out);
}

bool upgrade_take_env(void)
{
	const char *v = getenv(UPGRADE_ENV);
	bool upgraded = v && strcmp(v, "1") == 0;
	const char *names = getenv(UPGRADE_ENV_FDNAMES);

	if (names) {
		char *end;
		long fd = strtol(names, &end, 10);
		struct stat st;
		if (*names && !*end && fd > 2 && fd < INT_MAX && fstat((int)fd, &st) == 0 &&
		    st.st_size > 0) {
			char *buf = malloc((size_t)st.st_size + 1);
			if (buf && pread((int)fd, buf, (size_t)st.st_size, 0) == st.st_size) {
				buf[st.st_size] = '\0';
				setenv("LISTEN_FDNAMES", buf, 1);
			}
			free(buf);
		}
		if (*names && !*end && fd > 2 && fd < INT_MAX)
			close((int)fd);
		unsetenv(UPGRADE_ENV_FDNAMES);
	}
	unsetenv(UPGRADE_ENV);
	return upgraded;
}

/* ---- environments ---------------------------------------------------------- */

/* Whether the environment string e sets one of the variables an upgrade
 * sets itself, or one a preflight must not see. */
static bool env_ours(const char *e, bool preflight)
{
	static const char *const ours[] = {"LISTEN_FDS=", "LISTEN_PID=", "LISTEN_FDNAMES=",
					   UPGRADE_ENV "=", UPGRADE_ENV_FDNAMES "="};
	for (size_t i = 0; i < sizeof(ours) / sizeof(ours[0]); i++)
		if (strncmp(e, ours[i], strlen(ours[i])) == 0)
			return true;
	return preflight && strncmp(e, "NOTIFY_SOCKET=", 14) == 0;
}

/* environ without ours, room for extra more entries and the NULL. */
static char **env_copy(bool preflight, size_t extra)
{
	size_t n = 0;
	while (environ && environ[n])
		n++;
	char **out = calloc(n + extra + 1, sizeof(*out));
	if (!out)
		return NULL;
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		if (!env_ours(environ[i], preflight))
			out[k++] = environ[i];
	return out;
}

/* ---- the preflight --------------------------------------------------------- */

static int64_t now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Whether out (the preflight's output) lists JOURNAL_VERSION on its
 * UPGRADE_VERSIONS_PREFIX line. */
static bool lists_our_version(const char *out)
{
	size_t pl = strlen(UPGRADE_VERSIONS_PREFIX);
	for (const char *ln = out; ln && *ln; ln = strchr(ln, '\n') ? strchr(ln, '\n') + 1 : NULL) {
		if (strncmp(ln, UPGRADE_VERSIONS_PREFIX, pl) != 0)
			continue;
		const char *p = ln + pl;
		while (*p && *p != '\n') {
			char *end;
			long v = strtol(p, &end, 10);
			if (end == p)
				break;
			if (v == JOURNAL_VERSION)
				return true;
			p = end;
		}
	}
	return false;
}

/* Run path --check-journal-version; its output (stdout and stderr) into
 * out (cap bytes, NUL-terminated, what did not fit dropped), its wait
 * status into *status. 0, or an errno (*timed_out when it ran too long and
 * was killed). */
static int spawn_check(const char *path, char *out, size_t cap, int *status, bool *timed_out)
{
	int p[2], err;
	pid_t pid;
	posix_spawn_file_actions_t fa;
	char *const argv[] = {(char *)path, "--check-journal-version", NULL};
	char **envp = env_copy(true, 0);

	*timed_out = false;
	out[0] = '\0';
	if (!envp)
		return ENOMEM;
	if (pipe2(p, O_CLOEXEC) < 0) {
		err = errno;
		free(envp);
		return err;
	}
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, p[1], 1);
	posix_spawn_file_actions_adddup2(&fa, p[1], 2);
	err = posix_spawn(&pid, path, &fa, NULL, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	free(envp);
	close(p[1]);
	if (err) {
		close(p[0]);
		return err;
	}
	size_t got = 0;
	int64_t deadline = now_ms() + UPGRADE_PREFLIGHT_MS;
	for (;;) {
		int64_t left = deadline - now_ms();
		struct pollfd pfd = {.fd = p[0], .events = POLLIN};
		if (left <= 0) {
			*timed_out = true;
			break;
		}
		int r = poll(&pfd, 1, (int)left);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			continue; /* the deadline decides */
		char buf[256];
		ssize_t n = read(p[0], buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break; /* end of its output */
		size_t keep = (size_t)n < cap - 1 - got ? (size_t)n : cap - 1 - got;
		memcpy(out + got, buf, keep);
		got += keep;
		out[got] = '\0';
	}
	close(p[0]);
	/* Its output ended: it is exiting. Wait for it within what is left. */
	while (!*timed_out) {
		pid_t w = waitpid(pid, status, WNOHANG);
		if (w == pid)
			return 0;
		if (w < 0 && errno != EINTR)
			return errno;
		if (now_ms() >= deadline)
			*timed_out = true;
		else
			usleep(1000);
	}
	kill(pid, SIGKILL);
	while (waitpid(pid, status, 0) < 0 && errno == EINTR)
		;
	return ETIMEDOUT;
}

/* Control characters of out as spaces, trailing ones dropped: it is quoted
 * in an answer's message. */
static void output_clean(char *out)
{
	size_t n = strlen(out);
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f)
			out[i] = ' ';
	while (n && out[n - 1] == ' ')
		out[--n] = '\0';
}

int upgrade_preflight(const char *binary, char *path, size_t path_len, char *why, size_t len)
{
	char out[UPGRADE_OUTPUT_MAX];
	int status = 0;
	bool timed_out = false;

	if (!binary || !binary[0])
		binary = g_self;
	if (!binary[0]) {
		snprintf(why, len, "the daemon could not resolve its own binary at start");
		return BB_ERR_NOT_FOUND;
	}
	if (binary[0] != '/') {
		snprintf(why, len, "the binary must be an absolute path, not \"%s\"", binary);
		return BB_ERR_INVALID;
	}
	if (strlen(binary) >= path_len) {
		snprintf(why, len, "the binary's path is too long");
		return BB_ERR_INVALID;
	}
	/* Asked first: posix_spawn reports a failed exec as its result only
	 * where the child shares its memory until the exec (glibc's vfork-like
	 * clone); elsewhere (valgrind) the child just exits 127. */
	int err = access(binary, X_OK) < 0 ? errno : 0;
	if (!err)
		err = spawn_check(binary, out, sizeof(out), &status, &timed_out);
	if (err && !timed_out) {
		snprintf(why, len, "cannot execute %s: %s", binary, strerror(err));
		return err == ENOENT || err == EACCES || err == ENOEXEC || err == ENOTDIR
			       ? BB_ERR_NOT_FOUND
			       : BB_ERR_SYSTEM;
	}
	output_clean(out);
	if (timed_out) {
		snprintf(why, len, "%s --check-journal-version did not answer within %d ms", binary,
			 UPGRADE_PREFLIGHT_MS);
		return BB_ERR_UNSUPPORTED;
	}
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !lists_our_version(out)) {
		char st[48];
		if (WIFEXITED(status))
			snprintf(st, sizeof(st), "exit status %d", WEXITSTATUS(status));
		else
			snprintf(st, sizeof(st), "signal %d",
				 WIFSIGNALED(status) ? WTERMSIG(status) : 0);
		snprintf(why, len,
			 "%s cannot read this daemon's state journal (layout version %d): "
			 "--check-journal-version gave %s and said \"%s\"",
			 binary, JOURNAL_VERSION, st, out);
		return BB_ERR_UNSUPPORTED;
	}
	snprintf(path, path_len, "%s", binary);
	return 0;
}

/* ---- handing the fds over -------------------------------------------------- */

/* One rename: fd from became fd to (from is closed); flags were from's. */
typedef struct rename_rec {
	int from, to, flags;
} rename_rec;

/* What upgrade_exec gathers and moves. */
typedef struct handover {
	int *fds;         /* listening socket, the named fds, the names memfd */
	size_t n, cap;    /* fds[0..n) */
	char *names;      /* LISTEN_FDNAMES: "name:name:..." */
	size_t names_len; /* bytes in names */
	size_t names_cap;
	int err;         /* the walk failed: an errno */
	int *orig;       /* fds[] as they were before place_fds */
	int *flags;      /* their fd flags then */
	rename_rec *log; /* renames done, in order */
	size_t nlog;
} handover;

static int add_fd(handover *h, const char *name, int fd)
{
	size_t nl = strlen(name);
	if (h->n == h->cap) {
		size_t cap = h->cap ? h->cap * 2 : 64;
		int *f = realloc(h->fds, cap * sizeof(*f));
		if (!f)
			return h->err = ENOMEM;
		h->fds = f;
		h->cap = cap;
	}
	if (h->names_len + nl + 2 > h->names_cap) {
		size_t cap = (h->names_cap ? h->names_cap * 2 : 4096) + nl + 2;
		char *s = realloc(h->names, cap);
		if (!s)
			return h->err = ENOMEM;
		h->names = s;
		h->names_cap = cap;
	}
	if (!nl || strchr(name, ':') || fd < 0)
		return h->err = EINVAL;
	if (h->names_len)
		h->names[h->names_len++] = ':';
	memcpy(h->names + h->names_len, name, nl + 1);
	h->names_len += nl;
	h->fds[h->n++] = fd;
	return 0;
}

static int each_cb(void *ctx, const char *name, int fd)
{
	return add_fd(ctx, name, fd);
}

/* Rename fd from to the free number to (to < 0: the lowest free number
 * at or above -to, close-on-exec). The new number, or -1 with errno. */
static int rename_fd(handover *h, int from, int to)
{
	int flags = fcntl(from, F_GETFD);
	int got = to >= 0 ? dup2(from, to) : fcntl(from, F_DUPFD_CLOEXEC, -to);
	if (got < 0)
		return -1;
	close(from);
	h->log[h->nlog++] = (rename_rec){.from = from, .to = got, .flags = flags};
	return got;
}

/* Undo every rename, last first: each fd is back at its number with its
 * flags. */
static void renames_undo(handover *h)
{
	while (h->nlog) {
		rename_rec r = h->log[--h->nlog];
		if (dup2(r.to, r.from) == r.from) {
			close(r.to);
			fcntl(r.from, F_SETFD, r.flags);
		}
	}
}

/* Put fds[i] at 3 + i for every i. Whatever sat at one of those numbers
 * moves above them (close-on-exec). 0, or -1 with errno and nothing moved. */
static int place_fds(handover *h)
{
	int top = 3 + (int)h->n; /* the first number above the targets */

	h->log = calloc(2 * h->n, sizeof(*h->log));
	h->orig = calloc(h->n, sizeof(*h->orig));
	h->flags = calloc(h->n, sizeof(*h->flags));
	if (!h->log || !h->orig || !h->flags)
		return -1;
	for (size_t i = 0; i < h->n; i++) {
		h->orig[i] = h->fds[i];
		h->flags[i] = fcntl(h->fds[i], F_GETFD);
	}
	for (size_t i = 0; i < h->n; i++) {
		int t = 3 + (int)i;
		if (h->fds[i] == t)
			continue;
		if (fcntl(t, F_GETFD) >= 0) {
			/* t is taken: by one of ours still to be placed, or by
			 * something the new image does not get. Move it up. */
			int moved = rename_fd(h, t, -top);
			if (moved < 0)
				goto undo;
			for (size_t j = i + 1; j < h->n; j++)
				if (h->fds[j] == t)
					h->fds[j] = moved;
		}
		if (rename_fd(h, h->fds[i], t) < 0)
			goto undo;
		h->fds[i] = t;
	}
	return 0;
undo:;
	int err = errno;
	renames_undo(h);
	errno = err;
	return -1;
}

/* The memfd that carries LISTEN_FDNAMES: fd, or -1 with errno. */
static int names_memfd(const handover *h)
{
	int fd = memfd_create("bufbroker-fdnames", MFD_CLOEXEC);
	if (fd < 0)
		return -1;
	size_t off = 0;
	while (off < h->names_len) {
		ssize_t n = write(fd, h->names + off, h->names_len - off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			int err = n < 0 ? errno : EIO;
			close(fd);
			errno = err;
			return -1;
		}
		off += (size_t)n;
	}
	return fd;
}

/* Whether the numbers in fds[0..n) are distinct (each fd passed once). */
static bool fds_distinct(const int *fds, size_t n)
{
	int max = 0;
	for (size_t i = 0; i < n; i++)
		max = fds[i] > max ? fds[i] : max;
	uint8_t *seen = calloc((size_t)max / 8 + 1, 1);
	bool ok = seen != NULL;
	for (size_t i = 0; ok && i < n; i++) {
		ok = !(seen[fds[i] / 8] & (1u << (fds[i] % 8)));
		seen[fds[i] / 8] |= (uint8_t)(1u << (fds[i] % 8));
	}
	free(seen);
	return ok;
}

int upgrade_exec(const upgrade_env *env, const char *path, char *why, size_t len)
{
	handover h = {0};
	char **envp = NULL;
	char *names_var = NULL;
	char nfds[48], npid[48], nmem[64];
	int rc = BB_ERR_SYSTEM, memfd = -1;
	size_t nlisten;

	if (!g_argv) {
		snprintf(why, len, "the daemon did not keep its arguments at start");
		return BB_ERR_SYSTEM;
	}
	if (add_fd(&h, "bufbrokerd.socket", env->listen_fd) == 0 && env->each)
		env->each(env->each_ctx, each_cb, &h);
	if (h.err) {
		snprintf(why, len, "cannot gather the fds to hand over: %s", strerror(h.err));
		goto out;
	}
	nlisten = h.n;
	if (!fds_distinct(h.fds, h.n)) {
		snprintf(why, len, "an fd to hand over is listed twice");
		goto out;
	}
	memfd = names_memfd(&h);
	if (memfd < 0 || add_fd(&h, "fdnames", memfd) != 0) {
		snprintf(why, len, "cannot write the fd names: %s", strerror(errno));
		goto out;
	}
	h.names_len -= strlen(":fdnames"); /* not one of LISTEN_FDNAMES */
	h.names[h.names_len] = '\0';
	envp = env_copy(false, 5);
	if (!envp || asprintf(&names_var, "LISTEN_FDNAMES=%s", h.names) < 0) {
		names_var = NULL;
		snprintf(why, len, "out of memory");
		rc = BB_ERR_NO_MEMORY;
		goto out;
	}
	size_t k = 0;
	while (envp[k])
		k++;
	snprintf(nfds, sizeof(nfds), "LISTEN_FDS=%zu", nlisten);
	snprintf(npid, sizeof(npid), "LISTEN_PID=%ld", (long)getpid());
	snprintf(nmem, sizeof(nmem), UPGRADE_ENV_FDNAMES "=%zu", 3 + nlisten);
	envp[k++] = nfds;
	envp[k++] = npid;
	envp[k++] = UPGRADE_ENV "=1";
	envp[k++] = nmem;
	if (strlen(names_var) < UPGRADE_ENV_STRING_MAX)
		envp[k++] = names_var; /* else only in the memfd */

	log_info("event=upgrade_exec binary=\"%s\" fds=%zu pid=%ld", path, nlisten, (long)getpid());
	if (place_fds(&h) < 0) {
		snprintf(why, len, "cannot move the fds to hand over into place: %s",
			 strerror(errno));
		goto out;
	}
	for (size_t i = 0; i < h.n; i++)
		fcntl(h.fds[i], F_SETFD, 0);
	execve(path, g_argv, envp);
	int err = errno;
	/* Every fd back at its number (the names memfd too, ours to close),
	 * close-on-exec again. */
	renames_undo(&h);
	for (size_t i = 0; i < h.n; i++)
		fcntl(h.orig[i], F_SETFD, h.flags[i]);
	snprintf(why, len, "execve %s: %s", path, strerror(err));
	rc = err == ENOENT || err == EACCES || err == ENOEXEC ? BB_ERR_NOT_FOUND : BB_ERR_SYSTEM;
out:
	if (memfd >= 0)
		close(memfd);
	free(names_var);
	free(envp);
	free(h.log);
	free(h.orig);
	free(h.flags);
	free(h.fds);
	free(h.names);
	return rc;
}

/* ---- the loop's side -------------------------------------------------------- */

static void exec_now(upgrade *u)
{
	char why[512], esc[600];
	int err = upgrade_exec(&u->env, u->path, why, sizeof(why));
	log_error("event=upgrade_failed binary=\"%s\" code=%s error=\"%s\" action=serving_on",
		  u->path, bb_err_name(err), log_escape(why, esc, sizeof(esc)));
}

static void on_idle(uv_idle_t *h)
{
	(void)h; /* being active keeps the turn from blocking: the check runs */
}

static void on_check(uv_check_t *h)
{
	upgrade *u = h->data;
	uv_check_stop(&u->check);
	uv_idle_stop(&u->idle);
	if (u->due) {
		u->due = false;
		exec_now(u);
	}
}

static void start(void *ctx)
{
	upgrade *u = ctx;
	u->due = true;
	uv_check_start(&u->check, on_check);
	uv_idle_start(&u->idle, on_idle);
}

static int prepare(void *ctx, const char *binary, char *why, size_t len)
{
	upgrade *u = ctx;
	if (u->due) {
		snprintf(why, len, "an upgrade is already under way");
		return BB_ERR_STATE;
	}
	return upgrade_preflight(binary, u->path, sizeof(u->path), why, len);
}

static void on_sigusr2(uv_signal_t *h, int signum)
{
	upgrade *u = h->data;
	char why[768], esc[800];
	(void)signum;
	log_info("event=upgrade_requested signal=SIGUSR2 binary=\"%s\"", g_self);
	int err = prepare(u, NULL, why, sizeof(why));
	if (err) {
		log_error("event=upgrade_refused code=%s error=\"%s\" action=serving_on",
			  bb_err_name(err), log_escape(why, esc, sizeof(esc)));
		return;
	}
	start(u);
}

upgrade *upgrade_new(const upgrade_env *env)
{
	upgrade *u = calloc(1, sizeof(*u));
	if (!u)
		return NULL;
	u->env = *env;
	uv_signal_init(env->loop, &u->sigusr2);
	uv_check_init(env->loop, &u->check);
	uv_idle_init(env->loop, &u->idle);
	u->sigusr2.data = u->check.data = u->idle.data = u;
	uv_signal_start(&u->sigusr2, on_sigusr2, SIGUSR2);
	return u;
}

handler_upgrade upgrade_hooks(upgrade *u)
{
	return (handler_upgrade){.prepare = prepare, .start = start, .ctx = u};
}

static void on_closed(uv_handle_t *h)
{
	upgrade *u = h->data;
	if (--u->closing == 0)
		free(u);
}

void upgrade_close(upgrade *u)
{
	if (!u)
		return;
	u->closing = 3;
	uv_close((uv_handle_t *)&u->sigusr2, on_closed);
	uv_close((uv_handle_t *)&u->check, on_closed);
	uv_close((uv_handle_t *)&u->idle, on_closed);
}
