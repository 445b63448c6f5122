/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fakesd: a stand-in for systemd running one Type=notify service with a
 * socket unit, Restart=on-failure and an fd store (docs/RESTART.md,
 * "Tests"). The integration harness runs the daemon under it
 * (harness.h: bbt_start_sd); tests/integration/test_fakesd.c checks it.
 *
 *   fakesd --dir DIR --socket PATH [--socket-name NAME] [--socket-mode MODE]
 *          [--store-max N] [--restart-ms MS] [--stop-ms MS] -- PROGRAM ARGS...
 *
 * What it does, as systemd (v252..v257, src/core/service.c, socket.c,
 * manager.c) does it:
 * - The socket unit: a listening SOCK_SEQPACKET socket at PATH (mode
 *   MODE, default 0666; backlog SOMAXCONN), kept across the service's
 *   restarts, passed first, named NAME (FileDescriptorName=, default
 *   "bufbrokerd.socket").
 * - The notify socket DIR/notify (SOCK_DGRAM, SO_PASSCRED), passed as
 *   NOTIFY_SOCKET; FDSTORE=N (the store's limit, as systemd 254+ sets it).
 *   A datagram counts only when its SCM_CREDENTIALS name the main pid
 *   (NotifyAccess=main); others are logged and their fds closed. A
 *   datagram whose payload or control data was truncated is dropped.
 * - READY=1, STOPPING=1; FDSTORE=1 with FDNAME= (a name systemd would
 *   refuse: too long, not printable ASCII, or with ':' is replaced by
 *   "stored", systemd's default) stores every fd of the datagram; past
 *   --store-max (FileDescriptorStoreMax=) the fd and the rest of the
 *   datagram's are closed and logged; an fd for a file already stored is
 *   dropped (systemd's same_fd). Names need not be unique. FDPOLL=0 turns
 *   off what systemd does by default: a stored fd that polls POLLHUP or
 *   POLLERR (a socket or pipe whose peer went; never a regular file or a
 *   memfd) is removed. FDSTOREREMOVE=1 with FDNAME= removes every fd of
 *   that name. fds sent without FDSTORE=1 are closed.
 * - The service's start: fork; in the child, between fork and exec:
 *   LISTEN_PID (its own pid), LISTEN_FDS, LISTEN_FDNAMES (':'-separated),
 *   NOTIFY_SOCKET, FDSTORE; the listening socket at fd 3, then the stored
 *   fds in systemd's order: newest first (systemd keeps the store in a
 *   list it prepends to, and passes the list in order); nothing else open
 *   above 2.
 * - Restart=on-failure: the main process exited non-zero or was killed by
 *   a signal other than SIGHUP, SIGINT, SIGTERM, SIGPIPE: started again
 *   after --restart-ms (RestartSec=, default 100 ms, systemd's default),
 *   with the store. A clean exit ends the service and empties the store
 *   (FileDescriptorStorePreserve=no); fakesd then waits for "stop".
 * - The notify socket is drained before a dead main process is reaped:
 *   systemd's notify event source runs at a higher priority than its
 *   SIGCHLD source ("Process notification messages a bit earlier than
 *   SIGCHLD, so that we can still identify to which service an exit
 *   message belongs", manager.c), so an fd the service sent before it died
 *   is stored before the restart.
 *
 * Not modelled: StartLimitBurst= (systemd's default, 5 starts in 10 s,
 * would stop the restarts of a service that crashes more often: the unit
 * must raise it for that), watchdogs, ExecStop=, cgroups (only the main
 * process is killed on stop), credentials other than the pid.
 *
 * The control socket DIR/fakesd.ctl (SOCK_SEQPACKET, one command a
 * connection, text): "status" -> "pid=P gen=G ready=R state=S stored=N
 * max=M refused=F exfull=X dups=D readys=Y"; "names" -> the stored names
 * in the order a start passes them, one a line; "get NAME" -> "ok" with a
 * dup of the first fd of that name (SCM_RIGHTS), or "err ..."; "max N" ->
 * "ok"; "stop" -> SIGTERM, reap (SIGKILL after --stop-ms), "stopped
 * STATUS", exit 0; "kill" -> SIGKILL, reap, "killed STATUS", exit 0.
 * fakesd's own log lines go to stderr, prefixed "fakesd:".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NOTIFY_BUFFER_MAX 4096 /* systemd: PIPE_BUF */
#define NOTIFY_FD_MAX 768      /* systemd: fds one notify datagram may carry */
#define FDNAME_MAX 255

typedef struct stored {
	int fd;
	bool poll;
	char name[FDNAME_MAX + 1];
} stored;

static struct {
	const char *dir;
	const char *sock_path;
	const char *sock_name;
	unsigned sock_mode;
	unsigned store_max;
	int restart_ms;
	int stop_ms;
	char **argv;

	int listen_fd, notify_fd, ctl_fd, sig_fd;
	char notify_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	char ctl_path[sizeof(((struct sockaddr_un *)0)->sun_path)];

	pid_t pid;          /* the main process, or -1 */
	unsigned gen;       /* starts so far */
	bool ready;         /* READY=1 came from this start's process */
	unsigned readys;    /* READY=1 messages in all */
	const char *state;  /* "starting", "running", "stopping", "auto-restart", "dead" */
	int64_t restart_at; /* ms, CLOCK_MONOTONIC; 0: none due */
	unsigned refused, exfull, dups;

	stored *store; /* in the order stored */
	size_t n, cap;
} g = {
	.sock_name = "bufbrokerd.socket",
	.sock_mode = 0666,
	.store_max = 65536,
	.restart_ms = 100,
	.stop_ms = 10000,
	.listen_fd = -1,
	.notify_fd = -1,
	.ctl_fd = -1,
	.sig_fd = -1,
	.pid = -1,
	.state = "dead",
};

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(line) - 2)
		n = (int)sizeof(line) - 2;
	line[n++] = '\n';
	/* One write, so that it does not interleave with the daemon's lines. */
	char out[1100];
	int m = snprintf(out, sizeof(out), "fakesd: %.*s", n, line);
	if (m > 0 && write(2, out, (size_t)m < sizeof(out) ? (size_t)m : sizeof(out) - 1) < 0)
		return;
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the store -------------------------------------------------------- */

/* systemd's fdname_is_valid: up to 255 printable ASCII characters, no ':'. */
static bool fdname_is_valid(const char *s, size_t len)
{
	if (len == 0 || len > FDNAME_MAX)
		return false;
	for (size_t i = 0; i < len; i++)
		if (s[i] < ' ' || s[i] > '~' || s[i] == ':')
			return false;
	return true;
}

/* systemd's same_fd: the same open file (kcmp), or when kcmp is not
 * allowed, the same inode with the same flags. */
static bool same_fd(int a, int b)
{
	struct stat sa, sb;
	pid_t self = getpid();
	long r = syscall(SYS_kcmp, self, self, KCMP_FILE, (unsigned long)a, (unsigned long)b);
	if (r >= 0)
		return r == 0;
	if (fstat(a, &sa) < 0 || fstat(b, &sb) < 0)
		return false;
	return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino &&
	       fcntl(a, F_GETFL) == fcntl(b, F_GETFL);
}

static bool pollable(int fd)
{
	struct stat st;
	/* epoll refuses regular files and directories (EPERM): systemd then
	 * does not watch the fd. memfds are regular files. */
	return fstat(fd, &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

/* Store fd under name; 0, or -EXFULL (fd closed). */
static int store_add(int fd, const char *name, bool do_poll)
{
	if (g.n >= g.store_max) {
		close(fd);
		return -EXFULL;
	}
	for (size_t i = 0; i < g.n; i++)
		if (same_fd(g.store[i].fd, fd)) {
			g.dups++;
			say("suppressing duplicate fd (%s) in fd store", name);
			close(fd);
			return 0;
		}
	if (g.n == g.cap) {
		size_t cap = g.cap ? g.cap * 2 : 64;
		stored *s = realloc(g.store, cap * sizeof(*s));
		if (!s) {
			close(fd);
			return -ENOMEM;
		}
		g.store = s;
		g.cap = cap;
	}
	stored *s = &g.store[g.n++];
	s->fd = fd;
	s->poll = do_poll && pollable(fd);
	snprintf(s->name, sizeof(s->name), "%s", name);
	return 0;
}

static void store_remove_at(size_t i)
{
	close(g.store[i].fd);
	memmove(&g.store[i], &g.store[i + 1], (g.n - i - 1) * sizeof(g.store[0]));
	g.n--;
}

static void store_remove(const char *name)
{
	for (size_t i = g.n; i-- > 0;)
		if (!strcmp(g.store[i].name, name))
			store_remove_at(i);
}

static void store_clear(void)
{
	while (g.n)
		store_remove_at(g.n - 1);
}

/* The i-th fd as a start passes them: newest first. */
static stored *pass_order(size_t i)
{
	return &g.store[g.n - 1 - i];
}

/* ---- notifications ---------------------------------------------------- */

static const char *tag_value(char *const *tags, size_t ntags, const char *prefix)
{
	size_t len = strlen(prefix);
	for (size_t i = 0; i < ntags; i++)
		if (!strncmp(tags[i], prefix, len))
			return tags[i] + len;
	return NULL;
}

static bool has_tag(char *const *tags, size_t ntags, const char *tag)
{
	for (size_t i = 0; i < ntags; i++)
		if (!strcmp(tags[i], tag))
			return true;
	return false;
}

static void close_all(const int *fds, size_t n)
{
	for (size_t i = 0; i < n; i++)
		close(fds[i]);
}

static void handle_notify(char *buf, size_t len, const struct ucred *cred, int *fds, size_t nfds)
{
	char *tags[128];
	size_t ntags = 0;

	if (!cred || cred->pid <= 0) {
		say("received notify message without valid credentials, ignoring");
		close_all(fds, nfds);
		return;
	}
	if (g.pid < 0 || cred->pid != g.pid) {
		g.refused++;
		say("got notification message from PID %d, but reception only permitted for main PID "
		    "%d",
		    (int)cred->pid, (int)g.pid);
		close_all(fds, nfds);
		return;
	}
	buf[len] = '\0';
	for (char *save = NULL, *t = strtok_r(buf, "\n", &save); t && ntags < 128;
	     t = strtok_r(NULL, "\n", &save))
		tags[ntags++] = t;

	if (has_tag(tags, ntags, "READY=1")) {
		g.ready = true;
		g.readys++;
		g.state = "running";
	}
	if (has_tag(tags, ntags, "STOPPING=1"))
		g.state = "stopping";

	const char *name = tag_value(tags, ntags, "FDNAME=");
	if (has_tag(tags, ntags, "FDSTORE=1")) {
		const char *use = name;
		if (name && !fdname_is_valid(name, strlen(name))) {
			say("passed FDNAME= name is invalid, ignoring");
			use = NULL;
		}
		bool do_poll = !has_tag(tags, ntags, "FDPOLL=0");
		size_t i = 0;
		for (; i < nfds; i++) {
			int r = store_add(fds[i], use ? use : "stored", do_poll);
			if (r == -EXFULL) {
				g.exfull++;
				say("cannot store more fds than FileDescriptorStoreMax=%u, closing "
				    "remaining",
				    g.store_max);
				i++;
				break;
			}
			if (r < 0) {
				say("failed to add fd to store: %s", strerror(-r));
				i++;
				break;
			}
		}
		close_all(fds + i, nfds - i);
	} else if (nfds) {
		say("got %zu fds with a notification without FDSTORE=1, closing them", nfds);
		close_all(fds, nfds);
	}
	if (has_tag(tags, ntags, "FDSTOREREMOVE=1")) {
		if (!name || !fdname_is_valid(name, strlen(name)))
			say("FDSTOREREMOVE=1 requested, but no valid name specified, ignoring");
		else
			store_remove(name);
	}
}

/* Read every queued notification. */
static void drain_notify(void)
{
	for (;;) {
		char buf[NOTIFY_BUFFER_MAX + 1];
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(struct ucred)) +
			       CMSG_SPACE(sizeof(int) * NOTIFY_FD_MAX)];
		} ctl;
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf) - 1};
		struct msghdr mh = {
			.msg_iov = &iov,
			.msg_iovlen = 1,
			.msg_control = ctl.b,
			.msg_controllen = sizeof(ctl.b),
		};
		ssize_t n = recvmsg(g.notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC | MSG_TRUNC);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return; /* EAGAIN: drained */
		}
		int fds[NOTIFY_FD_MAX];
		size_t nfds = 0;
		const struct ucred *cred = NULL;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
			if (c->cmsg_level != SOL_SOCKET)
				continue;
			if (c->cmsg_type == SCM_RIGHTS) {
				size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
				for (size_t j = 0; j < k && nfds < NOTIFY_FD_MAX; j++)
					memcpy(&fds[nfds++], CMSG_DATA(c) + j * sizeof(int),
					       sizeof(int));
			} else if (c->cmsg_type == SCM_CREDENTIALS &&
				   c->cmsg_len == CMSG_LEN(sizeof(struct ucred))) {
				cred = (const struct ucred *)(void *)CMSG_DATA(c);
			}
		}
		if ((mh.msg_flags & MSG_CTRUNC) || (size_t)n >= sizeof(buf)) {
			say("got notification message with truncated control data or payload, "
			    "ignoring");
			close_all(fds, nfds);
			continue;
		}
		handle_notify(buf, (size_t)n, cred, fds, nfds);
	}
}

