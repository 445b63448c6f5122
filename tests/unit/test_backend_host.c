/*
 * The host backend's guards: what import_fd accepts (checked again on the
 * daemon's own sealed duplicate, with a peer that changes the file while
 * the backend seals it), and the memfd reuse pool: what it reuses, what it
 * never reuses, that reused memory reads zeros, that it stays within its
 * bounds and that destroy leaves no fd behind. Unit tests link only the
 * broker core, so this file includes the backend itself.
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

/* The backend's fcntl goes through raced_fcntl, which lets a test play the
 * peer that sent the memfd and still holds it: racer runs (once) on the
 * peer's fd just before the backend's F_ADD_SEALS lands, the moment the
 * daemon's first checks are done and the seals not yet there. */
static int raced_fcntl(int fd, int cmd, ...);
#define fcntl raced_fcntl
#include "../../daemon/backend_host.c"
#undef fcntl

static void (*racer)(int fd); /* NULL: no race */
static int racer_fd = -1;     /* the peer's fd racer acts on */

static int raced_fcntl(int fd, int cmd, ...)
{
	if (cmd == F_GET_SEALS || cmd == F_GETFL)
		return fcntl(fd, cmd);
	va_list ap;
	va_start(ap, cmd);
	int arg = va_arg(ap, int); /* the backend's other commands take an int */
	va_end(ap);
	if (cmd == F_ADD_SEALS && racer) {
		void (*r)(int) = racer;
		racer = NULL;
		r(racer_fd);
	}
	return fcntl(fd, cmd, arg);
}

#define UID_A 1000
#define UID_B 1001
#define PAGE ((uint64_t)sysconf(_SC_PAGESIZE))

static backend *be;
static int fds0;
static char err[256];

static int open_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	cr_assert(d, "cannot read /proc/self/fd");
	int n = 0;
	while (readdir(d))
		n++;
	closedir(d);
	return n;
}

static void setup(void)
{
	fds0 = open_fds();
	be = backend_host_new();
	cr_assert(be);
	cr_assert_eq(backend_host_pool(be, 8, 4), 0);
}

/* A test that stopped early still frees the backend (an assertion here
 * would only be printed: Criterion does not fail a test from .fini). */
static void teardown(void)
{
	if (be)
		be->destroy(be);
}

/* Every test ends here: the backend destroyed and no fd left over. */
static void finish(void)
{
	be->destroy(be);
	be = NULL;
	cr_assert_eq(open_fds(), fds0, "fds left open after destroy");
}

TestSuite(host_pool, .init = setup, .fini = teardown);

static backend_mem alloc_mem(uint32_t uid, uint64_t size)
{
	backend_mem m;
	memset(&m, 0, sizeof(m));
	int rc = be->alloc(be, size, 0, uid, BB_SHARE_UID, &(int){BB_CUDA_HANDLE_DEFAULT}, &m, err,
			   sizeof(err));
	cr_assert_eq(rc, 0, "alloc of %llu bytes: %s", (unsigned long long)size, err);
	cr_assert_geq(m.fd, 0);
	cr_assert_eq(m.size, size, "the buffer's size is what was asked for");
	return m;
}

/* The file behind fd: reuse means the same inode. */
static ino_t inode_of(int fd)
{
	struct stat st;
	cr_assert_eq(fstat(fd, &st), 0);
	return st.st_ino;
}

static backend_host_pool_stats stats(void)
{
	backend_host_pool_stats s;
	backend_host_pool_info(be, &s);
	return s;
}

/* Alloc, note the inode, free: the inode of a memfd now pooled. */
static ino_t alloc_free(uint32_t uid, uint64_t size)
{
	backend_mem m = alloc_mem(uid, size);
	ino_t ino = inode_of(m.fd);
	be->free(be, &m);
	cr_assert_eq(m.fd, -1);
	return ino;
}

Test(host_pool, freed_memfd_is_reused_for_the_same_uid_and_size)
{
	ino_t ino = alloc_free(UID_A, 3 * PAGE);
	cr_assert_eq(stats().pooled, 1);
	backend_mem m = alloc_mem(UID_A, 3 * PAGE);
	cr_assert_eq(inode_of(m.fd), ino, "the pooled memfd was not reused");
	cr_assert_eq(stats().reused, 1);
	cr_assert_eq(stats().created, 1);
	cr_assert_eq(stats().pooled, 0);
	be->free(be, &m);
	finish();
}

