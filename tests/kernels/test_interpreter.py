"""The tests' faster Triton interpreter (tests/_interpreter.py) computes bitwise what Triton's
own code does: the scan with hgrn's combine (a tuple of two, forward and reverse) along
either axis of a block, one whose columns are not all real, and a 1-D block; the delta
rule's and hgrn's kernels (helpers called in loops) with the helper calls' patch skipped."""
import contextlib
import os

import pytest
import torch

from forge_dist import kernels

from .. import _interpreter

pytestmark = pytest.mark.skipif(
    not kernels.HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1"
    or _interpreter.original("generic_scan") is None,
    reason="checks the faster Triton CPU interpreter: needs Triton 3.6, interpreted")

if kernels.HAVE_TRITON:
    import triton
    import triton.language as tl

    from forge_dist.kernels.vector_state import _affine

    @triton.jit
    def _scan2d(a, x, oa, ox, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr,
                REVERSE: tl.constexpr):
        offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        b_a, b_x = tl.associative_scan((tl.load(a + offs), tl.load(x + offs)), axis=AXIS,
                                       combine_fn=_affine, reverse=REVERSE)
        tl.store(oa + offs, b_a)
        tl.store(ox + offs, b_x)

    @triton.jit
    def _scan1d(a, x, oa, ox, R: tl.constexpr, REVERSE: tl.constexpr):
        offs = tl.arange(0, R)
        b_a, b_x = tl.associative_scan((tl.load(a + offs), tl.load(x + offs)), axis=0,
                                       combine_fn=_affine, reverse=REVERSE)
        tl.store(oa + offs, b_a)
        tl.store(ox + offs, b_x)


def _inputs(shape):
    g = torch.Generator().manual_seed(0)
    a = torch.rand(*shape, generator=g)
    a[..., -3:] = 0.0  # padded columns: multiplier 0, as past the end of a block
    return a, torch.randn(*shape, generator=g)


def _run(shape, axis, reverse):
    a, x = _inputs(shape)
    oa, ox = torch.empty_like(a), torch.empty_like(x)
    if len(shape) == 1:
        _scan1d[(1,)](a, x, oa, ox, R=shape[0], REVERSE=reverse)
    else:
        _scan2d[(1,)](a, x, oa, ox, R=shape[0], C=shape[1], AXIS=axis, REVERSE=reverse)
    return oa, ox


@contextlib.contextmanager
def _tritons_own_interpreter():
    from triton.runtime import interpreter

    where = {"generic_scan": (interpreter.ScanOps, "generic_scan"),
             "_patch_lang": (interpreter, "_patch_lang"),
             "_patch_builtin": (interpreter, "_patch_builtin"),
             "device_call": (interpreter.InterpretedFunction, "__call__"),
             "_get_np_dtype": (interpreter, "_get_np_dtype"),
             "tuple_type_init": (tl.core.tuple_type, "__init__"),
             "block_type_init": (tl.core.block_type, "__init__")}
    fast = {name: getattr(*at) for name, at in where.items()}
    try:
        for name, (obj, attr) in where.items():
            setattr(obj, attr, _interpreter.original(name))
        yield
    finally:
        for name, (obj, attr) in where.items():
            setattr(obj, attr, fast[name])


def test_the_pytest_process_runs_the_faster_interpreter():
    from triton.runtime import interpreter

    assert interpreter.ScanOps.generic_scan is _interpreter._scan_by_slices
    assert interpreter.InterpretedFunction.__call__ is _interpreter._device_call
    assert interpreter._patch_builtin is _interpreter._patch_builtin_listed
    assert interpreter._get_np_dtype is _interpreter._get_np_dtype
    assert tl.core.block_type.__init__ is _interpreter._block_type_init


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape,axis", [((8, 16), 0), ((8, 16), 1), ((16,), 0)])
def test_scan_by_slices_equals_the_interpreters_loop_bitwise(shape, axis, reverse):
    fast = _run(shape, axis, reverse)
    with _tritons_own_interpreter():
        slow = _run(shape, axis, reverse)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)
    # and it is a scan: the last position holds the composition of every map
    a, x = (t.double() for t in _inputs(shape))
    a, x = (t.flip(axis) for t in (a, x)) if reverse else (a, x)
    h = torch.zeros_like(x.select(axis, 0))
    for i in range(x.shape[axis]):
        h = h * a.select(axis, i) + x.select(axis, i)
    last = fast[1].flip(axis) if reverse else fast[1]
    assert torch.allclose(last.select(axis, -1).double(), h, atol=1e-5)


