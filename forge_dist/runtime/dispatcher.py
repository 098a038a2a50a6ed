"""The static dispatcher: launch AOT-compiled cubins through the CUDA driver API.

Triton's JIT path costs, on every call, argument binding, specialisation, a cache lookup
and its generated C launcher (the paper measured ~200 us of such overhead on a 47 us
kernel).  Here everything that can be is done once, at plan time:

* the cubin is loaded (``cuModuleLoadData``), its function looked up
  (``cuModuleGetFunction``) and its dynamic shared memory opted in, exactly as Triton's own
  loader does (``triton/backends/nvidia/driver.c: loadBinary``);
* the kernel parameters get one packed buffer laid out with each parameter's natural
  alignment (:class:`ArgPack`), plus the ``void*[]`` array of slot addresses that
  ``cuLaunchKernel(kernelParams=...)`` reads;

and a call only writes the changed pointers into the buffer (one ``struct.pack_into``) and
calls ``cuLaunchKernel``.  The driver copies the parameters at launch (and at stream
capture), so reusing the buffer is safe for CUDA graphs.

Parameter order of a Triton 3.6 cubin: its runtime (non-constexpr) parameters in order,
then two pointers, ``global_scratch`` and ``profile_scratch`` (``driver.py:make_launcher``).
Kernels that need either scratch (size > 0) are refused (the JIT path runs them), as
Triton's own AOT tool refuses them.

Two driver bindings, same calls: ``cuda.bindings.driver`` (cuda-python, default when
importable) or ``libcuda.so.1`` through ctypes (``FORGE_DIST_CUDA_DRIVER=ctypes``, or when
cuda-python is missing).
"""
from __future__ import annotations

import ctypes
import os
import struct
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# (struct code, size) of each Triton signature type as the kernel ABI sees it.  fp16/bf16
# scalars travel as their 16-bit storage (Triton packs them so); pointers are 64-bit.
_SCALAR = {"i1": ("b", 1), "i8": ("b", 1), "i16": ("h", 2), "i32": ("i", 4), "i64": ("q", 8),
           "u1": ("B", 1), "u8": ("B", 1), "u16": ("H", 2), "u32": ("I", 4), "u64": ("Q", 8),
           "fp16": ("e", 2), "bf16": ("H", 2), "fp32": ("f", 4), "f32": ("f", 4),
           "fp64": ("d", 8)}
SCRATCH_PARAMS = (("global_scratch", "*i8"), ("profile_scratch", "*i8"))

# CUDA driver enum values (cuda.h, CUDA 12/13)
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_FUNC_CACHE_PREFER_SHARED = 1


def _code(ty: str) -> Tuple[str, int]:
    if ty.startswith("*"):
        return "Q", 8
    try:
        return _SCALAR[ty]
    except KeyError:
        raise ValueError(f"unsupported kernel parameter type {ty!r}") from None


class ArgPack:
    """One contiguous, naturally aligned buffer for a kernel's parameters.

    ``types`` are Triton signature types in parameter order.  ``offsets[i]`` is where
    parameter ``i`` lives; ``params`` is the ``void*[]`` of slot addresses
    (``cuLaunchKernel``'s ``kernelParams``), fixed for the life of the pack.
    """

    def __init__(self, types: Sequence[str]):
        self.types = tuple(types)
        fmt, offsets, pos = "<", [], 0
        for ty in self.types:
            code, size = _code(ty)
            pad = (-pos) % size
            fmt += "x" * pad + code
            pos += pad
            offsets.append(pos)
            pos += size
        self.size = pos
        self.offsets = tuple(offsets)
        self.struct = struct.Struct(fmt)
        assert self.struct.size == self.size
        self.buffer = ctypes.create_string_buffer(max(self.size, 1))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(len(self.types), 1))(
            *[base + off for off in self.offsets])
        self.params_address = ctypes.addressof(self.params)

    def pack(self, values: Sequence[Any]) -> None:
        """Write every parameter (pointers as ints, scalars as Python numbers)."""
        self.struct.pack_into(self.buffer, 0, *values)

    def unpack(self) -> Tuple[Any, ...]:
        """Read the buffer back (tests)."""
        return self.struct.unpack_from(self.buffer, 0)


# ---------------------------------------------------------------------------------------
# Driver bindings
# ---------------------------------------------------------------------------------------

class DriverError(RuntimeError):
    """A CUDA driver call failed."""


