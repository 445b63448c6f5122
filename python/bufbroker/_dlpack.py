# SPDX-License-Identifier: Apache-2.0
"""DLPack capsules made with ctypes (no compiled extension).

The structs mirror dlpack.h (https://dmlc.github.io/dlpack/latest/): the
legacy ``DLManagedTensor`` in a capsule named ``"dltensor"`` and, for a
consumer that asks for ``max_version >= (1, 0)``, the versioned
``DLManagedTensorVersioned`` (DLPack 1.0) in one named
``"dltensor_versioned"``. A consumer takes the tensor by renaming the
capsule (``"used_dltensor"``, ``"used_dltensor_versioned"``) and calls the
tensor's deleter once when it is done with it; a capsule that dies unused
calls the deleter itself. Either way the deleter runs exactly once.

Every exported tensor is an entry of ``_live``, keyed by the address of its
managed struct, which owns the struct's memory and the release that gives
back the buffer count the tensor holds. The deleter pops the entry and
releases it.
"""

import ctypes
import sys
import threading
import traceback
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

# DLDeviceType
kDLCPU = 1
kDLCUDA = 2
# DLDataTypeCode
kDLInt = 0
kDLUInt = 1
kDLFloat = 2
kDLBfloat = 4
kDLComplex = 5
kDLBool = 6
#: The DLPack version of the versioned struct made here.
VERSION = (1, 0)
#: DLPACK_FLAG_BITMASK_READ_ONLY: never set (every buffer is writable).
FLAG_READ_ONLY = 1 << 0

CAPSULE = b"dltensor"
USED_CAPSULE = b"used_dltensor"
CAPSULE_VERSIONED = b"dltensor_versioned"
USED_CAPSULE_VERSIONED = b"used_dltensor_versioned"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements
        ("byte_offset", ctypes.c_uint64),
    ]


#: void (*deleter)(struct DLManagedTensor[Versioned] *self)
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# ---- dtypes ---------------------------------------------------------------------


class DType(NamedTuple):
    """An element type: its name, DLPack code and bits, and the array
    interface's typestr (None where numpy has no such type)."""

    name: str
    code: int
    bits: int
    typestr: Optional[str]

    @property
    def itemsize(self) -> int:
        return self.bits // 8


_E = "<" if sys.byteorder == "little" else ">"
_DTYPES: Dict[str, DType] = {
    d.name: d
    for d in (
        DType("bool", kDLBool, 8, "|b1"),
        DType("int8", kDLInt, 8, "|i1"),
        DType("int16", kDLInt, 16, _E + "i2"),
        DType("int32", kDLInt, 32, _E + "i4"),
        DType("int64", kDLInt, 64, _E + "i8"),
        DType("uint8", kDLUInt, 8, "|u1"),
        DType("uint16", kDLUInt, 16, _E + "u2"),
        DType("uint32", kDLUInt, 32, _E + "u4"),
        DType("uint64", kDLUInt, 64, _E + "u8"),
        DType("float16", kDLFloat, 16, _E + "f2"),
        DType("float32", kDLFloat, 32, _E + "f4"),
        DType("float64", kDLFloat, 64, _E + "f8"),
        DType("bfloat16", kDLBfloat, 16, None),
        DType("complex64", kDLComplex, 64, _E + "c8"),
        DType("complex128", kDLComplex, 128, _E + "c16"),
    )
}
# Other spellings: numpy's scalar type names, Python's types, typestrs.
_ALIASES: Dict[str, str] = {
    "bool_": "bool",
    "float": "float64",
    "int": "int64",
    "complex": "complex128",
    "half": "float16",
    "single": "float32",
    "double": "float64",
}
for _d in _DTYPES.values():
    if _d.typestr:
        _ALIASES[_d.typestr] = _d.name
        _ALIASES[_d.typestr[1:]] = _d.name
        _ALIASES["=" + _d.typestr[1:]] = _d.name

#: What names an element type: a name (``"float32"``), a typestr
#: (``"<f4"``), or a numpy, torch or Python type or dtype object.
DTypeLike = Union[str, DType, type, Any]


def dtype_of(spec: DTypeLike) -> DType:
    """The DType ``spec`` names; ValueError for one it does not."""
    if isinstance(spec, DType):
        return spec
    if isinstance(spec, str):
        text = spec
    elif isinstance(spec, type):
        text = spec.__name__  # numpy.float32, float
    else:
        name = getattr(spec, "name", None)  # numpy.dtype
        text = name if isinstance(name, str) else str(spec)  # torch.float32
    text = text.strip()
    if text.startswith("torch."):
        text = text[len("torch.") :]
    name = _ALIASES.get(text, text)
    try:
        return _DTYPES[name]
    except KeyError:
        known = ", ".join(_DTYPES)
        raise ValueError(f"unknown dtype {spec!r}: one of {known}") from None