Test(host_pool, size_class_is_the_page_rounded_size)
{
	ino_t ino = alloc_free(UID_A, 100);
	backend_mem m = alloc_mem(UID_A, PAGE - 1);
	cr_assert_eq(inode_of(m.fd), ino, "sizes within one page share a class");
	struct stat st;
	cr_assert_eq(fstat(m.fd, &st), 0);
	cr_assert_eq((uint64_t)st.st_size, PAGE, "the memfd holds whole pages");
	cr_assert_eq(m.size, PAGE - 1);
	be->free(be, &m);

	m = alloc_mem(UID_A, PAGE + 1);
	cr_assert_neq(inode_of(m.fd), ino, "a size of another page count reused the memfd");
	be->free(be, &m);
	finish();
}

Test(host_pool, memfd_is_never_reused_for_another_uid)
{
	ino_t ino = alloc_free(UID_A, PAGE);
	backend_mem m = alloc_mem(UID_B, PAGE);
	cr_assert_neq(inode_of(m.fd), ino, "uid B got uid A's memfd");
	cr_assert_eq(stats().reused, 0);
	be->free(be, &m);
	cr_assert_eq(stats().pooled, 2, "both stay pooled, each for its own uid");
	finish();
}

Test(host_pool, exposed_memfd_is_closed_on_free)
{
	backend_mem m = alloc_mem(UID_A, PAGE);
	ino_t ino = inode_of(m.fd);
	backend_host_exposed(be, m.fd);
	be->free(be, &m);
	cr_assert_eq(stats().pooled, 0, "an exposed memfd was pooled");
	cr_assert_eq(stats().closed, 1);
	cr_assert_eq(open_fds(), fds0, "the exposed memfd is still open");

	m = alloc_mem(UID_A, PAGE);
	cr_assert_neq(inode_of(m.fd), ino);
	be->free(be, &m);
	cr_assert_eq(stats().pooled, 1, "exposure is forgotten with its memfd");
	finish();
}

Test(host_pool, exposing_an_unknown_fd_changes_nothing)
{
	backend_host_exposed(be, -1);
	backend_host_exposed(be, 1 << 20);
	alloc_free(UID_A, PAGE);
	cr_assert_eq(stats().pooled, 1);
	finish();
}

