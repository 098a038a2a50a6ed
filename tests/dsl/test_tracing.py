"""Tracing, symbolic shapes, classification and compile-time rejections."""
import inspect

import pytest
import torch

from forge_dist import dsl
from forge_dist.dsl import DSLError


def _T(x):
    return x.transpose(-1, -2)


def chunk(k, v):
    return _T(k) @ v


def merge(state, q, k, v, scale):
    return scale * ((q @ _T(k)).tril() @ v + q @ state)


def line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    for i, s in enumerate(src):
        if text in s:
            return start + i
    raise AssertionError(text)


def compile_decay(decay, **kw):
    return dsl.variant("t", chunk_mode=chunk, decay_mode=decay, merge_mode=merge,
                       inputs={"q": "K", "k": "K", "v": "V", **kw.pop("extra", {})}, **kw)


@pytest.mark.parametrize("decay,kind", [
    (lambda state, chunk_state: state + chunk_state, "identity"),
    (lambda state, chunk_state: 0.9 * state + chunk_state, "scalar"),
    (lambda state, chunk_state, q: state * q.sum((-1, -2)).sigmoid()[..., None, None]
     + chunk_state, "scalar"),
    (lambda state, chunk_state, k: state * k[..., -1, :, None].sigmoid() + chunk_state,
     "diagonal"),
    (lambda state, chunk_state, k: (state - _T(k) @ (k @ state)) * 0.5 + chunk_state, "dense"),
    (lambda state, chunk_state, k: _T(_T(state) @ (_T(k) @ k)) + chunk_state, "dense"),
    (lambda state, chunk_state, k: state - state.sum(-2, keepdim=True) * 0.1 + chunk_state,
     "dense"),
])
def test_classification(decay, kind):
    v = compile_decay(decay)
    assert v.kind.value == kind
    assert v.numeric_check.startswith("passed")
    assert kind in v.describe()


def test_symbolic_shapes_recorded():
    v = compile_decay(lambda state, chunk_state: state + chunk_state)
    out = [n for n in v.chunk.gm.graph.nodes if n.op == "output"][0].args[0]
    assert v.chunk.node_shape(out) == ("B", "H", "NT", "K", "V")
    shapes = set(v.merge.shapes.values())
    assert ("B", "H", "NT", "C", "C") in shapes  # q @ k^T: symbolic chunk length


def test_chunk_length_generic():
    """One trace serves every chunk length: results do not depend on chunk_size."""
    from forge_dist.dsl import builtins
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 29, 2, d, dtype=torch.float64) for d in (4, 4, 3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 29, 2, dtype=torch.float64))
    a = builtins.simple_gla(q, k, v, g, chunk_size=5)[0]
    b = builtins.simple_gla(q, k, v, g, chunk_size=64)[0]
    assert torch.allclose(a, b, atol=1e-12)


# ---- rejections: the message names the op and the user's source line --------------------

def ttt_decay(state, chunk_state, k):
    h = torch.nn.functional.gelu(k @ state)
    return state - _T(k) @ h + chunk_state


def quad_decay(state, chunk_state):
    return state * state + chunk_state


def v_axis_decay(state, chunk_state, v):
    return state * v[..., -1:, :] + chunk_state


def right_mul_decay(state, chunk_state, v):
    return state @ (_T(v) @ v) + chunk_state


def nonlinear_merge(state, q, k, v, scale):
    return torch.tanh(q @ state) + (q @ _T(k)).tril() @ v


def test_rejects_ttt_mlp():
    with pytest.raises(DSLError) as e:
        compile_decay(ttt_decay)
    msg = str(e.value)
    assert "gelu" in msg and "not affine" in msg
    assert f":{line_of(ttt_decay, 'gelu')}:" in msg and "TTT" in msg


def test_rejects_quadratic():
    with pytest.raises(DSLError, match=r"mul.*multiplies or divides two state-dependent") as e:
        compile_decay(quad_decay)
    assert f":{line_of(quad_decay, 'state * state')}:" in str(e.value)


def test_rejects_v_axis_factor():
    with pytest.raises(DSLError, match="varies along the state's V axis") as e:
        compile_decay(v_axis_decay)
    assert f":{line_of(v_axis_decay, 'v[..., -1:')}:" in str(e.value)


def test_rejects_right_multiplication():
    with pytest.raises(DSLError, match="contracting its V axis"):
        compile_decay(right_mul_decay)


def test_rejects_nonlinear_merge():
    with pytest.raises(DSLError, match=r"merge_mode: torch.tanh at .*not affine") as e:
        dsl.variant("t", chunk_mode=chunk, decay_mode=lambda state, chunk_state: state + chunk_state,
                    merge_mode=nonlinear_merge)
    assert f":{line_of(nonlinear_merge, 'tanh')}:" in str(e.value)


def control_flow_chunk(k, v):
    if k.sum() > 0:
        return _T(k) @ v
    return _T(k) @ v


def inplace_decay(state, chunk_state):
    state.mul_(0.5)
    return state + chunk_state


def test_reports_unsupported_control_flow():
    with pytest.raises(DSLError, match=r"chunk_mode: unsupported operation at .*:\d+: if k.sum"):
        dsl.variant("t", chunk_mode=control_flow_chunk,
                    decay_mode=lambda state, chunk_state: state + chunk_state, merge_mode=merge)


