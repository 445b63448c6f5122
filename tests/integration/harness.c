/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Integration-test harness: see harness.h.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "harness.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../bundle_peek.h"
#include "client_internal.h"
#include "msgio.h"
#include "wire.h"

#define BBT_MAX_DAEMONS 4
#define BBT_START_TIMEOUT_MS 5000
#define BBT_STOP_TIMEOUT_MS 10000 /* a sanitized daemon checks for leaks on exit */
#define BBT_RECV_CAP (BB_MAX_DATAGRAM + 4096)

static bbt_daemon g_daemons[BBT_MAX_DAEMONS];
static int g_ndaemons;

static int sd_end(bbt_daemon *d, const char *cmd);

/* ---- time --------------------------------------------------------------- */

int64_t bbt_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void bbt_sleep_ms(int ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

int bbt_slow(void)
{
	static int factor;
	if (!factor) {
		const char *env = getenv("BBT_SLOW");
		long f = env ? strtol(env, NULL, 10) : 1;
		factor = f >= 1 && f <= 1000 ? (int)f : 1;
	}
	return factor;
}

int bbt_ms(int ms)
{
	return ms <= 0 ? ms : ms * bbt_slow();
}

/* ---- the daemon ------------------------------------------------------- */

const char *bbt_cuda_handle(void)
{
	const char *h = getenv("BBT_CUDA_HANDLE");

	return h && h[0] ? h : NULL;
}

/* Waitpid without blocking for up to timeout_ms: the status, or -1. */
static int reap_within(pid_t pid, int timeout_ms, int *status)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		pid_t r = waitpid(pid, status, WNOHANG);
		if (r == pid)
			return 0;
		if (r < 0 && errno != EINTR)
			return -1;
		if (bbt_now_ms() >= deadline)
			return -1;
		bbt_sleep_ms(2);
	}
}

/* The daemon's command line into argv (room for BBT_MAX_ARGS + 8): its
 * number of arguments. */
static int daemon_argv(const bbt_daemon *d, const char **argv)
{
	const char *exe = getenv("BUFBROKERD");
	int argc = 0;

	cr_assert(exe && *exe, "BUFBROKERD is not set (ctest sets it to the built daemon)");
	argv[argc++] = exe;
	argv[argc++] = "--socket";
	argv[argc++] = d->sock;
	for (int i = 0; d->args[i]; i++)
		argv[argc++] = d->args[i];
	bool handle_given = false;
	for (int i = 0; d->args[i]; i++)
		handle_given = handle_given || strcmp(d->args[i], "--cuda-handle") == 0;
	if (bbt_cuda_handle() && !handle_given) {
		argv[argc++] = "--cuda-handle";
		argv[argc++] = bbt_cuda_handle();
	}
	argv[argc] = NULL;
	return argc;
}

/* In a forked child of parent: stdin /dev/null, stdout and stderr to d's
 * log, no other fd, dies with parent, default signals, none of systemd's
 * variables; exec argv. Never returns. */
static void exec_child(const bbt_daemon *d, pid_t parent, const char *const *argv)
{
	int log = open(d->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
	sigset_t all;
	if (log < 0 || null < 0)
		_exit(126);
	dup2(null, 0);
	dup2(log, 1);
	dup2(log, 2);
	close_range(3, ~0U, 0);
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(125);
	sigemptyset(&all);
	sigprocmask(SIG_SETMASK, &all, NULL);
	signal(SIGPIPE, SIG_DFL);
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDNAMES");
	unsetenv("NOTIFY_SOCKET");
	execv(argv[0], (char *const *)argv);
	_exit(127);
}

static pid_t spawn_daemon(bbt_daemon *d)
{
	const char *argv[BBT_MAX_ARGS + 8];
	pid_t parent = getpid();

	daemon_argv(d, argv);
	pid_t pid = fork();
	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0)
		exec_child(d, parent, argv);
	return pid;
}

static void wait_listening(bbt_daemon *d)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(BBT_START_TIMEOUT_MS);
	for (;;) {
		int status;
		pid_t r = waitpid(d->pid, &status, WNOHANG);
		if (r == d->pid) {
			d->pid = -1;
			bbt_dump_log(d);
			cr_assert_fail("bufbrokerd exited during start-up (status 0x%x)", status);
		}
		int s = bbt_raw_connect(d->sock);
		if (s >= 0) {
			close(s);
			return;
		}
		if (bbt_now_ms() >= deadline) {
			bbt_dump_log(d);
			cr_assert_fail("bufbrokerd did not accept on %s within %d ms", d->sock,
				       bbt_ms(BBT_START_TIMEOUT_MS));
		}
		bbt_sleep_ms(10);
	}
}

