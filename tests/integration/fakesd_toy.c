/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A toy Type=notify service for test_fakesd: it talks to its manager with
 * libsystemd's own sd_pid_notify_with_fds, as bufbrokerd does, and to the
 * test over the SOCK_SEQPACKET socket named by $TOY_CTL ("@name": abstract).
 *
 * At start, before it opens anything, it reports what it was handed, one
 * datagram: "pid=P listen_pid=L listen_fds=N names=NAMES fdstore=M
 * notify=0|1 stray=S" then, per passed fd 3.. in order, " fd=K:TYPE:CLOEXEC"
 * where TYPE is "listen" (a listening SOCK_SEQPACKET socket), "memfd=TEXT"
 * (a memfd's first bytes), "pipe" or "other", CLOEXEC 0 or 1; stray: fds
 * open above the passed ones (there must be none).
 * Then it answers commands, one a datagram, with "ok" or "err ...":
 *   store NAME TEXT      FDSTORE=1, FDNAME=NAME, a memfd holding TEXT
 *   store2 NAME T1 T2    two memfds in one notification
 *   storedup NAME        one memfd stored twice (NAME, then NAME-again)
 *   pipe NAME            a pipe's read end, its write end then closed
 *   pipe0 NAME           the same with FDPOLL=0
 *   remove NAME          FDSTOREREMOVE=1, FDNAME=NAME
 *   ready | stopping     READY=1 | STOPPING=1
 *   other NAME TEXT      a forked child stores a memfd (not the main pid)
 *   diestore NAME TEXT   store, then SIGKILL itself at once (no answer)
 *   exit CODE            answer, then exit with CODE
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <fcntl.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

static void describe(int fd, char *out, size_t cap)
{
	struct stat st;
	int fl = fcntl(fd, F_GETFD);
	const char *type = "other";
	char text[80] = "";
	int listening = 0;
	socklen_t len = sizeof(listening);
	int stype = 0;
	socklen_t slen = sizeof(stype);

	if (fl < 0) {
		snprintf(out, cap, " fd=%d:closed:0", fd);
		return;
	}
	if (fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) &&
	    getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening &&
	    getsockopt(fd, SOL_SOCKET, SO_TYPE, &stype, &slen) == 0 && stype == SOCK_SEQPACKET) {
		type = "listen";
	} else if (S_ISFIFO(st.st_mode)) {
		type = "pipe";
	} else if (S_ISREG(st.st_mode)) {
		char buf[64];
		ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
		buf[n > 0 ? n : 0] = '\0';
		snprintf(text, sizeof(text), "memfd=%s", buf);
		type = text;
	}
	snprintf(out, cap, " fd=%d:%s:%d", fd, type, (fl & FD_CLOEXEC) ? 1 : 0);
}

static const char *env_or_dash(const char *name)
{
	const char *e = getenv(name);
	return e ? e : "-";
}

static char stray_what[256] = "-"; /* what a stray fd is (the last found) */

static void report(int ctl, int nfds, int stray)
{
	char msg[8192];
	int n = snprintf(
		msg, sizeof(msg),
		"pid=%d listen_pid=%s listen_fds=%s names=%s fdstore=%s notify=%d stray=%d "
		"straywhat=%s",
		(int)getpid(), env_or_dash("LISTEN_PID"), env_or_dash("LISTEN_FDS"),
		env_or_dash("LISTEN_FDNAMES"), env_or_dash("FDSTORE"),
		getenv("NOTIFY_SOCKET") ? 1 : 0, stray, stray_what);
	for (int i = 0; i < nfds && n < (int)sizeof(msg) - 100; i++)
		describe(3 + i, msg + n, sizeof(msg) - (size_t)n), n += (int)strlen(msg + n);
	send(ctl, msg, (size_t)n, MSG_NOSIGNAL);
}

static int memfd_with(const char *text)
{
	int fd = memfd_create("toy", MFD_CLOEXEC);
	if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		return -1;
	return fd;
}

static int store(const char *name, const char *extra, int *fds, unsigned n)
{
	char state[512];
	snprintf(state, sizeof(state), "FDSTORE=1\nFDNAME=%s%s", name, extra);
	int r = sd_pid_notify_with_fds(0, 0, state, fds, n);
	for (unsigned i = 0; i < n; i++)
		close(fds[i]);
	return r > 0 ? 0 : -1;
}