/* ---- the service ------------------------------------------------------- */

static void start_service(void)
{
	size_t nfds = 1 + g.n;
	int *src = malloc(nfds * sizeof(int));
	size_t names_len = strlen(g.sock_name) + 1;
	for (size_t i = 0; i < g.n; i++)
		names_len += strlen(g.store[i].name) + 1;
	char *names = malloc(names_len);
	if (!src || !names) {
		say("out of memory starting the service");
		exit(1);
	}
	src[0] = g.listen_fd;
	strcpy(names, g.sock_name);
	for (size_t i = 0; i < g.n; i++) {
		src[1 + i] = pass_order(i)->fd;
		strcat(names, ":");
		strcat(names, pass_order(i)->name);
	}
	pid_t parent = getpid();
	pid_t pid = fork();
	if (pid < 0) {
		say("fork: %s", strerror(errno));
		exit(1);
	}
	if (pid == 0) {
		char num[32];
		sigset_t none;
		int top = 3 + (int)nfds;
		int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (null < 0 || dup2(null, 0) < 0)
			_exit(126);
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(125);
		/* Move every fd above where they go, then into place at 3...
		 * (dup2 leaves them without FD_CLOEXEC), then close the rest. */
		for (size_t i = 0; i < nfds; i++) {
			src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, top);
			if (src[i] < 0)
				_exit(124);
		}
		for (size_t i = 0; i < nfds; i++)
			if (dup2(src[i], 3 + (int)i) < 0)
				_exit(124);
		close_range((unsigned)top, ~0U, 0);
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		for (int s = 1; s < NSIG; s++)
			signal(s, SIG_DFL);
		snprintf(num, sizeof(num), "%d", (int)getpid());
		setenv("LISTEN_PID", num, 1);
		snprintf(num, sizeof(num), "%zu", nfds);
		setenv("LISTEN_FDS", num, 1);
		setenv("LISTEN_FDNAMES", names, 1);
		setenv("NOTIFY_SOCKET", g.notify_path, 1);
		snprintf(num, sizeof(num), "%u", g.store_max);
		setenv("FDSTORE", num, 1);
		execv(g.argv[0], g.argv);
		_exit(127);
	}
	free(src);
	free(names);
	g.pid = pid;
	g.gen++;
	g.ready = false;
	g.state = "starting";
	g.restart_at = 0;
	say("started %s as pid %d (start %u) with %zu stored fds", g.argv[0], (int)pid, g.gen, g.n);
}