class CtypesDriver:
    """The driver API through ``libcuda.so.1`` and ctypes."""

    name = "ctypes"

    def __init__(self, lib: Optional[ctypes.CDLL] = None):
        self.lib = lib or ctypes.CDLL("libcuda.so.1")
        L, c = self.lib, ctypes
        vp, u, i = c.c_void_p, c.c_uint, c.c_int
        L.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        L.cuLaunchKernel.restype = i
        L.cuModuleLoadData.argtypes = [c.POINTER(vp), c.c_char_p]
        L.cuModuleGetFunction.argtypes = [c.POINTER(vp), vp, c.c_char_p]
        L.cuCtxGetCurrent.argtypes = [c.POINTER(vp)]
        L.cuCtxSetCurrent.argtypes = [vp]
        L.cuDevicePrimaryCtxRetain.argtypes = [c.POINTER(vp), i]
        L.cuFuncSetAttribute.argtypes = [vp, i, i]
        L.cuFuncGetAttribute.argtypes = [c.POINTER(i), i, vp]
        L.cuFuncSetCacheConfig.argtypes = [vp, i]
        L.cuDeviceGetAttribute.argtypes = [c.POINTER(i), i, i]
        L.cuGetErrorName.argtypes = [i, c.POINTER(c.c_char_p)]
        self._launch = L.cuLaunchKernel

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise DriverError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def ensure_context(self, device: int) -> None:
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                        "cuDevicePrimaryCtxRetain")
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, image: bytes, name: str, shared: int, device: int):
        self.ensure_context(device)
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()),
                    f"cuModuleGetFunction({name})")
        if shared > 49152:
            optin, static = ctypes.c_int(), ctypes.c_int()
            self._check(self.lib.cuDeviceGetAttribute(
                ctypes.byref(optin), CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                device), "cuDeviceGetAttribute")
            if optin.value > 49152:
                self._check(self.lib.cuFuncSetCacheConfig(fn, CU_FUNC_CACHE_PREFER_SHARED),
                            "cuFuncSetCacheConfig")
                self._check(self.lib.cuFuncGetAttribute(
                    ctypes.byref(static), CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn),
                    "cuFuncGetAttribute")
                self._check(self.lib.cuFuncSetAttribute(
                    fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    optin.value - static.value), "cuFuncSetAttribute")
        return mod.value, fn.value

    def launch(self, fn, grid, block_x: int, shared: int, stream: int, params: int) -> None:
        rc = self._launch(fn, grid[0], grid[1], grid[2], block_x, 1, 1, shared, stream,
                          params, None)
        if rc:
            self._check(rc, "cuLaunchKernel")


class BindingsDriver:
    """The driver API through cuda-python (``cuda.bindings.driver``)."""

    name = "cuda.bindings"

    def __init__(self):
        try:
            from cuda.bindings import driver as cu  # optional: cuda-python (the gpu extra)
        except ImportError:  # cuda-python < 12.6 spells it cuda.cuda
            from cuda import cuda as cu  # type: ignore  # optional: cuda-python < 12.6
        self.cu = cu
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._streams: Dict[int, Any] = {}

    def _check(self, out, what: str):
        err = out[0] if isinstance(out, tuple) else out
        if err != self._ok:
            try:
                name = self.cu.cuGetErrorName(err)[1].decode()
            except Exception:  # noqa: BLE001
                name = str(err)
            raise DriverError(f"{what} failed: {name}")
        return out[1] if isinstance(out, tuple) and len(out) > 1 else None

    def ensure_context(self, device: int) -> None:
        cu = self.cu
        ctx = self._check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:
            ctx = self._check(cu.cuDevicePrimaryCtxRetain(cu.CUdevice(device)),
                              "cuDevicePrimaryCtxRetain")
            self._check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, image: bytes, name: str, shared: int, device: int):
        cu = self.cu
        self.ensure_context(device)
        buf = ctypes.create_string_buffer(image, len(image))
        mod = self._check(cu.cuModuleLoadData(ctypes.addressof(buf)), "cuModuleLoadData")
        fn = self._check(cu.cuModuleGetFunction(mod, name.encode()),
                         f"cuModuleGetFunction({name})")
        if shared > 49152:
            optin = self._check(cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                cu.CUdevice(device)), "cuDeviceGetAttribute")
            if optin > 49152:
                self._check(cu.cuFuncSetCacheConfig(
                    fn, cu.CUfunc_cache(CU_FUNC_CACHE_PREFER_SHARED)), "cuFuncSetCacheConfig")
                static = self._check(cu.cuFuncGetAttribute(
                    cu.CUfunction_attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), fn),
                    "cuFuncGetAttribute")
                self._check(cu.cuFuncSetAttribute(
                    fn, cu.CUfunction_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
                    optin - static), "cuFuncSetAttribute")
        return mod, fn

    def launch(self, fn, grid, block_x: int, shared: int, stream: int, params: int) -> None:
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = self.cu.CUstream(stream)
        # cuda.bindings takes ``extra`` as an address (intptr_t): 0, not None
        err = self.cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block_x, 1, 1, shared, s,
                                     params, 0)[0]
        if err != self._ok:
            self._check((err,), "cuLaunchKernel")


_DRIVER = None


def driver():
    """The process's driver binding (``FORGE_DIST_CUDA_DRIVER=cuda.bindings|ctypes``)."""
    global _DRIVER
    if _DRIVER is None:
        choice = os.environ.get("FORGE_DIST_CUDA_DRIVER", "auto")
        if choice not in ("auto", "cuda.bindings", "ctypes"):
            raise ValueError(f"FORGE_DIST_CUDA_DRIVER: expected auto, cuda.bindings or ctypes, "
                             f"got {choice!r}")
        if choice in ("auto", "cuda.bindings"):
            try:
                _DRIVER = BindingsDriver()
            except ImportError:
                if choice == "cuda.bindings":
                    raise
        if _DRIVER is None:
            _DRIVER = CtypesDriver()
    return _DRIVER