Test(host_pool, imported_memfd_is_never_pooled)
{
	int fd = memfd_create("test-import", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	cr_assert_geq(fd, 0);
	cr_assert_eq(ftruncate(fd, (off_t)PAGE), 0);
	backend_mem m;
	memset(&m, 0, sizeof(m));
	cr_assert_eq(be->import_fd(be, fd, PAGE, &m, err, sizeof(err)), 0, "%s", err);
	be->free(be, &m);
	cr_assert_eq(stats().pooled, 0, "an imported memfd was pooled");
	cr_assert_eq(stats().closed, 1);

	backend_mem n = alloc_mem(0, PAGE);
	cr_assert_neq(inode_of(n.fd), inode_of(fd), "the importer's file was handed out");
	be->free(be, &n);
	close(fd);
	finish();
}

Test(host_pool, reused_memfd_reads_zeros_after_the_previous_user_wrote)
{
	const size_t size = 4 * PAGE;
	backend_mem m = alloc_mem(UID_A, size);
	ino_t ino = inode_of(m.fd);
	/* A stale holder: a mapping that outlives the buffer. */
	unsigned char *old = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
	cr_assert(old != MAP_FAILED);
	int held = dup(m.fd);
	memset(old, 0xab, size);
	struct stat st;
	cr_assert_eq(fstat(held, &st), 0);
	cr_assert_gt(st.st_blocks, 0);

	be->free(be, &m);
	cr_assert_eq(fstat(held, &st), 0);
	cr_assert_eq(st.st_blocks, 0, "the freed buffer's pages were not returned");
	cr_assert_eq(old[0], 0, "the free did not punch the pages out of mappings");
	memset(old, 0xcd, size); /* written after the free */

	backend_mem n = alloc_mem(UID_A, size);
	cr_assert_eq(inode_of(n.fd), ino, "the memfd was not reused");
	const unsigned char *p = mmap(NULL, size, PROT_READ, MAP_SHARED, n.fd, 0);
	cr_assert(p != MAP_FAILED);
	for (size_t i = 0; i < size; i++)
		cr_assert_eq(p[i], 0, "byte %zu of the reused buffer is %#x", i, p[i]);
	munmap((void *)p, size);
	munmap(old, size);
	close(held);
	be->free(be, &n);
	finish();
}

Test(host_pool, bound_per_class_closes_the_oldest_of_the_class)
{
	backend_mem m[5];
	ino_t ino[5];
	for (int i = 0; i < 5; i++) {
		m[i] = alloc_mem(UID_A, PAGE);
		ino[i] = inode_of(m[i].fd);
	}
	for (int i = 0; i < 5; i++)
		be->free(be, &m[i]);
	cr_assert_eq(stats().pooled, 4, "the per-class bound is 4");
	cr_assert_eq(stats().evicted, 1);
	/* Newest first; the oldest (0) was closed. */
	for (int i = 4; i >= 1; i--) {
		m[i] = alloc_mem(UID_A, PAGE);
		cr_assert_eq(inode_of(m[i].fd), ino[i], "reuse %d", i);
	}
	m[0] = alloc_mem(UID_A, PAGE);
	cr_assert_neq(inode_of(m[0].fd), ino[0], "the evicted memfd came back");
	for (int i = 0; i < 5; i++)
		be->free(be, &m[i]);
	finish();
}

Test(host_pool, bound_in_all_closes_the_oldest)
{
	backend_mem m[10];
	ino_t ino[10];
	/* Five classes of two: ten memfds for a pool of eight. */
	for (int i = 0; i < 10; i++) {
		m[i] = alloc_mem(UID_A, (uint64_t)(i / 2 + 1) * PAGE);
		ino[i] = inode_of(m[i].fd);
	}
	for (int i = 0; i < 10; i++)
		be->free(be, &m[i]);
	cr_assert_eq(stats().pooled, 8);
	cr_assert_eq(stats().evicted, 2);
	/* The first class went first. */
	backend_mem n = alloc_mem(UID_A, PAGE);
	cr_assert_neq(inode_of(n.fd), ino[0]);
	cr_assert_neq(inode_of(n.fd), ino[1]);
	be->free(be, &n);
	n = alloc_mem(UID_A, 2 * PAGE);
	cr_assert_eq(inode_of(n.fd), ino[3]);
	be->free(be, &n);
	finish();
}

Test(host_pool, destroy_closes_every_pooled_memfd)
{
	backend_mem m[6];
	for (int i = 0; i < 6; i++)
		m[i] = alloc_mem(i % 2 ? UID_A : UID_B, (uint64_t)(i + 1) * PAGE);
	for (int i = 0; i < 6; i++)
		be->free(be, &m[i]);
	cr_assert_eq(stats().pooled, 6);
	cr_assert_eq(open_fds(), fds0 + 6);
	finish();
}

Test(host_pool, usage_counts_live_memories_only)
{
	uint64_t buffers, bytes;
	backend_mem a = alloc_mem(UID_A, 100);
	backend_mem b = alloc_mem(UID_A, PAGE);
	be->usage(be, &buffers, &bytes);
	cr_assert_eq(buffers, 2);
	cr_assert_eq(bytes, 100 + PAGE, "sizes as asked for, not page-rounded");
	be->free(be, &a);
	be->usage(be, &buffers, &bytes);
	cr_assert_eq(stats().pooled, 1);
	cr_assert_eq(buffers, 1, "a pooled memfd counted as live");
	cr_assert_eq(bytes, PAGE);
	be->free(be, &b);
	be->usage(be, &buffers, &bytes);
	cr_assert_eq(buffers, 0);
	cr_assert_eq(bytes, 0);
	finish();
}

Test(host_pool, pooling_is_off_until_asked_for)
{
	be->destroy(be);
	be = backend_host_new();
	alloc_free(UID_A, PAGE);
	cr_assert_eq(stats().pooled, 0);
	cr_assert_eq(open_fds(), fds0, "a memfd stayed open with pooling off");
	finish();
}

Test(host_pool, turning_pooling_off_closes_the_pool)
{
	alloc_free(UID_A, PAGE);
	alloc_free(UID_A, 2 * PAGE);
	cr_assert_eq(backend_host_pool(be, 0, 0), 0);
	cr_assert_eq(stats().pooled, 0);
	cr_assert_eq(open_fds(), fds0);
	alloc_free(UID_A, PAGE);
	cr_assert_eq(stats().pooled, 0, "pooled with pooling off");
	finish();
}

Test(host_pool, alloc_out_of_fds_closes_the_pool_and_succeeds)
{
	backend_mem m[4];
	int top = 0;
	for (int i = 0; i < 4; i++) {
		m[i] = alloc_mem(UID_A, (uint64_t)(i + 1) * PAGE);
		if (m[i].fd > top)
			top = m[i].fd;
	}
	for (int i = 0; i < 4; i++)
		be->free(be, &m[i]);
	/* No fd number left: only closing pooled memfds makes room. */
	struct rlimit old, tight;
	cr_assert_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
	tight = old;
	tight.rlim_cur = (rlim_t)top + 1;
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &tight), 0);
	int fill[64], nfill = 0;
	while (nfill < 64 && (fill[nfill] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
		nfill++;
	cr_assert_eq(errno, EMFILE);

	backend_mem n = alloc_mem(UID_B, PAGE);
	cr_assert_eq(stats().pooled, 0, "the pool was not closed to make room");
	be->free(be, &n);
	while (nfill > 0)
		close(fill[--nfill]);
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
	finish();
}

/* ---- import_fd: what it accepts, checked on what it hands out ------------------ */

TestSuite(host_import, .init = setup, .fini = teardown);

/* The peer's memfd: one that allows sealing, bytes long. */
static int peer_memfd(uint64_t bytes)
{
	int fd = memfd_create("test-import", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	cr_assert_geq(fd, 0, "memfd_create: %s", strerror(errno));
	cr_assert_eq(ftruncate(fd, (off_t)bytes), 0, "ftruncate: %s", strerror(errno));
	return fd;
}

/* Import fd as a buffer of size bytes: the backend's code, *out on success. */
static int import(int fd, uint64_t size, backend_mem *out)
{
	memset(out, 0, sizeof(*out));
	out->fd = -1;
	err[0] = '\0';
	return be->import_fd(be, fd, size, out, err, sizeof(err));
}

/* rc refused an import with BB_ERR_INVALID and a sentence that says want,
 * and the backend holds nothing for it. */
static void assert_refused(int rc, const char *want, const char *what)
{
	uint64_t buffers, bytes;
	cr_assert_eq(rc, BB_ERR_INVALID, "%s: the import answered %d (%s)", what, rc, err);
	cr_assert(strstr(err, want), "%s: \"%s\" does not say \"%s\"", what, err, want);
	be->usage(be, &buffers, &bytes);
	cr_assert_eq(buffers, 0, "%s: a refused import is counted live", what);
}

static int seals_of(int fd)
{
	int seals = fcntl(fd, F_GET_SEALS);
	cr_assert_geq(seals, 0, "F_GET_SEALS: %s", strerror(errno));
	return seals;
}

/* What a racing peer does while the backend seals. */
static void race_future_write(int fd)
{
	cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0, "the racer's seal: %s",
		     strerror(errno));
}

static void race_write(int fd)
{
	cr_assert_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0, "the racer's seal: %s",
		     strerror(errno));
}