# ---- exports ------------------------------------------------------------------------


class _Export:
    """What a live tensor owns: its struct and arrays, and its release."""

    __slots__ = ("struct", "shape", "strides", "release")

    def __init__(
        self,
        struct: Union[DLManagedTensor, DLManagedTensorVersioned],
        shape: "ctypes.Array[ctypes.c_int64]",
        strides: "ctypes.Array[ctypes.c_int64]",
        release: Callable[[], None],
    ) -> None:
        self.struct = struct
        self.shape = shape
        self.strides = strides
        self.release = release


_live_lock = threading.RLock()  # a capsule may die inside the locked block
_live: Dict[int, _Export] = {}


def live_exports() -> int:
    """How many tensors this process exported that no deleter has freed."""
    with _live_lock:
        return len(_live)


def _delete(addr: Optional[int]) -> None:
    # Any thread may call it, once per tensor: ctypes takes the GIL.
    with _live_lock:
        exp = _live.pop(addr, None) if addr else None
    if exp is not None:
        exp.release()


_deleter = DELETER(_delete)

_capsule_destructor_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Function objects of our own (item access makes a new one; attribute
# access shares one whose prototype other code may set differently).
_api = ctypes.pythonapi
_PyCapsule_New = _api["PyCapsule_New"]
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _capsule_destructor_t]
_PyCapsule_IsValid = _api["PyCapsule_IsValid"]
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = _api["PyCapsule_GetPointer"]
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
# Raises the exception set in this thread, if any: PYTHONAPI calls check.
_PyErr_Occurred = _api["PyErr_Occurred"]
_PyErr_Occurred.restype = ctypes.c_void_p
_PyErr_Occurred.argtypes = []


def _capsule_gone(capsule: int) -> None:
    """The capsules' destructor: an unused tensor's deleter runs here."""
    # A consumer that fails (numpy for a dtype it lacks) drops the capsule
    # with its exception set, which every call here would trip over: take
    # it first. It cannot be handed back to the consumer from here, which
    # then reports "returned NULL without setting an exception"; say what
    # it was.
    pending: Optional[BaseException] = None
    try:
        _PyErr_Occurred()
    except BaseException as e:  # noqa: B036 - whatever the consumer raised
        pending = e
    try:
        for name, struct in ((CAPSULE, DLManagedTensor), (CAPSULE_VERSIONED, DLManagedTensorVersioned)):
            if _PyCapsule_IsValid(capsule, name):
                addr = _PyCapsule_GetPointer(capsule, name)
                deleter = struct.from_address(addr).deleter
                if deleter:
                    deleter(addr)
                break
    finally:
        if pending is not None:
            print("bufbroker: a DLPack consumer failed with the tensor unused:", file=sys.stderr)
            traceback.print_exception(pending, file=sys.stderr)


_destructor = _capsule_destructor_t(_capsule_gone)


def capsule(
    data: int,
    device: Tuple[int, int],
    dtype: DType,
    shape: Sequence[int],
    versioned: bool,
    release: Callable[[], None],
) -> Any:
    """A new DLPack capsule of a C-contiguous tensor at ``data``.

    ``release`` is called once, by the tensor's deleter: when the consumer
    is done with it, or when the capsule dies unused. Strides are given
    (in elements, row-major) rather than NULL, which DLPack 1.2 deprecates."""
    ndim = len(shape)
    c_shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    c_strides = (ctypes.c_int64 * max(ndim, 1))(*strides)
    struct: Union[DLManagedTensor, DLManagedTensorVersioned]
    if versioned:
        v = DLManagedTensorVersioned()
        v.version = DLPackVersion(*VERSION)
        v.flags = 0
        struct, t, name = v, v.dl_tensor, CAPSULE_VERSIONED
    else:
        m = DLManagedTensor()
        struct, t, name = m, m.dl_tensor, CAPSULE
    t.data = data
    t.device = DLDevice(*device)
    t.ndim = ndim
    t.dtype = DLDataType(dtype.code, dtype.bits, 1)
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    struct.manager_ctx = None
    struct.deleter = _deleter
    addr = ctypes.addressof(struct)
    with _live_lock:
        _live[addr] = _Export(struct, c_shape, c_strides, release)
    try:
        return _PyCapsule_New(addr, name, _destructor)
    except BaseException:
        _delete(addr)
        raise
