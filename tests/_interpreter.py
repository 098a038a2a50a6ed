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
   c. A helper's re-patch (b), never restored, covers its modules for the rest of the
      running launch: the launch's later helpers over those modules skip theirs, as in (a)
      (~20% of the delta rule's interpreted time).

3. ``_get_np_dtype`` (numpy's type of a Triton type, asked for by nearly every interpreted
   operation) builds its table of 18 types on every call (~7% of the interpreted time):
   here the same table, built once.

4. Every interpreted tensor makes a ``tuple_type`` (its shape, a language tuple) and most a
   ``block_type``, whose inits format a ``name`` string that nothing reads while a kernel
   runs (~8% of the interpreted time).  Their inits here keep what the name is formatted
   from and format it when it is first read: the same string (``__str__``, ``repr``,
   messages), the same attributes otherwise; pickled, an instance carries its name.

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
    covered = set(_langs(fn))  # grows by the helpers' re-patches during the launch (below)
    _running.__dict__.setdefault("langs", []).append(covered)
    restore = scope.restore

    def restore_and_forget():
        running = _running.langs
        del running[next(i for i, c in enumerate(running) if c is covered)]
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
        if running and langs:
            # that patch is never restored: the launch's later helpers over these modules
            # would find nothing left to patch (only the launch's end restores anything)
            running[-1].update(langs)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e


_NP_TYPES = {}  # Triton's scalar types -> numpy's (the table _get_np_dtype builds per call)


def _get_np_dtype(tt_dtype):
    """``interpreter._get_np_dtype`` with its table built once (at install), not per call."""
    import numpy as np
    import triton.language as tl

    if isinstance(tt_dtype, tl.pointer_type):
        return np.dtype(np.uint64)
    if isinstance(tt_dtype, tl.block_type):
        if isinstance(tt_dtype.element_ty, tl.pointer_type):
            return np.dtype(np.uint64)
        return _NP_TYPES[tt_dtype.element_ty]
    return _NP_TYPES[tt_dtype]


_NAME_PARTS = "_forge_dist_tests_name_parts"  # instance key: what the name is formatted from


class _NameOnFirstRead:
    """The ``name`` of a ``tuple_type`` or ``block_type`` made by the inits below: formatted
    the first time it is read, from what Triton's init formats it from (as they were at
    init), then an ordinary attribute of the instance, as Triton's init leaves it."""

    def __init__(self, fmt):
        self._fmt = fmt

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        d = obj.__dict__
        name = d.get("name")  # (another thread's first read may have just set it)
        if name is None:
            name = d["name"] = self._fmt(*d[_NAME_PARTS])
        d.pop(_NAME_PARTS, None)
        return name


def _tuple_type_init(self, types, fields=None):
    """``tuple_type.__init__`` without formatting the name (see :class:`_NameOnFirstRead`)."""
    self.types = types
    self.fields = fields or [''] * len(types)
    self.__dict__[_NAME_PARTS] = (list(self.fields), list(self.types))


def _tuple_type_name(fields, types) -> str:
    return '[' + ','.join([f"{k}:{v}" for k, v in zip(fields, types)]) + ']'


def _block_type_init(self, element_ty, shape):
    """``block_type.__init__`` without formatting the name (see :class:`_NameOnFirstRead`)."""
    from triton.language import core

    self.element_ty = element_ty
    assert (isinstance(shape, (list, core.tuple)))
    self.shape = core.tuple(core._unwrap_shape(shape))
    if not self.shape:
        raise TypeError('0d block_type is forbidden')
    self.numel = core.validate_block_shape(self.shape)
    self.__dict__[_NAME_PARTS] = (list(self.shape.values), element_ty)


def _block_type_name(shape_values, element_ty) -> str:
    # Triton's f'<{self.shape}, {self.element_ty}>', the shape a language tuple
    return f"<{str([str(x) for x in shape_values])}, {element_ty}>"


def _getstate_named(self):
    """Pickled with its name (as Triton's own instances are)."""
    self.name  # noqa: B018 - formats it into the instance
    return self.__dict__


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
    import numpy as np

    # Triton's table, in its order (the keys compare by name: bfloat16 and the fp8 types are
    # stored as the unsigned integers of their width)
    _NP_TYPES.update({
        tl.int1: np.dtype(bool), tl.float16: np.dtype(np.float16),
        tl.float32: np.dtype(np.float32), tl.float64: np.dtype(np.float64),
        tl.int8: np.dtype(np.int8), tl.uint8: np.dtype(np.uint8),
        tl.int16: np.dtype(np.int16), tl.uint16: np.dtype(np.uint16),
        tl.int32: np.dtype(np.int32), tl.uint32: np.dtype(np.uint32),
        tl.int64: np.dtype(np.int64), tl.uint64: np.dtype(np.uint64),
        tl.bfloat16: np.dtype(np.uint16), tl.float8e5: np.dtype(np.uint8),
        tl.float8e5b16: np.dtype(np.uint8), tl.float8e4nv: np.dtype(np.uint8),
        tl.float8e4b8: np.dtype(np.uint8), tl.float8e4b15: np.dtype(np.uint8)})
    _ORIGINAL.update(generic_scan=interpreter.ScanOps.generic_scan,
                     _patch_lang=interpreter._patch_lang,
                     _patch_builtin=interpreter._patch_builtin,
                     device_call=interpreter.InterpretedFunction.__call__,
                     _get_np_dtype=interpreter._get_np_dtype)
    interpreter._get_np_dtype = _get_np_dtype
    core = tl.core
    _ORIGINAL.update(tuple_type_init=core.tuple_type.__init__,
                     block_type_init=core.block_type.__init__)
    core.tuple_type.__init__ = _tuple_type_init
    core.block_type.__init__ = _block_type_init
    core.tuple_type.name = _NameOnFirstRead(_tuple_type_name)
    core.block_type.name = _NameOnFirstRead(_block_type_name)
    core.tuple_type.__getstate__ = _getstate_named
    core.block_type.__getstate__ = _getstate_named
    interpreter.ScanOps.generic_scan = _scan_by_slices
    interpreter._patch_lang = _patch_lang_of_launch
    interpreter._patch_builtin = _patch_builtin_listed
    interpreter.InterpretedFunction.__call__ = _device_call


def original(name: str):
    """Triton's own ``generic_scan``, ``_patch_lang``, ``_patch_builtin``, ``device_call``,
    ``_get_np_dtype``, ``tuple_type_init`` or ``block_type_init`` (for the equality tests);
    ``None`` before :func:`install`."""
    return _ORIGINAL.get(name)


def install_if_interpreting() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        install()
