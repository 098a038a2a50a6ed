"""Speedups of Triton 3.6's CPU interpreter for the tests (the emulator only: compiled
kernels are not affected, and the interpreted kernels compute bitwise the same values;
tests/kernels/test_interpreter.py checks both against Triton's own code).

1. ``tl.associative_scan`` with a custom combine function: Triton's ``ScanOps.generic_scan``
   calls the combine function once per *element* of the block, in Python.  hgrn's kernels
   (kernels/vector_state.py, the only user) spent ~90% of their interpreted time there
   (220 of the 330 s of tests/runtime/test_sp_train.py).  A combine function is
   elementwise, so calling it once per *position along the axis* on the whole slice across
   the other axes does the same float operations on every element in the same order.

2. A call of a ``@triton.jit`` helper from inside a kernel (``InterpretedFunction.__call__``,
   also ``tl.sum``, ``tl.zeros`` and the like) re-patches the language modules each time
   (``_patch_lang``), ~half the interpreted time of the delta rule's kernels, whose helpers
   run in loops; most of it is ``_patch_builtin``'s ``inspect.getmembers`` over ``tl``,
   ``tl.core``, ``tl.tensor``, ``tl.math`` to find the members still to patch.
   a. While a launch runs, its own patch already covers the modules a helper sees when the
      helper's modules are among the kernel's: then the re-patch is skipped (it would find
      nothing left to patch and replace a few patched members with equivalent ones).
   b. Otherwise (``tl.sum``'s ``tl.core``) ``_patch_builtin`` looks only at the names that
      hold Triton builtins in the unpatched modules (listed once, at install), in the same
      order, patching those that still hold one: the same patches as Triton's scan of
      every member, since only those names can hold one (a patch's restore puts the
      original back).

Installed (Triton 3.6 only, the version the tests pin) in the pytest process
(tests/conftest.py) and in the ranks it spawns, which import the ``tests`` package when they
load their function (tests/__init__.py); other processes (the CLI's ranks, subprocess
scripts) run Triton's own interpreter: slower, the same values.
"""
from __future__ import annotations

import os
import threading

_ORIGINAL = {}


def _scan_by_slices(self, input):
    """``ScanOps.generic_scan`` with one combine call per position along ``self.axis``."""
    import numpy as np
    import triton.language as tl

    data = [arg.handle.data for arg in input]
    out = [np.zeros(d.shape, dtype=d.dtype) for d in data]
    lead = (slice(None),) * self.axis
    for i in range(data[0].shape[self.axis]):
        at = lead + (i,)
        if i == 0:
            for d, o in zip(data, out):
                o[at] = d[at]
            continue
        prev = lead + (i - 1,)
        # the accumulator is read back from the output (cast to the input's dtype), as
        # Triton's loop does
        acc = [self.to_tensor(o[prev], arg.dtype) for o, arg in zip(out, input)]
        cur = [self.to_tensor(d[at], arg.dtype) for d, arg in zip(data, input)]
        ret = self.combine_fn.fn(*acc, *cur)
        ret = ret if isinstance(ret, tuple) else (ret,)
        for o, r in zip(out, ret):
            # a 0-d slice comes back as a one-element array (to_tensor's scalar form)
            value = r.handle.data if isinstance(r, tl.core.tensor) else r
            o[at] = np.reshape(value, o[at].shape) if np.ndim(value) else value
    return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input)]


_running = threading.local()  # .langs: per launch running in this thread, what it patched
_langs_of = {}  # function -> the language modules in its globals (as _patch_lang finds them)


def _langs(fn) -> frozenset:
    if fn not in _langs_of:
        import inspect

        import triton.language as tl

        _langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
    return _langs_of[fn]


def _patch_lang_of_launch(fn):
    """The launch's ``_patch_lang`` (GridExecutor's only): remembers what it covers until
    the launch restores it."""
    scope = _ORIGINAL["_patch_lang"](fn)
    langs = _langs(fn)
    _running.__dict__.setdefault("langs", []).append(langs)
    restore = scope.restore

    def restore_and_forget():
        _running.langs.remove(langs)
        restore()

    scope.restore = restore_and_forget
    return scope


def _device_call(self, *args, **kwargs):
    """``InterpretedFunction.__call__`` (a helper called from a kernel), re-patching the
    language only where the running launch's patch does not cover the helper's modules."""
    from triton.runtime.errors import InterpreterError

    running = getattr(_running, "langs", None)
    langs = _langs(self.fn)
    # (a helper without the language in its globals: Triton's own patch, which refuses it)
    if not (running and langs and langs <= running[-1]):
        _ORIGINAL["_patch_lang"](self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e


_builtin_names = {}  # module or class -> its members' names that hold builtins unpatched


def _patch_builtin_listed(pkg, builder, scope):
    """``interpreter._patch_builtin`` over the names listed at install."""
    import triton.language as tl
    from triton.runtime import interpreter

    names = _builtin_names.get(pkg)
    if names is None:  # not one of the language's modules: Triton's own scan
        return _ORIGINAL["_patch_builtin"](pkg, builder, scope)
    for name in names:
        member = getattr(pkg, name)
        if tl.core.is_builtin(member):
            interpreter._patch_attr(pkg, name, member, builder, scope)


def install() -> None:
    """Install the speedups (once per process, before any kernel ran, so the language is
    unpatched; no-op without Triton)."""
    if _ORIGINAL:
        return
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    if not triton.__version__.startswith("3.6."):
        return  # the replacements follow 3.6's private code (the tests pin it): others run theirs
    import inspect

    import triton.language as tl

    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        _builtin_names[pkg] = [name for name, member in inspect.getmembers(pkg)
                               if tl.core.is_builtin(member)]
    _ORIGINAL.update(generic_scan=interpreter.ScanOps.generic_scan,
                     _patch_lang=interpreter._patch_lang,
                     _patch_builtin=interpreter._patch_builtin,
                     device_call=interpreter.InterpretedFunction.__call__)
    interpreter.ScanOps.generic_scan = _scan_by_slices
    interpreter._patch_lang = _patch_lang_of_launch
    interpreter._patch_builtin = _patch_builtin_listed
    interpreter.InterpretedFunction.__call__ = _device_call


def original(name: str):
    """Triton's own ``generic_scan``, ``_patch_lang``, ``_patch_builtin`` or ``device_call``
    (for the equality tests); ``None`` before :func:`install`."""
    return _ORIGINAL.get(name)


def install_if_interpreting() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        install()
