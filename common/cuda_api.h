/*
 * The CUDA driver, loaded at run time with dlopen so one binary serves GPU
 * and CPU-only hosts. The library is $BUFBROKER_CUDA_LIBRARY, else
 * "libcuda.so.1"; tests point it at tests/fakecuda's libfakecuda.so.
 *
 * The types below are the driver API's own, declared here so the project
 * builds without the toolkit; where the toolkit's cuda.h is found at build
 * time (BB_HAVE_CUDA_H) it is used instead, and cuda_api.c checks that the
 * values declared here are the driver's.
 */
#ifndef BB_CUDA_API_H
#define BB_CUDA_API_H

#include <stddef.h>

#ifdef BB_HAVE_CUDA_H
#include <cuda.h>
#else
typedef int CUresult;                   /* CUDA_SUCCESS = 0 */
typedef int CUdevice;                   /* device ordinal as this process numbers it */
typedef unsigned long long CUdeviceptr; /* device address (64-bit) */
typedef struct CUctx_st *CUcontext;
typedef struct CUuuid_st {
	char bytes[16];
} CUuuid;
#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcMemHandle_st {
	char reserved[CU_IPC_HANDLE_SIZE];
} CUipcMemHandle;

/* The result codes the project looks at (values as in cuda.h). */
enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEINITIALIZED = 4,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_ALREADY_MAPPED = 208,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_SUPPORTED = 801,
};
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
typedef int CUdevice_attribute;
#define CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING 41
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103

/* The virtual memory management API (cuMemCreate and its family). */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef enum CUmemAllocationHandleType_enum {
	CU_MEM_HANDLE_TYPE_NONE = 0x0,
	CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
} CUmemAllocationHandleType;
typedef enum CUmemAccess_flags_enum {
	CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
	CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
	CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
} CUmemAccess_flags;
typedef enum CUmemLocationType_enum {
	CU_MEM_LOCATION_TYPE_INVALID = 0x0,
	CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
} CUmemLocationType;
typedef enum CUmemAllocationType_enum {
	CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
	CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
} CUmemAllocationType;
typedef enum CUmemAllocationGranularity_flags_enum {
	CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
	CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CUmemAllocationGranularity_flags;
typedef struct CUmemLocation_st {
	CUmemLocationType type;
	int id; /* the device ordinal for CU_MEM_LOCATION_TYPE_DEVICE */
} CUmemLocation;
typedef struct CUmemAllocationProp_st {
	CUmemAllocationType type;
	CUmemAllocationHandleType requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData; /* NULL on POSIX */
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct CUmemAccessDesc_st {
	CUmemLocation location;
	CUmemAccess_flags flags;
} CUmemAccessDesc;
#endif /* BB_HAVE_CUDA_H */

/* Every entry point the project resolves (the _v2 names where the driver
 * has them). Required ones make bb_cuda_load fail when missing; the
 * optional ones (tests and tools only) are NULL when missing. */
typedef struct bb_cuda {
	void *lib; /* dlopen handle */
	CUresult (*Init)(unsigned int flags);
	CUresult (*DriverGetVersion)(int *version);
	CUresult (*DeviceGetCount)(int *count);
	CUresult (*DeviceGet)(CUdevice *dev, int ordinal);
	CUresult (*DeviceGetName)(char *name, int len, CUdevice dev);
	CUresult (*DeviceGetUuid)(CUuuid *uuid, CUdevice dev);   /* cuDeviceGetUuid_v2 */
	CUresult (*DeviceTotalMem)(size_t *bytes, CUdevice dev); /* cuDeviceTotalMem_v2 */
	CUresult (*DevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
	CUresult (*DevicePrimaryCtxRelease)(CUdevice dev); /* _v2 */
	CUresult (*CtxSetCurrent)(CUcontext ctx);
	CUresult (*CtxGetCurrent)(CUcontext *ctx);
	CUresult (*MemAlloc)(CUdeviceptr *dptr, size_t bytes);           /* cuMemAlloc_v2 */
	CUresult (*MemFree)(CUdeviceptr dptr);                           /* cuMemFree_v2 */
	CUresult (*MemGetInfo)(size_t *free_bytes, size_t *total_bytes); /* cuMemGetInfo_v2 */
	CUresult (*IpcGetMemHandle)(CUipcMemHandle *h, CUdeviceptr dptr);
	CUresult (*IpcOpenMemHandle)(CUdeviceptr *dptr, CUipcMemHandle h,
				     unsigned int flags); /* _v2 */
	CUresult (*IpcCloseMemHandle)(CUdeviceptr dptr);
	CUresult (*GetErrorName)(CUresult err, const char **str);
	CUresult (*GetErrorString)(CUresult err, const char **str);
	/* Optional: a driver without these serves legacy IPC buffers only
	 * (bb_cuda_has_vmm says whether every one of the VMM group is there). */
	CUresult (*DeviceGetAttribute)(int *value, CUdevice_attribute attrib, CUdevice dev);
	CUresult (*MemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
			      const CUmemAllocationProp *prop, unsigned long long flags);
	CUresult (*MemRelease)(CUmemGenericAllocationHandle handle);
	CUresult (*MemExportToShareableHandle)(void *shareable, CUmemGenericAllocationHandle handle,
					       CUmemAllocationHandleType type,
					       unsigned long long flags);
	CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
						 void *os_handle, CUmemAllocationHandleType type);
	CUresult (*MemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
				      CUdeviceptr addr, unsigned long long flags);
	CUresult (*MemAddressFree)(CUdeviceptr ptr, size_t size);
	CUresult (*MemMap)(CUdeviceptr ptr, size_t size, size_t offset,
			   CUmemGenericAllocationHandle handle, unsigned long long flags);
	CUresult (*MemUnmap)(CUdeviceptr ptr, size_t size);
	CUresult (*MemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
				 size_t count);
	CUresult (*MemGetAllocationGranularity)(size_t *granularity,
						const CUmemAllocationProp *prop,
						CUmemAllocationGranularity_flags option);
	/* Optional: tests and benchmarks move bytes with these. */
	CUresult (*MemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes); /* _v2 */
	CUresult (*MemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);       /* _v2 */
	CUresult (*MemsetD8)(CUdeviceptr dst, unsigned char value, size_t n);   /* _v2 */
	CUresult (*CtxSynchronize)(void);
} bb_cuda;

/* dlopen the driver, resolve every entry point and call cuInit(0). 0 on
 * success; otherwise -1 with a sentence in err saying why (no library, a
 * missing symbol, cuInit's error) and *api left unloaded. */
int bb_cuda_load(bb_cuda *api, char *err, size_t errlen);
/* 1 when the driver has every VMM entry point above (DeviceGetAttribute
 * through MemGetAllocationGranularity), else 0 with why (when not NULL)
 * naming the first one missing. */
int bb_cuda_has_vmm(const bb_cuda *api, char *why, size_t whylen);
/* dlclose. Safe on an api that failed to load. */
void bb_cuda_unload(bb_cuda *api);
/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for logs and messages; never NULL. */
const char *bb_cuda_error(const bb_cuda *api, CUresult rc, char *buf, size_t len);
/* The library path bb_cuda_load uses. */
const char *bb_cuda_library_path(void);
/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi and
 * CUDA_VISIBLE_DEVICES write a device's UUID (out: at least 41 bytes). */
void bb_cuda_uuid_format(const unsigned char uuid[16], char *out);

#endif /* BB_CUDA_API_H */