/* systemd's clean exit for Restart=on-failure: status 0, or one of the
 * four signals of SuccessExitStatus's defaults. */
static bool clean_exit(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status) == 0;
	int s = WTERMSIG(status);
	return s == SIGHUP || s == SIGINT || s == SIGTERM || s == SIGPIPE;
}

static void main_exited(int status)
{
	if (WIFEXITED(status))
		say("main process %d exited, status=%d", (int)g.pid, WEXITSTATUS(status));
	else
		say("main process %d killed by signal %d", (int)g.pid, WTERMSIG(status));
	g.pid = -1;
	g.ready = false;
	if (clean_exit(status)) {
		g.state = "dead";
		say("service ended cleanly: releasing the fd store (%zu fds)", g.n);
		store_clear();
	} else {
		g.state = "auto-restart";
		g.restart_at = now_ms() + g.restart_ms;
	}
}

static void reap(void)
{
	/* Queued notifications first (see the top of this file). */
	drain_notify();
	for (;;) {
		int status;
		pid_t r = waitpid(-1, &status, WNOHANG);
		if (r <= 0)
			return;
		if (r == g.pid)
			main_exited(status);
	}
}

/* Signal the main process and reap it (SIGKILL after --stop-ms): its wait
 * status, or -1 when there is none. */
