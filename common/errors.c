/*
 * Sentences for the BB_ERR_* codes, shared by the daemon and the library.
 */
#include "bufbroker/bufbroker.h"

__attribute__((visibility("default"))) const char *bb_strerror(int err)
{
	switch (err) {
	case BB_OK: return "success";
	case BB_ERR_INVALID: return "invalid argument";
	case BB_ERR_NOT_FOUND: return "no such buffer, name or token";
	case BB_ERR_DENIED: return "permission denied";
	case BB_ERR_NO_MEMORY: return "out of memory or over a limit";
	case BB_ERR_TIMEOUT: return "timed out";
	case BB_ERR_DISCONNECTED: return "disconnected from the daemon";
	case BB_ERR_PROTOCOL: return "protocol error";
	case BB_ERR_FAILED: return "the buffer is in the failed state";
	case BB_ERR_UNSUPPORTED: return "not supported";
	case BB_ERR_STATE: return "the buffer is in the wrong state";
	case BB_ERR_EXISTS: return "the name is taken";
	case BB_ERR_SYSTEM: return "a system call failed";
	default: return "unknown error";
	}
}