/* A new daemon slot with a fresh directory and these arguments. */
static bbt_daemon *new_daemon(const char *const *extra)
{
	cr_assert(g_ndaemons < BBT_MAX_DAEMONS, "too many daemons in one test");
	bbt_daemon *d = &g_daemons[g_ndaemons];
	memset(d, 0, sizeof(*d));
	d->pid = -1;
	char dir[] = "/tmp/bbt-XXXXXX";
	cr_assert(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
	g_ndaemons++;
	snprintf(d->dir, sizeof(d->dir), "%s", dir);
	snprintf(d->sock, sizeof(d->sock), "%s/bb.sock", dir);
	snprintf(d->log, sizeof(d->log), "%s/daemon.log", dir);
	int n = 0;
	for (; extra && extra[n]; n++) {
		cr_assert(n < BBT_MAX_ARGS - 1, "too many daemon arguments");
		d->args[n] = extra[n];
	}
	d->args[n] = NULL;
	return d;
}

bbt_daemon *bbt_start(const char *const *extra)
{
	bbt_daemon *d = new_daemon(extra);
	d->pid = spawn_daemon(d);
	wait_listening(d);
	return d;
}

void bbt_restart(bbt_daemon *d)
{
	cr_assert(!d->sd_pid, "bbt_restart: not for a daemon under the systemd stand-in");
	cr_assert(d->pid < 0, "bbt_restart: the daemon is still running");
	d->pid = spawn_daemon(d);
	wait_listening(d);
}

int bbt_stop(bbt_daemon *d)
{
	int status;
	if (d->sd_pid)
		return sd_end(d, "stop");
	if (d->pid < 0)
		return -1;
	kill(d->pid, SIGTERM);
	if (reap_within(d->pid, BBT_STOP_TIMEOUT_MS, &status) < 0) {
		kill(d->pid, SIGKILL);
		waitpid(d->pid, &status, 0);
		d->pid = -1;
		return -1;
	}
	d->pid = -1;
	return status;
}

void bbt_stop_clean(bbt_daemon *d)
{
	int status = bbt_stop(d);
	if (status == -1) {
		bbt_dump_log(d);
		cr_assert_fail("bufbrokerd did not exit within %d ms of SIGTERM",
			       bbt_ms(BBT_STOP_TIMEOUT_MS));
	}
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		bbt_dump_log(d);
		if (WIFSIGNALED(status))
			cr_assert_fail("bufbrokerd died of signal %d after SIGTERM (want exit 0)",
				       WTERMSIG(status));
		cr_assert_fail("bufbrokerd exited %d after SIGTERM (want 0)", WEXITSTATUS(status));
	}
}

void bbt_kill(bbt_daemon *d)
{
	int status;
	if (d->sd_pid) {
		sd_end(d, "kill");
		return;
	}
	if (d->pid < 0)
		return;
	kill(d->pid, SIGKILL);
	waitpid(d->pid, &status, 0);
	d->pid = -1;
}

void bbt_dump_log(const bbt_daemon *d)
{
	char buf[6144];
	int fd = open(d->log, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	off_t end = lseek(fd, 0, SEEK_END);
	off_t from = end > (off_t)sizeof(buf) - 1 ? end - (off_t)sizeof(buf) + 1 : 0;
	ssize_t n = pread(fd, buf, sizeof(buf) - 1, from);
	close(fd);
	if (n < 0)
		return;
	buf[n] = '\0';
	fprintf(stderr, "---- tail of %s ----\n%s\n---- end of daemon log ----\n", d->log, buf);
}

size_t bbt_log_size(const bbt_daemon *d)
{
	struct stat st;
	return stat(d->log, &st) == 0 ? (size_t)st.st_size : 0;
}

static bool log_has_line(const bbt_daemon *d, size_t from, const char *const *needles)
{
	FILE *f = fopen(d->log, "re");
	char *line = NULL;
	size_t cap = 0;
	bool found = false;

	if (!f)
		return false;
	if (fseeko(f, (off_t)from, SEEK_SET) == 0) {
		while (!found && getline(&line, &cap, f) >= 0) {
			found = true;
			for (int i = 0; needles[i]; i++)
				if (!strcasestr(line, needles[i]))
					found = false;
		}
	}
	free(line);
	fclose(f);
	return found;
}

bool bbt_log_wait_line(const bbt_daemon *d, size_t from, int timeout_ms, const char *const *needles)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		if (log_has_line(d, from, needles))
			return true;
		if (bbt_now_ms() >= deadline)
			return false;
		bbt_sleep_ms(10);
	}
}

/* The daemon's open memfds (from /proc/PID/fd): how many, and the bytes of
 * memory they hold (their st_blocks). -1 when /proc cannot be read. */
static int scan_memfds(const bbt_daemon *d, long long *bytes)
{
	char dir[64];
	int n = 0;
	*bytes = 0;
	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)d->pid);
	DIR *dp = opendir(dir);
	if (!dp)
		return -1;
	struct dirent *e;
	while ((e = readdir(dp))) {
		char path[384], target[256];
		struct stat st;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		ssize_t len = readlink(path, target, sizeof(target) - 1);
		if (len <= 0)
			continue;
		target[len] = '\0';
		if (strncmp(target, "/memfd:", 7) != 0)
			continue;
		n++;
		if (stat(path, &st) == 0)
			*bytes += (long long)st.st_blocks * 512;
	}
	closedir(dp);
	return n;
}

int bbt_daemon_memfds(const bbt_daemon *d)
{
	long long bytes;
	return scan_memfds(d, &bytes);
}

long long bbt_daemon_memfd_bytes(const bbt_daemon *d)
{
	long long bytes;
	return scan_memfds(d, &bytes) < 0 ? -1 : bytes;
}

int bbt_daemon_fds(const bbt_daemon *d)
{
	char dir[64];
	int n = 0;
	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)d->pid);
	DIR *dp = opendir(dir);
	if (!dp)
		return -1;
	struct dirent *e;
	while ((e = readdir(dp)))
		if (e->d_name[0] != '.')
			n++;
	closedir(dp);
	return n;
}