def _forward(op):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "hgrn":
        inp = {"x": r(1, 70, 40), "g": -torch.rand(1, 70, 40, generator=g)}
    else:  # 70 tokens: a full and a partial 64-token chunk
        k = r(1, 70, 2, 16)
        inp = {"q": r(1, 70, 2, 16), "k": k / k.norm(dim=-1, keepdim=True),
               "v": r(1, 70, 2, 16), "g": -torch.rand(1, 70, 2, generator=g) * 0.2,
               "beta": torch.rand(1, 70, 2, generator=g)}
    return kernels.forward(op, inp, out_dtype=torch.float32)


@pytest.mark.parametrize("op", ["gated_delta_rule", "hgrn"])
def test_kernels_equal_those_under_the_interpreters_own_code(op):
    fast = _forward(op)
    with _tritons_own_interpreter():
        slow = _forward(op)
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)


def test_np_dtype_table_equals_the_interpreters():
    """The table built once answers as Triton's per-call one: every scalar type, pointers,
    blocks of either; a type it lacks raises the same KeyError."""
    fast, own = _interpreter._get_np_dtype, _interpreter.original("_get_np_dtype")
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
               tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
               tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]
    kinds = scalars + [tl.pointer_type(tl.float32), tl.pointer_type(tl.int8, const=True)]
    kinds += [tl.block_type(t, [4, 2]) for t in kinds]
    for t in kinds:
        assert fast(t) == own(t) and fast(t).type is own(t).type, t
    for fn in (fast, own):
        with pytest.raises(KeyError):
            fn(tl.void)


def _types():
    """Types as the interpreter makes them: blocks (of pointers too), and tuples of them
    with and without field names, nested."""
    blocks = [tl.block_type(tl.float32, [4, 2]), tl.block_type(tl.int1, [16]),
              tl.block_type(tl.pointer_type(tl.bfloat16), tl.core.tuple([8, 2]))]
    inner = tl.core.tuple_type([tl.int32, blocks[0]])
    return blocks + [inner, tl.core.tuple_type([inner, tl.core.constexpr_type(3), blocks[2]],
                                               ["a", "b", "c"]),
                     tl.core.tensor(None, blocks[1]).type, tl.core.tuple([1, 2]).type]


def test_types_named_on_first_read_equal_the_interpreters():
    """A block's and a tuple's type made by the inits that format the name on first read
    have the name, string and attributes of Triton's, also after a pickle round trip (which
    carries the name) and when the lists they were made from change later."""
    import pickle

    fast = _types()
    with _tritons_own_interpreter():
        own = _types()
    assert all("name" not in vars(f) and "name" in vars(o) for f, o in zip(fast, own))
    for f, o in zip(fast, own):
        assert type(f) is type(o) and str(f) == str(o) and f.name == o.name and f == o
        assert vars(f) == vars(o), (vars(f), vars(o))  # the name now an attribute too
    # (a block's type holds a language tuple, which does not pickle, under Triton's too)
    scalars = ([tl.int32, tl.core.constexpr_type(3)], ["a", "b"])
    back = pickle.loads(pickle.dumps(tl.core.tuple_type(*scalars)))
    with _tritons_own_interpreter():
        own = tl.core.tuple_type(*scalars)
    assert vars(back) == vars(own) and back.name == own.name == "[a:int32,b:constexpr_type[3]]"
    types = [tl.int32, tl.float16]
    later = tl.core.tuple_type(types)
    types[0] = tl.float64  # (the compiler rewrites a tuple type's list in place)
    assert later.name == "[:int32,:fp16]"
