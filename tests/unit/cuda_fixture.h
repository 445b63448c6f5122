/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the unit tests of the CUDA backend share (test_cuda_extents.c,
 * test_cuda_vmm.c): the backend on tests/fakecuda's driver ($BB_FAKECUDA,
 * else the libfakecuda.so built next to the test binary: ctest gives unit
 * tests no environment), in a fake namespace of the test's own with one
 * 64 MiB device, and backend jobs that queue and run when the test says,
 * as the server runs them. Include it after daemon/backend_cuda.c.
 */
#ifndef BB_TEST_CUDA_FIXTURE_H
#define BB_TEST_CUDA_FIXTURE_H

#include <criterion/criterion.h>
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static backend *be;        /* the backend under test, or NULL */
static char lib[PATH_MAX]; /* the fake driver */
static char err[256];      /* the last message of a backend call */

static void find_fake(void)
{
	const char *env = getenv("BB_FAKECUDA");
	if (env && env[0]) {
		snprintf(lib, sizeof(lib), "%s", env);
		return;
	}
	char exe[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	cr_assert_gt(n, 0, "cannot read /proc/self/exe");
	exe[n] = '\0';
	snprintf(lib, sizeof(lib), "%s/libfakecuda.so", dirname(exe));
	cr_assert_eq(access(lib, R_OK), 0, "%s: build the fakecuda target or set BB_FAKECUDA", lib);
}

/* The driver's environment, in a namespace named after name and the pid. */
static void fake_setup(const char *name)
{
	char ns[64];
	find_fake();
	snprintf(ns, sizeof(ns), "bbtest-%s-%d", name, (int)getpid());
	setenv("BUFBROKER_CUDA_LIBRARY", lib, 1);
	setenv("FAKECUDA_NAMESPACE", ns, 1);
	setenv("FAKECUDA_DEVICES", "1", 1);
	setenv("FAKECUDA_MEMORY", "64M", 1);
	unsetenv("CUDA_VISIBLE_DEVICES");
}

/* Jobs wait here until the test runs them, oldest first. */
static backend_job *queue[64];
static int queued;

static void queue_job(backend *b, backend_job *job)
{
	(void)b;
	cr_assert_lt(queued, 64, "jobs pile up");
	queue[queued++] = job;
}

/* Run the oldest job's work and done, as the server would. */
static bool run_one(void)
{
	if (!queued)
		return false;
	backend_job *job = queue[0];
	queued--;
	memmove(queue, queue + 1, (size_t)queued * sizeof(queue[0]));
	job->work(job);
	job->done(job);
	return true;
}

static void drain(void)
{
	while (run_one())
		;
}

/* Destroy the backend after its jobs, and remove what the namespace left
 * in /dev/shm. */
static void teardown(void)
{
	if (be) {
		drain();
		be->destroy(be);
		be = NULL;
	}
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (h) {
		void (*reset)(void) = (void (*)(void))dlsym(h, "fakecuda_reset_namespace");
		if (reset)
			reset();
		dlclose(h);
	}
}

#endif /* BB_TEST_CUDA_FIXTURE_H */