def test_reports_inplace():
    with pytest.raises(DSLError, match="Tensor.mul_ at .*in-place") as e:
        compile_decay(inplace_decay)
    assert f":{line_of(inplace_decay, 'mul_')}:" in str(e.value)


def test_reports_shape_errors():
    with pytest.raises(DSLError, match=r"chunk_mode: returns shape \[B, H, NT, V, K\]"):
        dsl.variant("t", chunk_mode=lambda k, v: _T(v) @ k,
                    decay_mode=lambda state, chunk_state: state + chunk_state, merge_mode=merge)
    with pytest.raises(DSLError, match=r"failed at .*: .*"):  # K and V cannot be added
        dsl.variant("t", chunk_mode=lambda k, v: _T(k + v) @ v,
                    decay_mode=lambda state, chunk_state: state + chunk_state, merge_mode=merge)


def test_decay_ignoring_state_rejected():
    with pytest.raises(DSLError, match="does not depend on 'state'"):
        compile_decay(lambda state, chunk_state: chunk_state * 1.0)


def test_vector_state_rejects_mixing():
    with pytest.raises(DSLError, match="D axis"):
        dsl.variant("t", state="vector",
                    chunk_mode=lambda x: x.sum(-2),
                    decay_mode=lambda state, chunk_state: state.sum(-1, keepdim=True) + chunk_state,
                    merge_mode=lambda state, x: x + state[..., None, :])


def test_cross_checks_arguments():
    from forge_dist.dsl import library
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="v: expected shape"):
        library.retnet(q, q, torch.randn(1, 9, 2, 3))
    with pytest.raises(TypeError, match="missing input"):
        library.retnet(q, q)


@pytest.mark.parametrize("name", ["linear_attn", "simple_gla", "gla", "gated_delta_rule"])
def test_merge_offset_is_the_merge_at_a_zero_state(name):
    """``merge_offset`` (the merge with its state-dependent terms dropped, the state unused)
    equals ``merge_mode`` at a zero state, with the offsets that pass through later ops
    (``scale * (intra + q @ S)``) kept."""
    from forge_dist.dsl import builtins

    v = builtins.BUILTINS[name]
    gen = torch.Generator().manual_seed(0)
    B, H, NT, C, K, V = 1, 2, 3, 4, 5, 6
    dims = {"q": K, "k": K, "v": V, "u": V, "w": K, "g": K if name == "gla" else None}
    args = {p: torch.randn(B, H, NT, C, *((dims[p],) if dims.get(p) else ()), generator=gen,
                           dtype=torch.float64) for p in v.merge.params if p in dims}
    args["scale"] = 0.3
    zero = dict(args, state=torch.zeros(B, H, NT, K, V, dtype=torch.float64))
    want = v.merge.gm(*[zero[p] for p in v.merge.params])
    got = v.merge_offset(*[dict(args, state=None)[p] for p in v.merge.params])
    assert want.abs().max() > 0.1 and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_merge_offset_of_a_bare_number_is_none():
    def merge(state, q, k, v, scale):
        return scale * (q @ state) + 1.0
    v = dsl.variant("offset_number", chunk_mode=lambda k, v: k.transpose(-1, -2) @ v,
                    decay_mode=lambda state, chunk_state: state + chunk_state,
                    merge_mode=merge, inputs=("q", "k", "v"), lower=False)
    assert v.merge_offset is None


@pytest.mark.parametrize("read", ["dtype", "shape"])
def test_a_merge_that_reads_the_states_metadata_compiles_without_an_offset_graph(read):
    """``q.to(state.dtype)`` / ``state.shape[-1]``: state-free values that read the state
    compile and lower as before; the offset graph, which has no state, is not made."""
    from forge_dist.dsl import builtins

    def merge(state, q, k, v, g, scale):
        q = q.to(state.dtype) if read == "dtype" else q * (state.shape[-1] / state.shape[-1])
        return builtins._sg_merge(state, q, k, v, g, scale)
    var = dsl.variant(f"meta_{read}", chunk_mode=builtins._sg_chunk,
                      decay_mode=builtins._sg_decay, merge_mode=merge,
                      inputs=("q", "k", "v", "g"))
    assert var.merge_offset is None
    assert var.lowering is not None and var.lowering.template == "simple_gla"


def test_an_offset_graph_that_disagrees_with_the_merge_at_zero_is_dropped(monkeypatch):
    """Compilation checks ``merge_offset`` against ``merge_mode`` at a zero state; one that
    disagrees (here: the right graph's values doubled) is not used."""
    from forge_dist.dsl import analysis, builtins

    real = analysis.offset_part

    def wrong(phase, dependent):
        gm = real(phase, dependent)
        return None if gm is None else (lambda *a: 2 * gm(*a))
    monkeypatch.setattr(analysis, "offset_part", wrong)
    var = dsl.variant("wrong_offset", chunk_mode=builtins._sg_chunk,
                      decay_mode=builtins._sg_decay, merge_mode=builtins._sg_merge,
                      inputs=("q", "k", "v", "g"), lower=False)
    assert var.merge_offset is None
    monkeypatch.setattr(analysis, "offset_part", real)
    var = dsl.variant("right_offset", chunk_mode=builtins._sg_chunk,
                      decay_mode=builtins._sg_decay, merge_mode=builtins._sg_merge,
                      inputs=("q", "k", "v", "g"), lower=False)
    assert var.merge_offset is not None