long bbt_daemon_rss_kb(const bbt_daemon *d)
{
	char path[64], line[256];
	long kb = -1;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)d->pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
			break;
	fclose(f);
	return kb;
}

long bbt_daemon_cpu_ms(const bbt_daemon *d)
{
	char path[64], buf[1024];
	unsigned long long utime, stime;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)d->pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	/* The command name may hold anything: count fields after its ')'.
	 * utime and stime are fields 14 and 15, the 12th and 13th after it. */
	const char *p = strrchr(buf, ')');
	if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
			 &stime) != 2)
		return -1;
	return (long)((utime + stime) * 1000 / (unsigned long long)sysconf(_SC_CLK_TCK));
}

long bbt_daemon_squeeze_fds(const bbt_daemon *d, int room)
{
	enum { MAX_FD = 1 << 16 };
	static unsigned char used[MAX_FD];
	char dir[64];
	struct rlimit rl;
	memset(used, 0, sizeof(used));
	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)d->pid);
	DIR *dp = opendir(dir);
	if (!dp || prlimit(d->pid, RLIMIT_NOFILE, NULL, &rl) < 0) {
		if (dp)
			closedir(dp);
		return -1;
	}
	struct dirent *e;
	while ((e = readdir(dp))) {
		long fd = strtol(e->d_name, NULL, 10);
		/* valgrind keeps its own fds at the top of the range: beyond. */
		if (e->d_name[0] != '.' && fd >= 0 && fd < MAX_FD)
			used[fd] = 1;
	}
	closedir(dp);
	/* The limit is the number of the first free fd past room free ones. */
	long limit = -1;
	for (long fd = 0, free_fds = 0; fd < MAX_FD; fd++) {
		if (used[fd])
			continue;
		if (free_fds++ == room) {
			limit = fd;
			break;
		}
	}
	if (limit < 0 || (rlim_t)limit > rl.rlim_cur)
		return -1;
	struct rlimit low = {.rlim_cur = (rlim_t)limit, .rlim_max = rl.rlim_max};
	if (prlimit(d->pid, RLIMIT_NOFILE, &low, NULL) < 0)
		return -1;
	return (long)rl.rlim_cur;
}

int bbt_daemon_set_nofile(const bbt_daemon *d, long soft)
{
	struct rlimit rl;
	if (prlimit(d->pid, RLIMIT_NOFILE, NULL, &rl) < 0)
		return -1;
	rl.rlim_cur = (rlim_t)soft;
	return prlimit(d->pid, RLIMIT_NOFILE, &rl, NULL);
}

/* ---- the daemon under the systemd stand-in (fakesd.c) -------------------- */

#define BBT_SD_CTL_TIMEOUT_MS 10000

/* One command to the stand-in (its control socket, one connection a
 * command): the answer's length (NUL-terminated in out), or -errno. When
 * fd_out is not NULL it gets the fd that came with the answer, or -1. */
static int sd_ctl(const bbt_daemon *d, const char *cmd, char *out, size_t cap, int *fd_out,
		  int timeout_ms)
{
	char path[192];
	snprintf(path, sizeof(path), "%s/fakesd.ctl", d->dir);
	if (fd_out)
		*fd_out = -1;
	int s = bbt_raw_connect(path);
	if (s < 0)
		return s;
	if (send(s, cmd, strlen(cmd), MSG_NOSIGNAL) < 0) {
		int e = -errno;
		close(s);
		return e;
	}
	struct pollfd p = {.fd = s, .events = POLLIN};
	if (poll(&p, 1, bbt_ms(timeout_ms)) != 1) {
		close(s);
		return -ETIMEDOUT;
	}
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = out, .iov_len = cap - 1};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.b,
			    .msg_controllen = sizeof(ctl.b)};
	ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
	int e = n < 0 ? -errno : 0;
	close(s);
	if (n <= 0)
		return n == 0 ? -ECONNRESET : e;
	out[n] = '\0';
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int fd;
			memcpy(&fd, CMSG_DATA(c), sizeof(fd));
			if (fd_out && *fd_out < 0)
				*fd_out = fd;
			else
				close(fd);
		}
	return (int)n;
}

int bbt_sd_status(const bbt_daemon *d, bbt_sd_state *st)
{
	char out[512];
	memset(st, 0, sizeof(*st));
	int n = sd_ctl(d, "status", out, sizeof(out), NULL, BBT_SD_CTL_TIMEOUT_MS);
	if (n < 0)
		return n;
	int pid = -1, ready = 0;
	if (sscanf(out,
		   "pid=%d gen=%u ready=%d state=%15s stored=%u max=%u refused=%u exfull=%u dups=%u "
		   "readys=%u",
		   &pid, &st->gen, &ready, st->state, &st->stored, &st->max, &st->refused,
		   &st->exfull, &st->dups, &st->readys) != 10)
		return -EBADMSG;
	st->pid = pid;
	st->ready = ready != 0;
	return 0;
}

/* Poll the stand-in until start gen >= want_gen has said READY=1 (true),
 * or fakesd died or the deadline passed (false); *st: the last status. */
