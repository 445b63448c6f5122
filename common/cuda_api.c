/*
 * dlopen the CUDA driver and resolve the entry points the project uses.
 */
#include "cuda_api.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef BB_HAVE_CUDA_H
/* cuda.h is in use here; the fallback declarations in cuda_api.h must name
 * the same values, or builds without the toolkit would speak another ABI. */
_Static_assert(sizeof(CUipcMemHandle) == 64, "IPC handle size");
_Static_assert(sizeof(CUuuid) == 16, "uuid size");
_Static_assert(sizeof(CUdeviceptr) == 8, "device pointer size");
_Static_assert(sizeof(CUdevice) == sizeof(int), "device handle size");
_Static_assert(CUDA_ERROR_INVALID_VALUE == 1 && CUDA_ERROR_OUT_OF_MEMORY == 2 &&
		       CUDA_ERROR_NOT_INITIALIZED == 3 && CUDA_ERROR_DEINITIALIZED == 4,
	       "error codes");
_Static_assert(CUDA_ERROR_NO_DEVICE == 100 && CUDA_ERROR_INVALID_DEVICE == 101 &&
		       CUDA_ERROR_INVALID_CONTEXT == 201 && CUDA_ERROR_ALREADY_MAPPED == 208 &&
		       CUDA_ERROR_INVALID_HANDLE == 400 && CUDA_ERROR_NOT_FOUND == 500 &&
		       CUDA_ERROR_NOT_SUPPORTED == 801,
	       "error codes");
_Static_assert(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS == 1, "IPC flag");
_Static_assert(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == 102 &&
		       CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED == 103,
	       "device attributes");
_Static_assert(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 1 &&
		       CU_MEM_ACCESS_FLAGS_PROT_READWRITE == 3 &&
		       CU_MEM_LOCATION_TYPE_DEVICE == 1 && CU_MEM_ALLOCATION_TYPE_PINNED == 1 &&
		       CU_MEM_ALLOC_GRANULARITY_MINIMUM == 0 &&
		       CU_MEM_ALLOC_GRANULARITY_RECOMMENDED == 1,
	       "VMM enums");
_Static_assert(sizeof(CUmemAllocationProp) == 32 && sizeof(CUmemAccessDesc) == 12 &&
		       sizeof(CUmemGenericAllocationHandle) == 8,
	       "VMM structs");
#endif

const char *bb_cuda_library_path(void)
{
	const char *p = getenv("BUFBROKER_CUDA_LIBRARY");
	return p && p[0] ? p : "libcuda.so.1";
}

/* name -> offset of its slot in bb_cuda; required or optional. */
struct sym {
	const char *name;
	size_t offset;
	int required;
};

#define REQ(field, name)                          \
	{                                         \
		name, offsetof(bb_cuda, field), 1 \
	}
#define OPT(field, name)                          \
	{                                         \
		name, offsetof(bb_cuda, field), 0 \
	}

static const struct sym syms[] = {
	REQ(Init, "cuInit"),
	REQ(DriverGetVersion, "cuDriverGetVersion"),
	REQ(DeviceGetCount, "cuDeviceGetCount"),
	REQ(DeviceGet, "cuDeviceGet"),
	REQ(DeviceGetName, "cuDeviceGetName"),
	REQ(DeviceGetUuid, "cuDeviceGetUuid_v2"),
	REQ(DeviceTotalMem, "cuDeviceTotalMem_v2"),
	REQ(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
	REQ(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
	REQ(CtxSetCurrent, "cuCtxSetCurrent"),
	REQ(CtxGetCurrent, "cuCtxGetCurrent"),
	REQ(MemAlloc, "cuMemAlloc_v2"),
	REQ(MemFree, "cuMemFree_v2"),
	REQ(MemGetInfo, "cuMemGetInfo_v2"),
	REQ(IpcGetMemHandle, "cuIpcGetMemHandle"),
	REQ(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2"),
	REQ(IpcCloseMemHandle, "cuIpcCloseMemHandle"),
	REQ(GetErrorName, "cuGetErrorName"),
	REQ(GetErrorString, "cuGetErrorString"),
	OPT(DeviceGetAttribute, "cuDeviceGetAttribute"),
	OPT(MemCreate, "cuMemCreate"),
	OPT(MemRelease, "cuMemRelease"),
	OPT(MemExportToShareableHandle, "cuMemExportToShareableHandle"),
	OPT(MemImportFromShareableHandle, "cuMemImportFromShareableHandle"),
	OPT(MemAddressReserve, "cuMemAddressReserve"),
	OPT(MemAddressFree, "cuMemAddressFree"),
	OPT(MemMap, "cuMemMap"),
	OPT(MemUnmap, "cuMemUnmap"),
	OPT(MemSetAccess, "cuMemSetAccess"),
	OPT(MemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
	OPT(MemcpyHtoD, "cuMemcpyHtoD_v2"),
	OPT(MemcpyDtoH, "cuMemcpyDtoH_v2"),
	OPT(MemsetD8, "cuMemsetD8_v2"),
	OPT(CtxSynchronize, "cuCtxSynchronize"),
};

int bb_cuda_load(bb_cuda *api, char *err, size_t errlen)
{
	const char *path = bb_cuda_library_path();
	memset(api, 0, sizeof(*api));
	api->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!api->lib) {
		snprintf(err, errlen, "cannot load the CUDA driver %s: %s", path, dlerror());
		return -1;
	}
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *fn = dlsym(api->lib, syms[i].name);
		if (!fn && syms[i].required) {
			snprintf(err, errlen, "the CUDA driver %s lacks %s (too old?)", path,
				 syms[i].name);
			bb_cuda_unload(api);
			return -1;
		}
		memcpy((char *)api + syms[i].offset, &fn, sizeof(fn));
	}
	CUresult rc = api->Init(0);
	if (rc != CUDA_SUCCESS) {
		char eb[128];
		snprintf(err, errlen, "cuInit failed: %s", bb_cuda_error(api, rc, eb, sizeof(eb)));
		bb_cuda_unload(api);
		return -1;
	}
	return 0;
}

int bb_cuda_has_vmm(const bb_cuda *api, char *why, size_t whylen)
{
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		if (syms[i].offset < offsetof(bb_cuda, DeviceGetAttribute) ||
		    syms[i].offset > offsetof(bb_cuda, MemGetAllocationGranularity))
			continue;
		void *fn;
		memcpy(&fn, (const char *)api + syms[i].offset, sizeof(fn));
		if (!fn) {
			if (why)
				snprintf(
					why, whylen,
					"the CUDA driver %s lacks %s (too old for VMM allocations)",
					bb_cuda_library_path(), syms[i].name);
			return 0;
		}
	}
	return 1;
}

void bb_cuda_unload(bb_cuda *api)
{
	if (api->lib)
		dlclose(api->lib);
	memset(api, 0, sizeof(*api));
}

const char *bb_cuda_error(const bb_cuda *api, CUresult rc, char *buf, size_t len)
{
	const char *name = NULL, *str = NULL;
	if (api && api->GetErrorName)
		api->GetErrorName(rc, &name);
	if (api && api->GetErrorString)
		api->GetErrorString(rc, &str);
	if (name && str)
		snprintf(buf, len, "%s (%s)", name, str);
	else
		snprintf(buf, len, "CUDA error %d", rc);
	return buf;
}

void bb_cuda_uuid_format(const unsigned char u[16], char *out)
{
	sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
		u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
		u[13], u[14], u[15]);
}
