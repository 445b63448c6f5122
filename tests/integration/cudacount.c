/*
 * libcudacount.so: the CUDA driver as a test child sees it, with the calls
 * that open and close a VMM allocation in a process counted
 * (cudacount_vmm_stats). It is linked against libfakecuda.so and defines
 * only the counted entry points, calling the fake's; every other name a
 * dlsym on its handle looks for (the driver's and the fake's test hooks)
 * is found in that dependency. test_cuda points BUFBROKER_CUDA_LIBRARY at
 * it ($BB_CUDACOUNT) where it counts VMM calls. A test tool, never
 * installed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cuda_api.h"

#define EXPORT __attribute__((visibility("default")))

static atomic_ulong imports, maps, unmaps; /* successful calls */

/* The fake's entry point name (the dependency this library was linked
 * against, already loaded with it). */
static void *next(const char *name)
{
	void *fn = dlsym(RTLD_NEXT, name);

	if (!fn)
		abort(); /* linked against a fake without it: nothing to count */
	return fn;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle,
					       CUmemAllocationHandleType type)
{
	CUresult (*fn)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType) =
		next("cuMemImportFromShareableHandle");
	CUresult rc = fn(h, os_handle, type);

	if (rc == CUDA_SUCCESS)
		atomic_fetch_add(&imports, 1);
	return rc;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			 CUmemGenericAllocationHandle h, unsigned long long flags)
{
	CUresult (*fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
		       unsigned long long) = next("cuMemMap");
	CUresult rc = fn(ptr, size, offset, h, flags);

	if (rc == CUDA_SUCCESS)
		atomic_fetch_add(&maps, 1);
	return rc;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	CUresult (*fn)(CUdeviceptr, size_t) = next("cuMemUnmap");
	CUresult rc = fn(ptr, size);

	if (rc == CUDA_SUCCESS)
		atomic_fetch_add(&unmaps, 1);
	return rc;
}

/* Successful cuMemImportFromShareableHandle, cuMemMap and cuMemUnmap calls
 * in this process so far. */
EXPORT void cudacount_vmm_stats(unsigned long *imports_out, unsigned long *maps_out,
				unsigned long *unmaps_out)
{
	*imports_out = atomic_load(&imports);
	*maps_out = atomic_load(&maps);
	*unmaps_out = atomic_load(&unmaps);
}