static bool sd_until_ready(bbt_daemon *d, unsigned want_gen, int timeout_ms, bbt_sd_state *st)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		int status;
		if (waitpid(d->sd_pid, &status, WNOHANG) == d->sd_pid) {
			d->sd_pid = 0;
			d->pid = -1;
			return false;
		}
		if (bbt_sd_status(d, st) == 0 && st->gen >= want_gen && st->ready && st->pid > 0) {
			d->pid = st->pid;
			return true;
		}
		if (bbt_now_ms() >= deadline)
			return false;
		bbt_sleep_ms(5);
	}
}

/* Run argv as d's service under a new stand-in. */
static void sd_launch(bbt_daemon *d, const char *const *argv, bool wait_ready)
{
	const char *fakesd = getenv("BB_FAKESD");
	cr_assert(fakesd && *fakesd, "BB_FAKESD is not set (ctest sets it to the built stand-in)");
	char stop_ms[32];
	snprintf(stop_ms, sizeof(stop_ms), "%d", bbt_ms(BBT_STOP_TIMEOUT_MS));
	const char *args[BBT_MAX_ARGS + 24];
	int argc = 0;
	args[argc++] = fakesd;
	args[argc++] = "--dir";
	args[argc++] = d->dir;
	args[argc++] = "--socket";
	args[argc++] = d->sock;
	args[argc++] = "--stop-ms";
	args[argc++] = stop_ms;
	args[argc++] = "--";
	for (int i = 0; argv[i]; i++) {
		cr_assert(argc < BBT_MAX_ARGS + 23, "too many arguments");
		args[argc++] = argv[i];
	}
	args[argc] = NULL;

	pid_t parent = getpid();
	pid_t pid = fork();
	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0)
		exec_child(d, parent, args);
	d->sd_pid = pid;
	bbt_sd_state st;
	if (wait_ready) {
		if (!sd_until_ready(d, 1, BBT_START_TIMEOUT_MS, &st)) {
			bbt_dump_log(d);
			cr_assert_fail("the daemon under fakesd did not say READY=1 within %d ms",
				       bbt_ms(BBT_START_TIMEOUT_MS));
		}
	} else {
		int64_t deadline = bbt_now_ms() + bbt_ms(BBT_START_TIMEOUT_MS);
		while (bbt_sd_status(d, &st) != 0 || st.pid <= 0) {
			if (bbt_now_ms() >= deadline) {
				bbt_dump_log(d);
				cr_assert_fail("fakesd did not start its service within %d ms",
					       bbt_ms(BBT_START_TIMEOUT_MS));
			}
			bbt_sleep_ms(5);
		}
		d->pid = st.pid;
	}
}

bbt_daemon *bbt_sd_start_program(const char *const *argv, bool wait_ready)
{
	bbt_daemon *d = new_daemon(NULL);
	sd_launch(d, argv, wait_ready);
	return d;
}

bbt_daemon *bbt_start_sd(const char *const *extra)
{
	const char *args[BBT_MAX_ARGS];
	const char *argv[BBT_MAX_ARGS + 8];
	int n = 0;
	bool restart_given = false;
	for (; extra && extra[n]; n++) {
		cr_assert(n < BBT_MAX_ARGS - 2, "too many daemon arguments");
		args[n] = extra[n];
		restart_given = restart_given || strcmp(extra[n], "--restart") == 0;
	}
	if (!restart_given)
		args[n++] = "--restart";
	args[n] = NULL;
	bbt_daemon *d = new_daemon(args);
	/* --socket names the stand-in's socket, which the daemon is passed
	 * (LISTEN_FDS) and then does not bind itself. */
	daemon_argv(d, argv);
	sd_launch(d, argv, true);
	return d;
}

void bbt_sd_crash(bbt_daemon *d)
{
	bbt_sd_state st;
	cr_assert(d->sd_pid, "bbt_sd_crash: not a daemon under the systemd stand-in");
	int rc = bbt_sd_status(d, &st);
	cr_assert(rc == 0 && st.pid > 0, "bbt_sd_crash: no daemon running (%d, %s)", rc, st.state);
	cr_assert(kill(st.pid, SIGKILL) == 0, "kill %d: %s", (int)st.pid, strerror(errno));
	if (!sd_until_ready(d, st.gen + 1, BBT_SD_CTL_TIMEOUT_MS, &st)) {
		bbt_dump_log(d);
		cr_assert_fail("the daemon was not relaunched and READY within %d ms (state %s)",
			       bbt_ms(BBT_SD_CTL_TIMEOUT_MS), st.state);
	}
}

pid_t bbt_sd_pid(const bbt_daemon *d)
{
	bbt_sd_state st;
	return bbt_sd_status(d, &st) == 0 ? st.pid : -1;
}

int bbt_sd_store_count(const bbt_daemon *d)
{
	bbt_sd_state st;
	int rc = bbt_sd_status(d, &st);
	return rc < 0 ? rc : (int)st.stored;
}

int bbt_sd_store_names(const bbt_daemon *d, char ***names)
{
	/* Names are up to 255 bytes: room for the store's size in them. */
	size_t cap = (size_t)1 << 24;
	char *out = malloc(cap);
	cr_assert(out);
	*names = NULL;
	int n = sd_ctl(d, "names", out, cap, NULL, BBT_SD_CTL_TIMEOUT_MS);
	if (n < 0) {
		free(out);
		return n;
	}
	int count = 0;
	for (char *p = out; *p; p++)
		count += *p == '\n';
	char **v = calloc((size_t)count + 1, sizeof(*v));
	cr_assert(v);
	int i = 0;
	for (char *save = NULL, *t = strtok_r(out, "\n", &save); t && i < count;
	     t = strtok_r(NULL, "\n", &save))
		v[i++] = strdup(t);
	free(out);
	*names = v;
	return i;
}

