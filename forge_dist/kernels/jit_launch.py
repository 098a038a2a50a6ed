"""Relaunch a kernel Triton's JIT has compiled, without the JIT's per-call path.

``JITFunction.run`` binds the arguments, computes their specialisation and the cache key and
looks the kernel up on every call: 15-20 us of host time per launch on the H200 machine's
host (``results/kernel_profile_hgrn-host_*``), more than the kernel itself at short
sequences.  A plan's launch never changes its constexprs, integers, floats or dtypes between
calls, only its tensors; so after the first call (through the JIT, which compiles or finds
the kernel) the plan keeps the compiled kernel and calls its launcher directly.  Kernels
launched outside plans (the layers' convolution, norm, gate and rotary kernels) keep theirs
per signature (:class:`KeptLaunches`).

The only property of a tensor the kernel was specialised on that can change from call to
call is its pointer's 16-byte alignment (Triton's default specialisation).  The fast launch
is kept only when every pointer of the first call was aligned, and a later call with any
unaligned pointer goes through the JIT again, which picks or compiles the matching kernel.
With a launch hook installed (profilers such as Proton) every call takes the JIT path, so
the hook sees it; ``FORGE_DIST_JIT_RELAUNCH=0`` does the same for every call (``1``, the
default, relaunches).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

ALIGN = 16  # bytes; Triton specialises pointers on it


def raw_stream(index: int) -> int:
    """The current CUDA stream's handle on device ``index``, as Triton's launcher reads it."""
    return torch._C._cuda_getCurrentRawStream(index)


_KNOBS: Any = None  # triton.knobs, imported on first use (an import statement per call: 0.3 us)


def _launch_hook_installed() -> bool:
    global _KNOBS
    if _KNOBS is None:
        from triton import knobs  # optional: the gpu extra

        _KNOBS = knobs
    hook = _KNOBS.runtime.launch_enter_hook  # Triton 3.6: a HookChain, empty by default
    return hook is not None and bool(getattr(hook, "calls", True))


class CompiledLaunch:
    """One launch of a compiled kernel: fixed grid and scalars, tensors by buffer name.

    Build it with :meth:`make` from what the JIT returned; call it with the plan's tensors
    and the raw stream handle, or check :meth:`aligned` first.
    """

    def __init__(self, kernel, grid: Tuple[int, int, int], slots: List[Tuple[bool, Any]],
                 buffers: Tuple[Any, ...]):
        self._run = kernel.run  # the generated C launcher (loads the module on first use)
        self._function = kernel.function
        self._packed = kernel.packed_metadata
        self._grid = grid
        # (taken from the call, its name there) or (False, the value), in parameter order
        self._slots = slots
        self.buffers = buffers  # the pointers' names: their alignment is checked

    @staticmethod
    def make(kernel, fn, grid: Sequence[int], args: Sequence[Tuple[str, str, Any]],
             constexprs: Dict[str, Any], tensors: Dict[str, torch.Tensor]
             ) -> Optional["CompiledLaunch"]:
        """``None`` unless ``kernel`` is a compiled kernel (not the interpreter's result)
        and every tensor of this call was aligned (what it was specialised for).

        Args:
            kernel: what ``fn[grid](...)`` returned; fn: the ``JITFunction``.
            args: the launch's runtime parameters ``(name, kind, value)`` (kind ``buf``:
                value names a tensor in ``tensors``; ``arg``: a scalar taken from
                ``tensors`` at each call; else the fixed value); constexprs: by name.
        """
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return None
        by_name = {name: (kind in ("buf", "arg"), value) for name, kind, value in args}
        buffers = tuple(value for _, kind, value in args if kind == "buf")
        slots: List[Tuple[bool, Any]] = []
        for p in fn.params:
            name = p.name
            if name in by_name:
                slots.append(by_name[name])
            elif name in constexprs:
                slots.append((False, constexprs[name]))
            elif p.has_default:
                slots.append((False, p.default))
            else:
                return None  # a parameter this launch does not name: leave it to the JIT
        launch = CompiledLaunch(kernel, tuple(int(x) for x in grid), slots, buffers)
        return launch if launch.aligned(tensors) else None

    def aligned(self, tensors: Dict[str, torch.Tensor]) -> bool:
        return all(tensors[n].data_ptr() % ALIGN == 0 for n in self.buffers)

    def __call__(self, tensors: Dict[str, torch.Tensor], stream: int) -> None:
        values = [tensors[v] if is_buf else v for is_buf, v in self._slots]
        g = self._grid
        self._run(g[0], g[1], g[2], stream, self._function, self._packed, None, None, None,
                  *values)


_SWITCH = "FORGE_DIST_JIT_RELAUNCH"
# read from the dict behind os.environ with pre-encoded keys and values (as the ops' front
# reads its switches, forge_dist/ops/planned.py): os.environ.get costs 0.8 us per call
_ENCODE = getattr(os.environ, "encodekey", lambda x: x)
_SWITCH_KEY, _ON, _OFF = _ENCODE(_SWITCH), _ENCODE("1"), _ENCODE("0")


def usable() -> bool:
    """Whether fast relaunches may be used now: ``FORGE_DIST_JIT_RELAUNCH`` is not ``0`` and
    no launch hook is installed."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict:
        raw = data.get(_SWITCH_KEY, _ON)
        if raw == _ON:
            return not _launch_hook_installed()
        if raw == _OFF:
            return False
    raw = os.environ.get(_SWITCH, "1")  # anything else: the public way, and its error
    if raw not in ("0", "1"):
        raise ValueError(f"FORGE_DIST_JIT_RELAUNCH: expected 0 or 1, got {raw!r}")
    return raw == "1" and not _launch_hook_installed()