static int end_service(int sig)
{
	int status = -1;
	if (g.pid < 0)
		return -1;
	kill(g.pid, sig);
	int64_t deadline = now_ms() + g.stop_ms;
	for (;;) {
		pid_t r = waitpid(g.pid, &status, WNOHANG);
		if (r == g.pid)
			break;
		if (r < 0 && errno != EINTR) {
			status = -1;
			break;
		}
		if (now_ms() >= deadline) {
			say("main process %d did not exit within %d ms: SIGKILL", (int)g.pid,
			    g.stop_ms);
			kill(g.pid, SIGKILL);
			waitpid(g.pid, &status, 0);
			status = -1;
			break;
		}
		struct timespec ts = {.tv_nsec = 2000000};
		nanosleep(&ts, NULL);
	}
	g.pid = -1;
	return status;
}

static void finish(int code)
{
	store_clear();
	free(g.store);
	unlink(g.sock_path);
	unlink(g.notify_path);
	unlink(g.ctl_path);
	exit(code);
}

/* ---- control ------------------------------------------------------------ */

static void reply(int c, const char *text, int fd)
{
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = (void *)text, .iov_len = strlen(text)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	if (fd >= 0) {
		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.b;
		mh.msg_controllen = sizeof(ctl.b);
		struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	}
	if (sendmsg(c, &mh, MSG_NOSIGNAL) < 0)
		say("control reply: %s", strerror(errno));
}