void bbt_sd_names_free(char **names)
{
	for (int i = 0; names && names[i]; i++)
		free(names[i]);
	free(names);
}

int bbt_sd_store_fd(const bbt_daemon *d, const char *name)
{
	char cmd[300], out[64];
	int fd;
	snprintf(cmd, sizeof(cmd), "get %s", name);
	int n = sd_ctl(d, cmd, out, sizeof(out), &fd, BBT_SD_CTL_TIMEOUT_MS);
	if (n < 0)
		return n;
	if (strcmp(out, "ok") != 0 || fd < 0) {
		if (fd >= 0)
			close(fd);
		return -ENOENT;
	}
	return fd;
}

int bbt_sd_journal_fd(const bbt_daemon *d)
{
	char **names;
	int n = bbt_sd_store_names(d, &names);
	if (n < 0)
		return n;
	const char *newest = NULL;
	unsigned long best = 0;
	for (int i = 0; i < n; i++) {
		if (strncmp(names[i], "journal-", 8) != 0)
			continue;
		unsigned long g = strtoul(names[i] + 8, NULL, 10);
		if (!newest || g > best) {
			best = g;
			newest = names[i];
		}
	}
	int fd = newest ? bbt_sd_store_fd(d, newest) : -ENOENT;
	bbt_sd_names_free(names);
	return fd;
}

/* Append name to the NULL-terminated *v of *n names. */
static void names_add(char ***v, int *n, const char *name)
{
	char **p = realloc(*v, (size_t)(*n + 2) * sizeof(*p));
	cr_assert(p);
	p[*n] = strdup(name);
	p[++*n] = NULL;
	*v = p;
}

typedef struct names_vec {
	char **v;
	int n;
} names_vec;

static void names_vec_add(void *ctx, const char *name, ino_t ino)
{
	names_vec *nv = ctx;
	(void)ino;
	names_add(&nv->v, &nv->n, name);
}

int bbt_bundle_names(int fd, char ***names)
{
	names_vec nv = {calloc(1, sizeof(char *)), 0};
	cr_assert(nv.v);
	int n = bundle_peek(fd, names_vec_add, &nv);
	*names = nv.v;
	if (n < 0) {
		bbt_sd_names_free(nv.v);
		*names = NULL;
	}
	return n;
}

int bbt_sd_kept_names(const bbt_daemon *d, char ***names)
{
	char **stored, **held;
	int n = bbt_sd_store_names(d, &stored), count = 0, rc = 0;
	*names = NULL;
	if (n < 0)
		return n;
	*names = calloc(1, sizeof(**names));
	cr_assert(*names);
	for (int i = 0; i < n && rc >= 0; i++) {
		if (stored[i][0] != 'k' || stored[i][1] < '1' || stored[i][1] > '9') {
			names_add(names, &count, stored[i]);
			continue;
		}
		int fd = bbt_sd_store_fd(d, stored[i]);
		rc = fd < 0 ? fd : bbt_bundle_names(fd, &held);
		for (int j = 0; j < rc; j++)
			names_add(names, &count, held[j]);
		if (rc >= 0)
			bbt_sd_names_free(held);
		if (fd >= 0)
			close(fd);
	}
	bbt_sd_names_free(stored);
	if (rc < 0) {
		bbt_sd_names_free(*names);
		*names = NULL;
		return rc;
	}
	return count;
}

int bbt_sd_set_store_max(const bbt_daemon *d, unsigned max)
{
	char cmd[64], out[64];
	snprintf(cmd, sizeof(cmd), "max %u", max);
	int n = sd_ctl(d, cmd, out, sizeof(out), NULL, BBT_SD_CTL_TIMEOUT_MS);
	return n < 0 ? n : strcmp(out, "ok") == 0 ? 0 : -EINVAL;
}

/* "stop" (SIGTERM) or "kill" (SIGKILL) the service through the stand-in,
 * which then exits; reap it. The daemon's wait status, or -1. */
static int sd_end(bbt_daemon *d, const char *cmd)
{
	char out[64];
	int status = -1, sd_status;
	int n = sd_ctl(d, cmd, out, sizeof(out), NULL, BBT_STOP_TIMEOUT_MS + 2000);
	if (n < 0 || sscanf(out, "%*s %d", &status) != 1)
		status = -1;
	if (n < 0)
		kill(d->sd_pid, SIGKILL); /* the daemon dies with it (PDEATHSIG) */
	if (reap_within(d->sd_pid, BBT_STOP_TIMEOUT_MS, &sd_status) < 0) {
		kill(d->sd_pid, SIGKILL);
		waitpid(d->sd_pid, &sd_status, 0);
	}
	d->sd_pid = 0;
	d->pid = -1;
	return status;
}

static void remove_dir(const char *dir)
{
	DIR *dp = opendir(dir);
	if (dp) {
		struct dirent *e;
		while ((e = readdir(dp))) {
			char path[512];
			if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
				continue;
			snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
			if (unlink(path) < 0 && errno == EISDIR)
				remove_dir(path);
		}
		closedir(dp);
	}
	rmdir(dir);
}