static void race_shrink(int fd)
{
	cr_assert_eq(ftruncate(fd, (off_t)(PAGE / 2)), 0, "the racer's shrink: %s",
		     strerror(errno));
}

static void race_grow(int fd)
{
	cr_assert_eq(ftruncate(fd, (off_t)(16 * PAGE)), 0, "the racer's growth: %s",
		     strerror(errno));
}

/* Import a PAGE-byte memfd while racer changes it: the import is refused
 * with a sentence that says want. */
static void import_raced(void (*r)(int fd), const char *want, const char *what)
{
	backend_mem m;
	int fd = peer_memfd(PAGE);
	racer = r;
	racer_fd = fd;
	int rc = import(fd, PAGE, &m);
	cr_assert_null(racer, "%s: the backend never sealed, so nothing raced", what);
	assert_refused(rc, want, what);
	close(fd);
}

Test(host_import, hands_out_its_own_sealed_duplicate_without_a_write_seal)
{
	int fd = peer_memfd(PAGE);
	backend_mem m;
	backend_export ex;
	cr_assert_eq(import(fd, PAGE, &m), 0, "%s", err);
	cr_assert_eq(m.size, PAGE);
	cr_assert_eq(be->export_mem(be, &m, &ex, err, sizeof(err)), 0, "%s", err);
	cr_assert_neq(ex.fd, fd, "the backend hands out the peer's own fd");
	cr_assert_eq(inode_of(ex.fd), inode_of(fd), "the backend hands out another file");
	cr_assert_eq(seals_of(ex.fd), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL,
		     "seals 0x%x on what the backend hands out", seals_of(ex.fd));
	close(fd); /* the backend keeps its own */
	cr_assert_eq(seals_of(m.fd), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	be->free(be, &m);
	finish();
}

Test(host_import, refuses_a_memfd_with_a_write_seal_and_leaves_it_unsealed)
{
	const int write_seals[] = {F_SEAL_WRITE, F_SEAL_FUTURE_WRITE};
	for (size_t i = 0; i < sizeof(write_seals) / sizeof(write_seals[0]); i++) {
		int fd = peer_memfd(PAGE);
		backend_mem m;
		cr_assert_eq(fcntl(fd, F_ADD_SEALS, write_seals[i]), 0);
		assert_refused(import(fd, PAGE, &m), "write seal", "a write-sealed memfd");
		cr_assert_eq(seals_of(fd), write_seals[i],
			     "a refused import sealed the peer's memfd (seals 0x%x)", seals_of(fd));
		close(fd);
	}
	finish();
}

/* The write seal is checked on the daemon's duplicate after its own seals,
 * not only on the peer's fd before them. */
Test(host_import, refuses_a_write_seal_added_while_it_seals)
{
	import_raced(race_future_write, "write seal", "F_SEAL_FUTURE_WRITE added during the seal");
	import_raced(race_write, "write seal", "F_SEAL_WRITE added during the seal");
	finish();
}

/* The size is checked again after sealing: the post-seal re-check. */
Test(host_import, refuses_a_file_shrunk_while_it_seals)
{
	import_raced(race_shrink, "were asked for", "a file shrunk during the seal");
	finish();
}

Test(host_import, refuses_a_file_grown_while_it_seals)
{
	import_raced(race_grow, "at most one page", "a file grown during the seal");
	finish();
}

Test(host_import, refuses_a_file_shorter_than_the_size)
{
	int fd = peer_memfd(PAGE);
	backend_mem m;
	assert_refused(import(fd, PAGE + 1, &m), "were asked for", "a short file");
	cr_assert_eq(seals_of(fd), 0, "a refused import sealed the peer's memfd");
	close(fd);
	finish();
}

/* A buffer charges its owner its size: a file much larger than that would
 * hold memory nobody is charged for (a 256 MiB file imported as 1 byte).
 * Up to one page more is fine (a size rounded up to whole pages). */
Test(host_import, takes_a_file_up_to_one_page_larger_than_the_size_and_no_larger)
{
	const struct {
		uint64_t file, size;
		bool ok;
	} cases[] = {{PAGE, PAGE, true},  {2 * PAGE, PAGE, true}, {PAGE + 1, 1, true},
		     {PAGE, 100, true},   {256u << 20, 1, false}, {2 * PAGE + 1, PAGE, false},
		     {PAGE + 2, 1, false}};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int fd = peer_memfd(cases[i].file);
		backend_mem m;
		int rc = import(fd, cases[i].size, &m);
		if (cases[i].ok) {
			cr_assert_eq(rc, 0, "a file of %llu bytes as %llu: %s",
				     (unsigned long long)cases[i].file,
				     (unsigned long long)cases[i].size, err);
			cr_assert_eq(m.size, cases[i].size,
				     "the buffer's size is what was asked for");
			be->free(be, &m);
		} else {
			assert_refused(rc, "at most one page", "a file too large for its size");
			cr_assert_eq(seals_of(fd), 0, "a refused import sealed the peer's memfd");
		}
		close(fd);
	}
	finish();
}