def current_stream_fn(device_index: int) -> Callable[[], int]:
    """A function returning the raw current CUDA stream of ``device_index``.

    Uses ``torch._C._cuda_getCurrentRawStream`` (what Triton's own launcher calls, cheap)
    when present, else the public ``torch.cuda.current_stream(...).cuda_stream``.
    """
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(device_index)
    return lambda: torch.cuda.current_stream(device_index).cuda_stream


# ---------------------------------------------------------------------------------------
# Bound launches
# ---------------------------------------------------------------------------------------

class BoundLaunch:
    """One cubin launch with its grid, block, shared memory and packed parameters.

    ``slots`` maps each runtime parameter to a buffer name (pointer) or a fixed scalar;
    :meth:`launch` reads the buffers' ``data_ptr`` from ``ptrs`` (a dict name -> int).
    """

    __slots__ = ("fn", "grid", "block_x", "shared", "pack", "names", "fixed", "driver",
                 "kernel", "_slots")

    def __init__(self, driver_, fn, kernel: str, grid, num_warps: int, shared: int,
                 types: Sequence[str], slots: Sequence[Tuple[str, Any]]):
        self.driver = driver_
        self.fn = fn
        self.kernel = kernel
        self.grid = tuple(int(x) for x in grid)
        self.block_x = 32 * int(num_warps)
        self.shared = int(shared)
        self.pack = ArgPack(list(types) + [t for _, t in SCRATCH_PARAMS])
        # names[i] is a buffer name for pointer slots and None for fixed scalars
        self.names = [v if kind == "buf" else None for kind, v in slots]
        self.fixed = [None if kind == "buf" else v for kind, v in slots] + [0, 0]
        self._slots = [(i, n) for i, n in enumerate(self.names) if n is not None]

    def bake(self, ptrs: Dict[str, int]) -> None:
        """Fix the pointers of buffers that never change (a plan's workspaces), so that a
        launch only writes the per-call ones."""
        for i, n in self._slots:
            if n in ptrs:
                self.fixed[i] = ptrs[n]
        self._slots = [(i, n) for i, n in self._slots if n not in ptrs]

    def values(self, ptrs: Dict[str, int]) -> List[Any]:
        vals = list(self.fixed)
        for i, n in self._slots:
            vals[i] = ptrs[n]
        return vals

    def launch(self, ptrs: Dict[str, int], stream: int) -> None:
        self.pack.pack(self.values(ptrs))
        self.driver.launch(self.fn, self.grid, self.block_x, self.shared, stream,
                           self.pack.params_address)


# driver -> {(kernel key, cubin sha256, device): CUfunction}: every dispatcher of a driver
# shares its loaded modules (each plan makes its own dispatcher), so a module is loaded
# once per process, not once per plan, nor inside a CUDA graph capture that makes a plan
# after an eager warm-up did
_LOADED: "weakref.WeakKeyDictionary[Any, Dict[Tuple[str, str, int], Any]]" = (
    weakref.WeakKeyDictionary())


class Dispatcher:
    """Loads cubins from an :class:`~forge_dist.runtime.aot.CubinCache` and binds launches.

    ``functions`` maps ``(kernel key, cubin sha256, device) -> CUfunction``; it is shared by
    every dispatcher of the same driver, so plans of the same kernel share one loaded module
    (a rebuilt cubin has another sha256 and is loaded anew).
    """

    def __init__(self, cache, driver_=None):
        self.cache = cache
        self.driver = driver_ if driver_ is not None else driver()
        self.functions: Dict[Tuple[str, str, int], Any] = _LOADED.setdefault(self.driver, {})

    def function(self, key: str, device: int):
        """``(CUfunction, entry)`` for the cached kernel ``key``, or ``None`` if unusable."""
        entry = self.cache.entry(key)
        if entry is None:
            return None
        if entry.get("global_scratch_size", 0) or entry.get("profile_scratch_size", 0):
            return None
        fk = (key, str(entry.get("cubin_sha256")), device)
        if fk not in self.functions:
            image = self.cache.cubin(key)
            _, fn = self.driver.load(image, entry["name"], int(entry["shared"]), device)
            self.functions[fk] = fn
        return self.functions[fk], entry

    def bind(self, launch, buffers, device: int) -> Optional[BoundLaunch]:
        """A :class:`BoundLaunch` for a :class:`~forge_dist.kernels.ir.Launch`, or
        ``None`` when no valid cubin is cached for it (the caller then uses the JIT)."""
        spec = launch.spec(buffers)
        got = self.function(spec.key, device)
        if got is None:
            return None
        fn, entry = got
        types = [t for _, t in spec.signature]
        slots = [(kind, value) for _, kind, value in launch.args]
        return BoundLaunch(self.driver, fn, launch.kernel, launch.grid, entry["num_warps"],
                           entry["shared"], types, slots)