void bbt_cleanup(void)
{
	for (int i = 0; i < g_ndaemons; i++) {
		bbt_kill(&g_daemons[i]);
		if (g_daemons[i].dir[0])
			remove_dir(g_daemons[i].dir);
	}
	g_ndaemons = 0;
}

void bbt_cleanup_fakecuda(bool used_fake)
{
	const char *fake = getenv("BB_FAKECUDA");
	void *lib;

	bbt_cleanup();
	if (!used_fake || !fake || !(lib = dlopen(fake, RTLD_NOW | RTLD_LOCAL)))
		return;
	void (*reset)(void) = (void (*)(void))dlsym(lib, "fakecuda_reset_namespace");
	if (reset)
		reset();
	dlclose(lib);
}

bb_client *bbt_connect(const bbt_daemon *d)
{
	bb_client *c = NULL;
	int rc = bb_connect(d->sock, &c);
	cr_assert(rc == 0, "bb_connect(%s): %d (%s)", d->sock, rc, bb_last_error());
	cr_assert(c);
	return c;
}

/* ---- children ----------------------------------------------------------- */

pid_t bbt_spawn(int (*fn)(void *arg), void *arg)
{
	fflush(NULL);
	pid_t pid = fork();
	cr_assert(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		_exit(fn(arg));
	}
	return pid;
}

/* What bbt_abandon keeps reachable (volatile: the stores must happen). */
static const void *volatile g_abandoned[16];
static int g_nabandoned;

void bbt_abandon(const void *p)
{
	if (g_nabandoned < 16)
		g_abandoned[g_nabandoned++] = p;
}

int bbt_join(pid_t pid, int timeout_ms)
{
	int status;
	if (reap_within(pid, timeout_ms, &status) < 0) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		return -1;
	}
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return -1;
}

void bbt_chan_open(bbt_chan *ch)
{
	cr_assert(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ch->fd) == 0, "socketpair: %s",
		  strerror(errno));
}

void bbt_chan_close(bbt_chan *ch)
{
	for (int i = 0; i < 2; i++) {
		if (ch->fd[i] >= 0)
			close(ch->fd[i]);
		ch->fd[i] = -1;
	}
}

int bbt_send(int fd, const void *p, size_t n)
{
	const char *b = p;
	while (n > 0) {
		ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		b += w;
		n -= (size_t)w;
	}
	return 0;
}

int bbt_recv(int fd, void *p, size_t n, int timeout_ms)
{
	char *b = p;
	int64_t deadline = timeout_ms < 0 ? 0 : bbt_now_ms() + bbt_ms(timeout_ms);
	while (n > 0) {
		struct pollfd pfd = {.fd = fd, .events = POLLIN};
		int wait = -1;
		if (timeout_ms >= 0) {
			int64_t left = deadline - bbt_now_ms();
			wait = left > 0 ? (int)left : 0;
		}
		int r = poll(&pfd, 1, wait);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		ssize_t got = recv(fd, b, n, 0);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			return -1;
		b += got;
		n -= (size_t)got;
	}
	return 0;
}

/* ---- daemon state through a client ------------------------------------- */

int bbt_stat_until_gone(bb_client *c, uint64_t id, int timeout_ms)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		bb_info info;
		int rc = bb_stat(c, id, &info);
		if (rc != 0 || bbt_now_ms() >= deadline)
			return rc;
		bbt_sleep_ms(10);
	}
}

int64_t bbt_refs(bb_client *c, uint64_t id)
{
	bb_info info;
	int rc = bb_stat(c, id, &info);
	return rc != 0 ? rc : (int64_t)info.refs;
}

int64_t bbt_refs_until(bb_client *c, uint64_t id, uint64_t want, int timeout_ms)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		int64_t refs = bbt_refs(c, id);
		if (refs == (int64_t)want || bbt_now_ms() >= deadline)
			return refs;
		bbt_sleep_ms(10);
	}
}

/* ServerStatus: 0 with *resp its answer (free with bbc_response_free), or
 * the bbc_call / Status error. */
int bbt_server_status(bb_client *c, Bufbroker__Response **out)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__ServerStatus ss = BUFBROKER__SERVER_STATUS__INIT;
	Bufbroker__Response *resp = NULL;

	req.op_case = BUFBROKER__REQUEST__OP_SERVER_STATUS;
	req.server_status = &ss;
	int rc = bbc_call(c, &req, -1, &resp, NULL);
	if (rc != 0)
		return rc;
	if (!resp->status || resp->status->code != 0)
		rc = resp->status ? resp->status->code : BB_ERR_PROTOCOL;
	else if (resp->result_case != BUFBROKER__RESPONSE__RESULT_SERVER_STATUS ||
		 !resp->server_status)
		rc = BB_ERR_PROTOCOL;
	if (rc != 0) {
		bbc_response_free(resp);
		return rc;
	}
	*out = resp;
	return 0;
}

int bbt_server_totals(bb_client *c, bbt_totals *out)
{
	Bufbroker__Response *resp = NULL;

	memset(out, 0, sizeof(*out));
	int rc = bbt_server_status(c, &resp);
	if (rc != 0)
		return rc;
	const Bufbroker__ServerStatusReply *s = resp->server_status;
	for (size_t i = 0; i < s->n_kinds; i++) {
		out->buffers += s->kinds[i]->buffers;
		out->bytes += s->kinds[i]->bytes;
		if (s->kinds[i]->kind == BUFBROKER__KIND__KIND_HOST)
			out->host_buffers += s->kinds[i]->buffers;
	}
	out->connections = s->connections;
	out->tokens = s->tokens;
	out->waits = s->waits;
	out->pid = s->pid;
	bbc_response_free(resp);
	return 0;
}