static void handle_control(void)
{
	int c = accept4(g.ctl_fd, NULL, NULL, SOCK_CLOEXEC);
	if (c < 0)
		return;
	char cmd[512];
	struct pollfd p = {.fd = c, .events = POLLIN};
	ssize_t n = poll(&p, 1, 5000) == 1 ? recv(c, cmd, sizeof(cmd) - 1, 0) : -1;
	if (n <= 0) {
		close(c);
		return;
	}
	cmd[n] = '\0';
	/* Whatever the daemon sent is stored before the harness looks. */
	drain_notify();
	if (!strcmp(cmd, "status")) {
		char out[512];
		snprintf(out, sizeof(out),
			 "pid=%d gen=%u ready=%d state=%s stored=%zu max=%u refused=%u exfull=%u "
			 "dups=%u readys=%u",
			 (int)g.pid, g.gen, g.ready ? 1 : 0, g.state, g.n, g.store_max, g.refused,
			 g.exfull, g.dups, g.readys);
		reply(c, out, -1);
	} else if (!strcmp(cmd, "names")) {
		size_t len = 1;
		for (size_t i = 0; i < g.n; i++)
			len += strlen(g.store[i].name) + 1;
		char *out = malloc(len);
		if (out) {
			out[0] = '\0';
			for (size_t i = 0; i < g.n; i++) {
				strcat(out, pass_order(i)->name);
				strcat(out, "\n");
			}
			/* An empty datagram would read as end of stream. */
			reply(c, g.n ? out : "\n", -1);
			free(out);
		}
	} else if (!strncmp(cmd, "get ", 4)) {
		stored *s = NULL;
		for (size_t i = 0; i < g.n && !s; i++)
			if (!strcmp(pass_order(i)->name, cmd + 4))
				s = pass_order(i);
		if (s)
			reply(c, "ok", s->fd);
		else
			reply(c, "err no such name", -1);
	} else if (!strncmp(cmd, "max ", 4)) {
		g.store_max = (unsigned)strtoul(cmd + 4, NULL, 10);
		reply(c, "ok", -1);
	} else if (!strcmp(cmd, "stop") || !strcmp(cmd, "kill")) {
		bool stop = !strcmp(cmd, "stop");
		int status = end_service(stop ? SIGTERM : SIGKILL);
		char out[64];
		snprintf(out, sizeof(out), "%s %d", stop ? "stopped" : "killed", status);
		say("%s on request (wait status %d)", stop ? "stopped" : "killed", status);
		reply(c, out, -1);
		close(c);
		finish(0);
	} else {
		reply(c, "err unknown command", -1);
	}
	close(c);
}

/* ---- set-up -------------------------------------------------------------- */

static int bind_unix(int type, const char *path)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(a.sun_path)) {
		say("path too long: %s", path);
		exit(1);
	}
	strcpy(a.sun_path, path);
	int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		say("socket: %s", strerror(errno));
		exit(1);
	}
	unlink(path);
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
		say("bind %s: %s", path, strerror(errno));
		exit(1);
	}
	return fd;
}

static void usage(void)
{
	fprintf(stderr, "usage: fakesd --dir DIR --socket PATH [--socket-name NAME] "
			"[--socket-mode MODE] [--store-max N] [--restart-ms MS] [--stop-ms MS] "
			"-- PROGRAM ARGS...\n");
	exit(2);
}