static int command(char *cmd)
{
	char *save = NULL;
	char *verb = strtok_r(cmd, " ", &save);
	char *a = strtok_r(NULL, " ", &save);
	char *b = strtok_r(NULL, " ", &save);
	char *c = strtok_r(NULL, " ", &save);
	int fds[2];

	if (!verb)
		return -1;
	if (!strcmp(verb, "store") && a && b) {
		fds[0] = memfd_with(b);
		return fds[0] < 0 ? -1 : store(a, "", fds, 1);
	}
	if (!strcmp(verb, "store2") && a && b && c) {
		fds[0] = memfd_with(b);
		fds[1] = memfd_with(c);
		return fds[0] < 0 || fds[1] < 0 ? -1 : store(a, "", fds, 2);
	}
	if (!strcmp(verb, "storedup") && a) {
		char again[300];
		int fd = memfd_with(a);
		fds[0] = dup(fd);
		snprintf(again, sizeof(again), "%s-again", a);
		if (fd < 0 || store(a, "", fds, 1) < 0)
			return -1;
		return store(again, "", &fd, 1);
	}
	if ((!strcmp(verb, "pipe") || !strcmp(verb, "pipe0")) && a) {
		int p[2];
		if (pipe2(p, O_CLOEXEC) < 0)
			return -1;
		int r = store(a, strcmp(verb, "pipe0") ? "" : "\nFDPOLL=0", &p[0], 1);
		close(p[1]);
		return r;
	}
	if (!strcmp(verb, "remove") && a) {
		char state[300];
		snprintf(state, sizeof(state), "FDSTOREREMOVE=1\nFDNAME=%s", a);
		return sd_notify(0, state) > 0 ? 0 : -1;
	}
	if (!strcmp(verb, "ready"))
		return sd_notify(0, "READY=1") > 0 ? 0 : -1;
	if (!strcmp(verb, "stopping"))
		return sd_notify(0, "STOPPING=1") > 0 ? 0 : -1;
	if (!strcmp(verb, "other") && a && b) {
		pid_t pid = fork();
		if (pid == 0) {
			fds[0] = memfd_with(b);
			_exit(fds[0] < 0 || store(a, "", fds, 1) < 0 ? 1 : 0);
		}
		int st;
		return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) &&
				       WEXITSTATUS(st) == 0
			       ? 0
			       : -1;
	}
	if (!strcmp(verb, "diestore") && a && b) {
		fds[0] = memfd_with(b);
		if (fds[0] < 0 || store(a, "", fds, 1) < 0)
			return -1;
		raise(SIGKILL);
	}
	return -1;
}

int main(void)
{
	/* What was handed over, before anything else is opened. */
	const char *e = getenv("LISTEN_FDS");
	int nfds = e ? atoi(e) : 0;
	int stray = 0;
	/* valgrind keeps its own fds at and above the soft limit it shows. */
	struct rlimit rl;
	long top = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (long)rl.rlim_cur : 1L << 30;
	DIR *dp = opendir("/proc/self/fd");
	if (dp) {
		int self = dirfd(dp);
		struct dirent *d;
		while ((d = readdir(dp))) {
			long fd = strtol(d->d_name, NULL, 10);
			if (d->d_name[0] != '.' && fd >= 3 + nfds && fd != self && fd < top) {
				char path[64];
				snprintf(path, sizeof(path), "/proc/self/fd/%ld", fd);
				ssize_t n = readlink(path, stray_what, sizeof(stray_what) - 1);
				stray_what[n > 0 ? n : 0] = '\0';
				/* Under valgrind (scripts/valgrind.sh), its log file
				 * of this process. */
				size_t len = strlen(stray_what);
				if (getenv("BBT_VALGRIND") && len > 4 &&
				    !strcmp(stray_what + len - 4, ".log"))
					continue;
				stray++;
			}
		}
		closedir(dp);
	}
	char line[4096];
	const char *path = getenv("TOY_CTL");
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	int ctl = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (!path || strlen(path) >= sizeof(a.sun_path) || ctl < 0)
		return 3;
	/* "@name": the abstract socket name. */
	size_t len = strlen(path);
	memcpy(a.sun_path, path, len);
	if (path[0] == '@')
		a.sun_path[0] = '\0';
	if (connect(ctl, (struct sockaddr *)&a,
		    (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) < 0)
		return 3;
	report(ctl, nfds, stray);
	for (;;) {
		ssize_t n = recv(ctl, line, sizeof(line) - 1, 0);
		if (n <= 0)
			return 0;
		line[n] = '\0';
		if (!strncmp(line, "exit ", 5)) {
			send(ctl, "ok", 2, MSG_NOSIGNAL);
			return atoi(line + 5);
		}
		const char *ans = command(line) == 0 ? "ok" : "err";
		send(ctl, ans, strlen(ans), MSG_NOSIGNAL);
	}
}