int bbt_server_restart(bb_client *c, bbt_restart_info *out)
{
	Bufbroker__Response *resp = NULL;

	memset(out, 0, sizeof(*out));
	int rc = bbt_server_status(c, &resp);
	if (rc != 0)
		return rc;
	const Bufbroker__ServerStatusReply *s = resp->server_status;
	out->restarts = s->restarts;
	out->restored_buffers = s->restored_buffers;
	out->absent_sessions = s->absent_sessions;
	out->journal_bytes = s->journal_bytes;
	out->restart_protected = s->restart_protected;
	out->unprotected_buffers = s->unprotected_buffers;
	bbc_response_free(resp);
	return 0;
}

int bbt_check_problems(bb_client *c)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Check op = BUFBROKER__CHECK__INIT;
	Bufbroker__Response *resp = NULL;

	req.op_case = BUFBROKER__REQUEST__OP_CHECK;
	req.check = &op;
	int rc = bbc_call(c, &req, -1, &resp, NULL);
	if (rc != 0)
		return rc;
	if (!resp->status || resp->status->code != 0) {
		rc = resp->status ? resp->status->code : BB_ERR_PROTOCOL;
	} else if (resp->result_case != BUFBROKER__RESPONSE__RESULT_CHECK || !resp->check) {
		rc = BB_ERR_PROTOCOL;
	} else {
		rc = (int)resp->check->problems;
		for (size_t i = 0; i < resp->check->n_report; i++)
			fprintf(stderr, "check: %s\n", resp->check->report[i]);
	}
	bbc_response_free(resp);
	return rc;
}

bool bbt_waits_until(bb_client *c, uint64_t want, int timeout_ms, uint64_t *last)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	bbt_totals t;
	for (;;) {
		int rc = bbt_server_totals(c, &t);
		if (last)
			*last = rc == 0 ? t.waits : UINT64_MAX;
		if (rc == 0 && t.waits == want)
			return true;
		if (bbt_now_ms() >= deadline)
			return false;
		bbt_sleep_ms(5);
	}
}

bool bbt_totals_until_idle(bb_client *c, uint32_t conns, int timeout_ms, bbt_totals *last)
{
	int64_t deadline = bbt_now_ms() + bbt_ms(timeout_ms);
	for (;;) {
		int rc = bbt_server_totals(c, last);
		if (rc == 0 && last->buffers == 0 && last->bytes == 0 && last->tokens == 0 &&
		    last->waits == 0 && last->connections == conns)
			return true;
		if (bbt_now_ms() >= deadline)
			return false;
		bbt_sleep_ms(10);
	}
}

/* ---- the metrics endpoint ------------------------------------------------ */

int bbt_metrics_port(const bbt_daemon *d)
{
	static const char key[] = "event=metrics_listening address=127.0.0.1:";
	const char *const needles[] = {key, NULL};
	char line[512];
	int port = 0;

	cr_assert(bbt_log_wait_line(d, 0, 5000, needles), "no metrics_listening line in the log");
	FILE *f = fopen(d->log, "r");
	cr_assert_not_null(f, "%s: %s", d->log, strerror(errno));
	while (fgets(line, sizeof(line), f))
		if (strstr(line, key))
			port = atoi(strstr(line, key) + strlen(key));
	fclose(f);
	cr_assert(port > 0 && port < 65536, "no port in the metrics_listening line");
	return port;
}

long long bbt_pooled_memfds(int port)
{
	static const char get[] = "GET /metrics HTTP/1.0\r\n\r\n",
			  name[] = "\nbufbroker_host_pooled_memfds ";
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	size_t len = 0, cap = 1 << 16;
	char *text = malloc(cap + 1);
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);

	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	cr_assert(text && s >= 0, "socket: %s", strerror(errno));
	cr_assert_eq(connect(s, (struct sockaddr *)&a, sizeof(a)), 0, "connect to port %d: %s",
		     port, strerror(errno));
	cr_assert_eq(send(s, get, strlen(get), MSG_NOSIGNAL), (ssize_t)strlen(get));
	for (;;) {
		struct pollfd p = {.fd = s, .events = POLLIN};
		cr_assert_eq(poll(&p, 1, bbt_ms(5000)), 1, "the metrics endpoint did not answer");
		if (len == cap) {
			cap *= 2;
			text = realloc(text, cap + 1);
			cr_assert_not_null(text);
		}
		ssize_t n = recv(s, text + len, cap - len, 0);
		cr_assert_geq(n, 0, "reading /metrics: %s", strerror(errno));
		if (n == 0)
			break;
		len += (size_t)n;
	}
	close(s);
	text[len] = '\0';
	const char *at = strstr(text, name);
	cr_assert_not_null(at, "no bufbroker_host_pooled_memfds in /metrics");
	long long pooled = strtoll(at + strlen(name), NULL, 10);
	free(text);
	return pooled;
}

/* ---- raw protocol peer ---------------------------------------------------- */

int bbt_raw_connect(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -errno;
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = errno;
		close(s);
		return -e;
	}
	return s;
}