int main(int argc, char **argv)
{
	int i = 1;
	for (; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--")) {
			i++;
			break;
		}
		if (i + 1 >= argc)
			usage();
		const char *v = argv[++i];
		if (!strcmp(a, "--dir"))
			g.dir = v;
		else if (!strcmp(a, "--socket"))
			g.sock_path = v;
		else if (!strcmp(a, "--socket-name"))
			g.sock_name = v;
		else if (!strcmp(a, "--socket-mode"))
			g.sock_mode = (unsigned)strtoul(v, NULL, 8);
		else if (!strcmp(a, "--store-max"))
			g.store_max = (unsigned)strtoul(v, NULL, 10);
		else if (!strcmp(a, "--restart-ms"))
			g.restart_ms = atoi(v);
		else if (!strcmp(a, "--stop-ms"))
			g.stop_ms = atoi(v);
		else
			usage();
	}
	if (!g.dir || !g.sock_path || i >= argc)
		usage();
	g.argv = argv + i;

	/* As PID 1: room for the whole store. */
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	signal(SIGPIPE, SIG_IGN);
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGTERM);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	g.sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);

	g.listen_fd = bind_unix(SOCK_SEQPACKET, g.sock_path);
	if (chmod(g.sock_path, g.sock_mode) < 0 || listen(g.listen_fd, SOMAXCONN) < 0) {
		say("listen %s: %s", g.sock_path, strerror(errno));
		exit(1);
	}
	snprintf(g.notify_path, sizeof(g.notify_path), "%s/notify", g.dir);
	g.notify_fd = bind_unix(SOCK_DGRAM, g.notify_path);
	int one = 1;
	setsockopt(g.notify_fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
	/* systemd makes its notify socket's receive buffer large (8 MiB). */
	int rcv = 8 << 20;
	setsockopt(g.notify_fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcv, sizeof(rcv));
	/* Anyone may send (the daemon may run as another uid). */
	chmod(g.notify_path, 0777);
	snprintf(g.ctl_path, sizeof(g.ctl_path), "%s/fakesd.ctl", g.dir);
	g.ctl_fd = bind_unix(SOCK_SEQPACKET, g.ctl_path);
	if (listen(g.ctl_fd, 16) < 0) {
		say("listen %s: %s", g.ctl_path, strerror(errno));
		exit(1);
	}

	start_service();
	for (;;) {
		struct pollfd *p = calloc(3 + g.n, sizeof(*p));
		size_t *which = calloc(3 + g.n, sizeof(*which));
		if (!p || !which) {
			say("out of memory");
			finish(1);
		}
		size_t np = 0;
		p[np++] = (struct pollfd){.fd = g.notify_fd, .events = POLLIN};
		p[np++] = (struct pollfd){.fd = g.ctl_fd, .events = POLLIN};
		p[np++] = (struct pollfd){.fd = g.sig_fd, .events = POLLIN};
		for (size_t k = 0; k < g.n; k++)
			if (g.store[k].poll) {
				which[np] = k;
				p[np++] = (struct pollfd){.fd = g.store[k].fd, .events = 0};
			}
		int timeout = -1;
		if (g.restart_at) {
			int64_t left = g.restart_at - now_ms();
			timeout = left > 0 ? (int)left : 0;
		}
		int r = poll(p, np, timeout);
		if (r < 0 && errno != EINTR) {
			say("poll: %s", strerror(errno));
			finish(1);
		}
		/* Stored fds that hung up (removed last first, so that the
		 * indexes of the others stay). */
		for (size_t k = np; k-- > 3;)
			if (p[k].revents & (POLLHUP | POLLERR)) {
				say("fd store entry %s hung up, removing", g.store[which[k]].name);
				store_remove_at(which[k]);
			}
		bool sig = p[2].revents & POLLIN;
		bool ctl = p[1].revents & POLLIN;
		free(p);
		free(which);
		drain_notify();
		if (sig) {
			struct signalfd_siginfo si;
			bool term = false;
			while (read(g.sig_fd, &si, sizeof(si)) == sizeof(si))
				term = term || si.ssi_signo == SIGTERM;
			reap();
			if (term) {
				end_service(SIGTERM);
				finish(0);
			}
		}
		if (ctl)
			handle_control();
		if (g.restart_at && now_ms() >= g.restart_at)
			start_service();
	}
}