def _scalar_key(a: Any) -> Any:
    """What Triton 3.6 specialises a non-tensor argument on: an int on being 1, on
    divisibility by 16 and on its width; a bool or float on its type; anything else (None)
    on its value.  The value itself is passed at every call."""
    t = type(a)
    if t is int:
        return (int, a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63)
    if t is float or t is bool:
        return t
    return (t, a)


class KeptLaunches:
    """A Triton kernel launched outside plans (the layers' convolution, norm, gate and rotary
    kernels), each launch kept after its first call.

    Call it as the JIT function's launch, ``kept(grid, *args, **kwargs)``: tensors and scalars
    positional, in parameter order; constexprs and launch options (``num_warps``) by keyword.
    On a GPU, a later call with the same grid and keywords, tensors of the same dtypes and
    devices and scalars of the same specialisation (:func:`_scalar_key`; a sequence length or
    a decoding offset may change) on the same current device relaunches the kernel its first
    call compiled (:class:`CompiledLaunch`) with this call's tensors and scalars: Triton's
    per-call binding costs 15-20 us of host time per launch, and a layer's forward makes five
    to ten such launches around its op.  Pointer alignment is checked on every call, as for
    plans (an unaligned call goes through the JIT); on the CPU, and for an interpreted
    function (``TRITON_INTERPRET=1``), every call goes through the JIT.  At most
    :attr:`LIMIT` signatures are kept per kernel (a full table is emptied).
    """

    LIMIT = 64

    def __init__(self, fn, devices: Tuple[str, ...] = ("cuda",)):
        self.fn = fn
        # where compiled kernels exist (tests fake one on the CPU); none for the interpreter's
        # functions, which have no parameter list and compile nothing
        self._devices = devices if hasattr(fn, "params") else ()
        self._kept: Dict[Any, Tuple[CompiledLaunch, Tuple[int, ...]]] = {}

    def __call__(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        keep = first is not None and first.device.type in self._devices
        key = None
        if keep:
            # Triton launches on the current device's current stream: so does a relaunch
            device = current_device(first)
            key = (tuple(grid), tuple(kwargs.items()), device,
                   tuple((a.dtype, a.get_device()) if isinstance(a, torch.Tensor)
                         else _scalar_key(a) for a in args))
            kept = self._kept.get(key)
            if kept is not None:
                launch, pointers = kept
                if usable() and all(args[i].data_ptr() % ALIGN == 0 for i in pointers):
                    launch(args, raw_stream(device))
                    return
                keep = False  # kept already: this call only takes the JIT's way
        kernel = self.fn[tuple(grid)](*args, **kwargs)
        if keep:
            names = [p.name for p in self.fn.params]
            # every positional argument taken from the call (by position: the call's args
            # tuple is the table), the tensors' alignment checked
            spec = [(names[i], "buf" if isinstance(a, torch.Tensor) else "arg", i)
                    for i, a in enumerate(args)]
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            made = CompiledLaunch.make(kernel, self.fn, grid3, spec, kwargs, args)
            if made is not None:
                if len(self._kept) >= self.LIMIT:
                    self._kept.clear()
                self._kept[key] = (made, made.buffers)


def current_device(t: torch.Tensor) -> int:
    """The current device of ``t``'s kind (where Triton would launch), ``-1`` off CUDA."""
    return torch.cuda.current_device() if t.is_cuda else -1