int bbt_raw_send_bytes(int sock, const void *buf, size_t len, int attach_fd)
{
	ssize_t n = msgio_send(sock, buf, len, attach_fd);
	if (n < 0)
		return (int)n;
	return (size_t)n == len ? 0 : -EMSGSIZE;
}

uint8_t *bbt_pack_request(const Bufbroker__Request *req, size_t *len)
{
	*len = bufbroker__request__get_packed_size(req);
	uint8_t *buf = malloc(*len ? *len : 1);
	if (buf)
		bufbroker__request__pack(req, buf);
	return buf;
}

Bufbroker__Response *bbt_unpack_response(const void *buf, size_t len)
{
	return bufbroker__response__unpack(NULL, len, buf);
}

Bufbroker__Request *bbt_unpack_request(const void *buf, size_t len)
{
	return bufbroker__request__unpack(NULL, len, buf);
}

int bbt_raw_send(int sock, const Bufbroker__Request *req, int attach_fd)
{
	size_t len;
	uint8_t *buf = bbt_pack_request(req, &len);
	if (!buf)
		return -ENOMEM;
	int rc = bbt_raw_send_bytes(sock, buf, len, attach_fd);
	free(buf);
	return rc;
}

int bbt_raw_wait(int sock, uint64_t req_id, uint64_t id, int32_t timeout_ms)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Wait w = BUFBROKER__WAIT__INIT;
	w.id = id;
	w.timeout_ms = timeout_ms;
	req.id = req_id;
	req.op_case = BUFBROKER__REQUEST__OP_WAIT;
	req.wait = &w;
	return bbt_raw_send(sock, &req, -1);
}

int bbt_raw_stat(int sock, uint64_t req_id, uint64_t id)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Stat st = BUFBROKER__STAT__INIT;
	st.target_case = BUFBROKER__STAT__TARGET_ID;
	st.id = id;
	req.id = req_id;
	req.op_case = BUFBROKER__REQUEST__OP_STAT;
	req.stat = &st;
	return bbt_raw_send(sock, &req, -1);
}

int bbt_raw_recv(int sock, int timeout_ms, Bufbroker__Response **out, int *fd_in)
{
	struct pollfd pfd = {.fd = sock, .events = POLLIN};
	int fd = -1, trunc = 0, rc;

	*out = NULL;
	if (fd_in)
		*fd_in = -1;
	do
		rc = poll(&pfd, 1, timeout_ms);
	while (rc < 0 && errno == EINTR);
	if (rc < 0)
		return -errno;
	if (rc == 0)
		return -ETIMEDOUT;
	uint8_t *buf = malloc(BBT_RECV_CAP);
	if (!buf)
		return -ENOMEM;
	ssize_t n = msgio_recv(sock, buf, BBT_RECV_CAP, &fd, &trunc);
	if (n <= 0) {
		free(buf);
		if (fd >= 0)
			close(fd);
		return n == 0 ? 0 : (int)n;
	}
	*out = trunc ? NULL : bbt_unpack_response(buf, (size_t)n);
	free(buf);
	if (!*out) {
		if (fd >= 0)
			close(fd);
		return -EBADMSG;
	}
	if (fd_in)
		*fd_in = fd;
	else if (fd >= 0)
		close(fd);
	return 1;
}

int bbt_raw_hello(int sock, uint64_t req_id, uint32_t major)
{
	Bufbroker__Request req = BUFBROKER__REQUEST__INIT;
	Bufbroker__Hello hello = BUFBROKER__HELLO__INIT;
	Bufbroker__Response *resp;

	hello.version_major = major;
	hello.version_minor = 0;
	hello.client_name = "bbt-raw";
	req.id = req_id;
	req.op_case = BUFBROKER__REQUEST__OP_HELLO;
	req.hello = &hello;
	if (bbt_raw_send(sock, &req, -1) < 0)
		return BB_ERR_DISCONNECTED;
	if (bbt_raw_recv(sock, 3000, &resp, NULL) != 1)
		return BB_ERR_DISCONNECTED;
	int code = resp->id != req_id ? BB_ERR_PROTOCOL
		   : resp->status     ? resp->status->code
				      : BB_ERR_PROTOCOL;
	bufbroker__response__free_unpacked(resp, NULL);
	return code;
}

bool bbt_raw_closed(int sock, int timeout_ms)
{
	int64_t deadline = bbt_now_ms() + timeout_ms;
	for (;;) {
		Bufbroker__Response *resp;
		int64_t left = deadline - bbt_now_ms();
		int rc = bbt_raw_recv(sock, left > 0 ? (int)left : 0, &resp, NULL);
		if (rc == 0 || rc == -ECONNRESET)
			return true;
		if (rc == 1) {
			/* A stray response before the close: keep reading. */
			bufbroker__response__free_unpacked(resp, NULL);
			continue;
		}
		if (rc != -EBADMSG)
			return false;
	}
}

/* ---- small things --------------------------------------------------------- */

static uint8_t pattern_byte(size_t i, uint32_t seed)
{
	uint32_t x = (uint32_t)i * 2654435761u ^ seed * 40503u;
	return (uint8_t)(x >> 13 ^ x);
}

void bbt_fill(void *p, size_t n, uint32_t seed)
{
	uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		b[i] = pattern_byte(i, seed);
}

bool bbt_check(const void *p, size_t n, uint32_t seed)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		if (b[i] != pattern_byte(i, seed))
			return false;
	return true;
}
