"""Plan/run on CPU tensors: Triton's interpreter (the same launch programs the GPU runs), the
PyTorch backend, the simulated forge transport, validation errors and the plan cache."""
import ast
import importlib
import inspect
import os
import textwrap


import pytest
import torch

from forge_dist import kernels, ops
from forge_dist.comm.sim import SimWorld
from forge_dist.runtime import PlanError, cache, dispatcher, executor, plan

plan_mod = importlib.import_module("forge_dist.runtime.plan")  # the name `plan` is the function

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="CPU plan tests run the kernels in Triton's interpreter")

B, T, H, K, V = 1, 96, 2, 32, 48  # T: one full and one partial 64-token chunk; V: 2 tiles


def _inputs(op, T=T, seed=0, B=B):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "hgrn":
        return {"x": r(B, T, 40), "g": -torch.rand(B, T, 40, generator=g)}
    d = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V)}
    if op == "gated_delta_rule":
        d["k"] = d["k"] / d["k"].norm(dim=-1, keepdim=True)
        d["beta"] = torch.rand(B, T, H, generator=g)
    if op in ("simple_gla", "gated_delta_rule"):
        d["g"] = -torch.rand(B, T, H, generator=g) * 0.2
    if op == "gla":
        d["g"] = -torch.rand(B, T, H, K, generator=g) * 0.2
    return d


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


CASES = [("linear_attn", "fused"), ("linear_attn", "decoupled"), ("simple_gla", "fused"),
         ("simple_gla", "decoupled"), ("gla", None), ("gated_delta_rule", None), ("hgrn", None)]


@pytest.mark.parametrize("op,execution", CASES)
@pytest.mark.parametrize("h0", [False, True])
def test_plan_matches_kernels_and_reference(op, execution, h0):
    """The plan's program launches exactly what forge_dist.kernels launches (bitwise equal
    under the interpreter) and agrees with the PyTorch reference."""
    inp = _inputs(op)
    if op == "hgrn":
        p = plan(op, B=B, T=T, D=40, dtype=torch.float32, device="cpu", initial_state=h0,
                 output_final_state=True)
        S = torch.randn(B, 40) if h0 else None
    else:
        p = plan(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
                 initial_state=h0, output_final_state=True, execution=execution)
        S = torch.randn(B, H, K, V) if h0 else None
    assert p.backend == "triton"
    if execution is not None:
        assert p.execution == execution
    names = p.input_names
    o, ht = p.run(*[inp[n] for n in names], initial_state=S)
    ko, kh = kernels.forward(op, inp, initial_state=S, out_dtype=torch.float32,
                             execution=execution)
    assert torch.equal(o, ko) and torch.equal(ht, kh)
    ro, rh = p._run_torch(dict(inp), S)
    assert _rel(o, ro) < 1e-5 and _rel(ht, rh) < 1e-5


@pytest.mark.parametrize("op", ["simple_gla", "hgrn"])
def test_bound_run_follows_its_buffers(op):
    """``plan.bind(...)`` checks once and launches on the bound buffers: equal to ``run``,
    and after the inputs are refilled in place the next call follows the new values."""
    first, second = _inputs(op, seed=1), _inputs(op, seed=2)
    if op == "hgrn":
        p = plan(op, B=B, T=T, D=40, dtype=torch.float32, device="cpu", initial_state=True,
                 output_final_state=True)
        h0 = torch.randn(B, 40)
    else:
        p = plan(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
                 initial_state=True, output_final_state=True)
        h0 = torch.randn(B, H, K, V)
    names = p.input_names
    bufs = [first[n].clone() for n in names]
    h0_buf = h0.clone()
    bound = p.bind(*bufs, initial_state=h0_buf)
    o, ht = bound()
    want = p.run(*[first[n] for n in names], initial_state=h0)
    assert torch.equal(o, want[0]) and torch.equal(ht, want[1])
    for buf, n in zip(bufs, names):
        buf.copy_(second[n])
    h0_buf.mul_(-1)
    o2, ht2 = bound()
    assert o2 is o  # the bound output buffer, rewritten
    want2 = p.run(*[second[n] for n in names], initial_state=-h0)
    assert torch.equal(o2, want2[0]) and torch.equal(ht2, want2[1])


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
@pytest.mark.parametrize("h0,dht", [(True, True), (False, False), (True, False)])
def test_hgrn_plan_backward_matches_fp64_autograd(execution, h0, dht):
    """``run_backward`` from the run's outputs: the gradients of x, g and the initial state
    equal fp64 autograd through the token recurrence (one walk, and segments)."""
    from forge_dist.variants.reference import hgrn_ref

    inp = _inputs("hgrn", seed=2)
    gen = torch.Generator().manual_seed(8)
    s0 = torch.randn(B, 40, generator=gen) if h0 else None
    do = torch.randn(B, T, 40, generator=gen)
    d_ht = torch.randn(B, 40, generator=gen) if dht else None
    p = plan("hgrn", B=B, T=T, D=40, dtype=torch.float32, device="cpu", initial_state=h0,
             execution=execution)
    o, _ = p.run(inp["x"], inp["g"], initial_state=s0)
    dx, dg, dS = p.run_backward(inp["g"], o, do, dht=d_ht, initial_state=s0,
                                need_initial_grad=h0)
    kernels_run = [ln["kernel"] for ln in p.describe()["backward_launches"][
        "with dht" if dht else "without dht"]]
    assert kernels_run == (["hgrn_bwd"] if execution == "fused" else
                           ["hgrn_bwd", "hgrn_scan", "hgrn_bwd"])
    leaves = {n: t.double().requires_grad_(True) for n, t in inp.items()}
    s_ref = s0.double().requires_grad_(True) if h0 else None
    o_r, s_r = hgrn_ref(leaves["x"], leaves["g"], initial_state=s_ref, output_final_state=True)
    loss = (o_r * do.double()).sum() + ((s_r * d_ht.double()).sum() if dht else 0)
    loss.backward()
    assert _rel(dx, leaves["x"].grad) < 1e-5 and _rel(dg, leaves["g"].grad) < 1e-5
    if h0:
        assert _rel(dS, s_ref.grad) < 1e-5
    else:
        assert dS is None


def test_run_backward_errors():
    inp = _inputs("hgrn")
    p = plan("hgrn", B=B, T=T, D=40, dtype=torch.float32, device="cpu", initial_state=True)
    o = torch.zeros(B, T, 40)
    with pytest.raises(PlanError, match="^initial_state: the plan was made with"):
        p.run_backward(inp["g"], o, o)
    with pytest.raises(PlanError, match="^dht: the plan was made for shape"):
        p.run_backward(inp["g"], o, o, initial_state=torch.zeros(B, 40), dht=torch.zeros(40))
    with pytest.raises(PlanError, match="^do: the plan was made for dtype"):
        p.run_backward(inp["g"], o, o.double(), initial_state=torch.zeros(B, 40))
    with pytest.raises(PlanError, match="^o: the plan was made for shape"):
        p.run_backward(inp["g"], o[:, 1:], o, initial_state=torch.zeros(B, 40))
    m = _inputs("linear_attn")
    pm = plan("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    with pytest.raises(PlanError, match=r"^run_backward: expected 4 tensors \(q, k, v, do\)"):
        pm.run_backward(m["q"], m["v"], m["v"])
    with pytest.raises(PlanError, match="^k: the plan was made for shape"):
        pm.run_backward(m["q"], m["k"][:, 1:], m["v"], m["v"])
    with pytest.raises(PlanError, match="^do: the plan was made for shape"):
        pm.run_backward(m["q"], m["k"], m["v"], m["q"])
    torch_plan = plan("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32,
                      device="cpu", backend="torch")
    with pytest.raises(PlanError, match="^run_backward: single-device plans on the Triton"):
        torch_plan.run_backward(m["q"], m["k"], m["v"], m["v"])


def test_run_backward_refuses_fused_prologues():
    """A plan with fused prologues differentiates nothing of them: its run_backward would
    return the unmapped op's gradients, so it refuses (the ops' training path never asks)."""
    import torch.fx as fx
    import torch.nn.functional as F

    from forge_dist.dsl import codegen

    graph = fx.symbolic_trace(lambda x: F.elu(x) + 1.0).graph
    feature, _ = codegen.triton_map([n for n in graph.nodes if n.op != "output"])
    m = _inputs("simple_gla")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             maps={"q": feature})
    p.run(*[m[n] for n in p.input_names])
    with pytest.raises(PlanError, match="^run_backward: this plan maps q with fused prologues"):
        p.run_backward(*[m[n] for n in p.input_names], m["v"])


MATRIX_BACKWARD = {"linear_attn": "scalar_backward", "simple_gla": "scalar_backward",
                   "gla": "vector_backward", "gated_delta_rule": "delta_backward"}


@pytest.mark.parametrize("op", list(MATRIX_BACKWARD))
@pytest.mark.parametrize("h0,dht", [(True, True), (False, False)])
def test_matrix_plan_backward_is_the_kernels_backward(op, h0, dht):
    """``run_backward`` of a matrix-state plan launches exactly the launches of the pattern's
    backward function (bitwise equal gradients under the interpreter), and they equal fp64
    autograd through the PyTorch chunk form."""
    from forge_dist.kernels import delta_backward, scalar_backward, vector_backward

    inp = _inputs(op, seed=5)
    gen = torch.Generator().manual_seed(9)
    s0 = torch.randn(B, H, K, V, generator=gen) if h0 else None
    do = torch.randn(B, T, H, V, generator=gen)
    d_ht = torch.randn(B, H, K, V, generator=gen) if dht else None
    p = plan(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             initial_state=h0, output_final_state=True)
    names = p.input_names
    grads = p.run_backward(*[inp[n] for n in names], do, dht=d_ht, initial_state=s0,
                           need_initial_grad=h0)
    assert len(grads) == len(names) + 1
    if op == "gated_delta_rule":
        want = delta_backward.delta_rule_backward(inp["q"], inp["k"], inp["v"], inp["g"],
                                                  inp["beta"], s0, do, d_ht, K ** -0.5)
        want = want[:5] + (want[5],)
    else:
        fn = (vector_backward.vector_decay_backward if op == "gla"
              else scalar_backward.scalar_decay_backward)
        want = fn(inp["q"], inp["k"], inp["v"], inp.get("g"), s0, do, d_ht, K ** -0.5)
        if op == "linear_attn":
            want = want[:3] + want[4:]
    for n, a, b in zip(list(names) + ["initial_state"], grads, want):
        assert (a is None) == (b is None), n
        assert a is None or torch.equal(a, b), n
    # and the gradients themselves, against fp64 autograd of the op's PyTorch path
    leaves = {n: inp[n].double().requires_grad_(True) for n in names}
    s_ref = s0.double().requires_grad_(True) if h0 else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_DIST_KERNELS", "torch")
        args = [leaves[n] for n in names]
        if op == "gated_delta_rule":
            o_r, s_r = ops.gated_delta_rule(*args, initial_state=s_ref, output_final_state=True)
        else:
            o_r, s_r = getattr(ops, op)(*args, initial_state=s_ref, output_final_state=True)
    loss = (o_r * do.double()).sum() + ((s_r * d_ht.double()).sum() if dht else 0)
    loss.backward()
    for n, grad in zip(names, grads):
        assert _rel(grad, leaves[n].grad) < 1e-5, n
    if h0:
        assert _rel(grads[-1], s_ref.grad) < 1e-5
    else:
        assert grads[-1] is None


def test_matrix_plan_backward_drops_its_scratch():
    """The backward's chunk-state stacks are per call: nothing of them stays with the plan,
    and each is dropped after the last launch that reads it."""
    inp = _inputs("gated_delta_rule", seed=3)
    p = plan("gated_delta_rule", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    names = p.input_names
    out = p.run_backward(*[inp[n] for n in names], torch.ones(B, T, H, V))
    exe = p._bwd_execs[False]
    assert exe.workspaces == {}
    allocate_at, free_at = exe.program.lifetimes()
    freed = [n for step in free_at for n in step]
    roles = {n: b.role for n, b in exe.program.buffers.items()}
    assert sorted(freed) == sorted(n for n, r in roles.items() if r == "scratch")
    assert all(roles[n] != "scratch" for n in ("dq", "dk", "dv", "dg", "dbeta"))
    # the chunk states go before the last launch allocates dk, dv, dbeta, dg
    last = len(exe.program.launches) - 1
    assert {"hc", "dhc", "vn"} <= set(free_at[last - 1])
    assert {"dk", "dv", "dbeta", "dg"} <= set(allocate_at[last])
    assert all(torch.isfinite(t).all() for t in out if t is not None)


def test_bind_errors():
    inp = _inputs("simple_gla")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    q, k, v, g = (inp[n] for n in p.input_names)
    with pytest.raises(PlanError, match=r"bind: expected 4 inputs"):
        p.bind(q, k, v)
    with pytest.raises(PlanError, match=r"k: the plan was made for shape"):
        p.bind(q, k[:, :10], v, g)
    with pytest.raises(PlanError, match=r"initial_state: the plan was made with "
                                        r"initial_state=False"):
        p.bind(q, k, v, g, initial_state=torch.zeros(B, H, K, V))
    with pytest.raises(PlanError, match=r"out: the plan was made for dtype"):
        p.bind(q, k, v, g, out=torch.empty(B, T, H, V, dtype=torch.float64))
    sp = plan("simple_gla", B=B, T=64, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
              group=SimWorld(2)[0], strategy="forge")
    with pytest.raises(PlanError, match=r"bind: single-device plans only"):
        sp.bind(*[t[:, :64].contiguous() for t in (q, k, v, g)])
    tp = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
              backend="torch")
    with pytest.raises(PlanError, match=r"torch backend"):
        tp.bind(q, k, v, g)


def test_torch_backend_matches_ops():
    inp = _inputs("simple_gla")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             backend="torch", output_final_state=True, scale=0.3)
    o, ht = p.run(inp["q"], inp["k"], inp["v"], inp["g"])
    ro, rh = ops.simple_gla(inp["q"], inp["k"], inp["v"], inp["g"], scale=0.3,
                            output_final_state=True)
    assert torch.equal(o, ro) and torch.equal(ht, rh)
    assert p.describe()["launches"] == []


def test_out_buffer_and_no_final_state():
    inp = _inputs("linear_attn")
    p = plan("linear_attn", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    out = torch.full((B, T, H, V), float("nan"))
    o, ht = p.run(inp["q"], inp["k"], inp["v"], out=out)
    assert o is out and ht is None and not torch.isnan(out).any()


@pytest.mark.parametrize("op", ["linear_attn", "simple_gla", "gla"])
@pytest.mark.parametrize("P", [2, 3])
def test_sequence_parallel_sim_forge(op, P):
    """Per-rank plans over the simulated NVSHMEM transport, ranks in chain order, three calls
    with different data (epochs advance), against the single-process op."""
    Tl = 64
    world = SimWorld(P)
    plans = [plan(op, B=B, T=Tl, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
                  group=world[r], strategy="forge", initial_state=(r == 0),
                  output_final_state=True) for r in range(P)]
    d = plans[0].describe()
    assert d["strategy"] == "forge" and d["channels"]["transport"] == "sim"
    # gla first gates its chunks (kernels.vector.gate_chunks), the summary part only;
    # simple_gla's walks sum its scalar gates at these lengths (no gate-sum launch)
    # one program per rank: the segment summaries, the state pass, then the output walks
    # that take the incoming state (no second summary walk, no separate scan launch)
    first = {"gla": ["gla_gate"]}.get(op, [])
    launches = d["launches"]
    assert [x["kernel"] for x in launches] == first + ["walk", "walk"]
    assert d["state_pass_before"] == len(launches) - 1
    assert launches[-2]["constexprs"]["STORE_O"] is False
    assert launches[-1]["constexprs"]["SCAN_IN"] is True
    # the last rank keeps no summary nobody reads: one fused walk after the pass
    last = plans[-1].describe()
    assert [x["kernel"] for x in last["launches"]] == first + ["walk"]
    assert last["launches"][-1]["constexprs"]["SCAN_IN"] is False
    for step in range(3):
        inp = _inputs(op, T=P * Tl, seed=step)
        names = plans[0].input_names
        h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(10 + step))
        ref_o, ref_h = getattr(ops, op)(*[inp[n] for n in names], initial_state=h0,
                                        output_final_state=True)
        outs = []
        for r in range(P):
            part = [inp[n][:, r * Tl:(r + 1) * Tl].contiguous() for n in names]
            outs.append(plans[r].run(*part, initial_state=h0 if r == 0 else None))
        o = torch.cat([x[0] for x in outs], dim=1)
        assert _rel(o, ref_o) < 1e-5, (step, _rel(o, ref_o))
        assert _rel(outs[-1][1], ref_h) < 1e-5


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
def test_sequence_parallel_sim_forge_hgrn(execution):
    """hgrn's per-rank plans over the simulated transport (3 ranks, ranks in chain order):
    a rank before the last walks its segments, scans them from zero into its summary and
    passes it (forge folds it as one segment) before its output walks, which carry the
    incoming state in; the last rank walks from it once, or decoupled the same way."""
    P, Tl, D = 3, 48, 40
    world = SimWorld(P)
    plans = [plan("hgrn", B=B, T=Tl, D=D, dtype=torch.float32, device="cpu", group=world[r],
                  strategy="forge", initial_state=(r == 0), output_final_state=True,
                  execution=execution, tiles={"BT": 16, "BD": 64}) for r in range(P)]
    d, last = plans[0].describe(), plans[-1].describe()
    assert [x["kernel"] for x in d["launches"]] == ["hgrn", "hgrn_scan", "hgrn"]
    assert d["state_pass_before"] == 2 and d["launches"][-1]["constexprs"]["HAS_SIN"]
    want_last = ["hgrn"] if execution == "fused" else ["hgrn", "hgrn_scan", "hgrn"]
    assert [x["kernel"] for x in last["launches"]] == want_last
    assert last["state_pass_before"] == len(want_last) - 1
    for step in range(3):
        inp = _inputs("hgrn", T=P * Tl, seed=step)
        h0 = torch.randn(B, D, generator=torch.Generator().manual_seed(10 + step))
        ref_o, ref_h = ops.hgrn(inp["x"], inp["g"], initial_state=h0, output_final_state=True)
        outs = [plans[r].run(*[inp[n][:, r * Tl:(r + 1) * Tl].contiguous() for n in ("x", "g")],
                             initial_state=h0 if r == 0 else None) for r in range(P)]
        o = torch.cat([x[0] for x in outs], dim=1)
        assert _rel(o, ref_o) < 1e-5, (step, _rel(o, ref_o))
        assert _rel(outs[-1][1], ref_h) < 1e-5


def test_validation_errors():
    inp = _inputs("simple_gla")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    q, k, v, g = inp["q"], inp["k"], inp["v"], inp["g"]
    with pytest.raises(PlanError, match=r"expected 4 inputs \(q, k, v, g\), got 3"):
        p.run(q, k, v)
    with pytest.raises(PlanError, match=r"k: the plan was made for shape \(1, 96, 2, 32\)"):
        p.run(q, k[:, :64], v, g)
    with pytest.raises(PlanError, match="v: the plan was made for dtype torch.float32"):
        p.run(q, k, v.double(), g)
    with pytest.raises(PlanError, match="q: expected a contiguous tensor"):
        p.run(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, g)
    with pytest.raises(PlanError, match="g: expected a torch.Tensor, got list"):
        p.run(q, k, v, [0.0])
    with pytest.raises(PlanError, match="initial_state=False"):
        p.run(q, k, v, g, initial_state=torch.zeros(B, H, K, V))
    p0 = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
              initial_state=True)
    with pytest.raises(PlanError, match="initial_state=True; pass it"):
        p0.run(q, k, v, g)
    with pytest.raises(PlanError, match="out: the plan was made for shape"):
        p.run(q, k, v, g, out=torch.empty(1))
    with pytest.raises(PlanError, match="forward-only"):
        p.run(q.requires_grad_(), k, v, g)


@pytest.mark.parametrize("kw,msg", [
    (dict(op="softmax"), "op: expected one of"),
    (dict(backend="magic"), "backend: expected auto"),
    (dict(execution="sideways"), "execution: expected fused"),
    (dict(T=0), "T: expected a positive int"),
    (dict(K=8), r"head dims K=8, V=48 outside \[16, 256\]"),
    (dict(dtype=torch.int32), "dtype: expected float16"),
    (dict(op="gla", gated=False), "gla needs its gate"),
    (dict(op="linear_attn", gated=True), "linear_attn takes no gate"),
    (dict(op="gated_delta_rule", execution="decoupled"), "gated_delta_rule has only the fused"),
    (dict(op="hgrn"), "hgrn: give D"),
    (dict(group=SimWorld(2)[0], op="hgrn", D=16, T=2, train=True),
     "backward of a 2-token shard is one segment"),
    (dict(op="hgrn", D=16, train=True), "a sequence-parallel plan option"),
    (dict(group=SimWorld(2)[0], strategy="lasp2"), "a SimRank group runs only 'forge'"),
    (dict(group=SimWorld(2)[0], backend="torch"), "single-rank"),
])
def test_plan_errors(kw, msg):
    args = dict(op="simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    args.update(kw)
    op = args.pop("op")
    with pytest.raises(PlanError, match=msg):
        plan(op, **args)


def test_hgrn_training_backward_takes_the_gates_and_outputs():
    """hgrn's training backward reads its run's gates and outputs (its states), as its
    one-device run_backward does, not x: misuse is refused before anything launches."""
    from forge_dist.runtime.sp_train import Kept

    p = plan("hgrn", B=1, T=64, D=16, dtype=torch.float32, device="cpu",
             group=SimWorld(2)[1], train=True)
    g, do = -torch.rand(1, 64, 16), torch.randn(1, 64, 16)
    kept = Kept(S_in=torch.zeros(1, 1, 16, 1), M=None, saved=None)
    with pytest.raises(PlanError, match=r"expected 3 tensors \(g, o, do\), got 2"):
        p.run_backward_train(g, do, kept=kept)
    with pytest.raises(PlanError, match="o: the plan was made for shape"):
        p.run_backward_train(g, torch.randn(64), do, kept=kept)


def test_describe_reports_choices():
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             execution="decoupled")
    d = p.describe()
    assert d["execution"] == "decoupled" and d["backend"] == "triton"
    # segment summaries, then the outputs with the scan over segments folded in; both walks
    # sum the scalar gates per chunk themselves at this length (G_RAW)
    assert [x["kernel"] for x in d["launches"]] == ["walk", "walk"]
    assert d["launches"][1]["constexprs"]["SCAN_IN"] is True
    assert all(x["constexprs"]["G_RAW"] is True for x in d["launches"])
    assert d["workspaces"] == {"hs": [2, B, H, K, V], "gt": [2, B, H, K]}
    assert d["launches"][0]["grid"] == [1, B * H, 2]  # V=48 -> one BV=64 tile, 2 segments
    assert all(x["path"] == "jit" for x in d["launches"])
    assert d["inputs"]["g"] == {"shape": [B, T, H], "dtype": "torch.float32"}


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
def test_gate_sum_launch_by_length(monkeypatch, execution):
    """Short inputs sum simple_gla's gates in the walks, longer ones launch the gate sum
    first (kernels.walker.sum_gates_in_walk); the plan follows the kernels' rule and both
    programs give the op's result."""
    from forge_dist.kernels import walker

    inp = _inputs("simple_gla")
    names = ("q", "k", "v", "g")
    ref_o, ref_h = ops.simple_gla(*[inp[n] for n in names], output_final_state=True)
    kernels = {}
    for limit in (B * T, B * T - 1):  # the rule's edge: B * T tokens in, then out
        monkeypatch.setattr(walker, "SUM_GATES_IN_WALK_MAX_TOKENS", limit)
        p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
                 execution=execution, output_final_state=True)
        d = p.describe()
        kernels[limit] = [x["kernel"] for x in d["launches"]]
        raw = [x["constexprs"].get("G_RAW", False) for x in d["launches"] if x["kernel"] == "walk"]
        assert set(raw) == {limit == B * T}
        o, ht = p.run(*[inp[n] for n in names])
        assert _rel(o, ref_o) < 1e-5 and _rel(ht, ref_h) < 1e-5
    walks = ["walk"] * (1 if execution == "fused" else 2)
    assert kernels == {B * T: walks, B * T - 1: ["gate_cumsum"] + walks}


_FORBIDDEN = {"item", "tolist", "synchronize", "cpu", "numpy", "nonzero"}


def _calls(fn):
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


@pytest.mark.parametrize("fn", [
    plan_mod.Plan.run, plan_mod.Plan._check, plan_mod.Plan._run_local, plan_mod.Plan._run_sp,
    plan_mod.Plan.run_backward,
    executor.Executor.__call__, executor.Executor._launch,
    dispatcher.BoundLaunch.launch, dispatcher.BoundLaunch.values,
    dispatcher.ArgPack.pack], ids=lambda f: f.__qualname__)
def test_run_path_has_no_host_sync_in_source(fn):
    """Graph capturability: nothing on the run path reads device values on the host."""
    assert not (_calls(fn) & _FORBIDDEN), _calls(fn) & _FORBIDDEN


def test_run_does_not_sync_at_runtime(monkeypatch):
    """The same, checked while running: item/tolist/synchronize raise if called."""
    inp = _inputs("simple_gla")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             output_final_state=True)
    p.run(inp["q"], inp["k"], inp["v"], inp["g"])  # warm: kernels are built

    def boom(*a, **k):
        raise AssertionError("host sync on the run path")
    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    o, ht = p.run(inp["q"], inp["k"], inp["v"], inp["g"])
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)


def test_plan_cache_lru(monkeypatch):
    cache.clear()
    monkeypatch.setenv("FORGE_DIST_PLAN_CACHE_SIZE", "2")
    kw = dict(B=B, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    a = cache.get("simple_gla", T=64, **kw)
    assert cache.get("simple_gla", T=64, **kw) is a
    assert cache.get("simple_gla", T=64, **dict(kw, device=torch.device("cpu"))) is a
    b = cache.get("simple_gla", T=128, **kw)
    assert b is not a
    cache.get("simple_gla", T=64, **kw)          # a is now most recent
    cache.get("simple_gla", T=192, **kw)         # evicts b
    assert cache.stats() == {"hits": 3, "misses": 3, "evictions": 1, "size": 2}
    assert cache.get("simple_gla", T=128, **kw) is not b
    assert cache.key("gla", T=1, dtype=torch.bfloat16) != cache.key("gla", T=1,
                                                                     dtype=torch.float16)
    a = cache.get("simple_gla", T=64, **kw)
    assert cache.get("simple_gla", T=64, stream=7, **kw) is not a  # one plan per stream
    # keywords in another order, and an unhashable value (tiles): the same plans
    assert cache.get("simple_gla", T=64, **dict(reversed(list(kw.items())))) is a
    t = cache.get("simple_gla", T=64, tiles={"BT": 32}, **kw)
    assert cache.get("simple_gla", T=64, tiles={"BT": 32}, **kw) is t and t is not a
    cache.clear()


def test_program_specs_are_stable():
    """KernelSpec keys name cubins on disk: they must not depend on B or T, except through
    the one rule that picks kernels by length (short inputs sum the gates in the walk)."""
    from forge_dist.kernels.walker import SUM_GATES_IN_WALK_MAX_TOKENS as LIMIT

    def prog(B, T, dtype=torch.bfloat16):
        return kernels.forward_program("simple_gla", B=B, T=T, H=4, K=64, V=64, dtype=dtype,
                                       gated=True, has_h0=False, execution="fused")
    keys = lambda p: [s.key for s in p.specs()]  # noqa: E731
    a, b = prog(1, 64), prog(2, LIMIT // 2)  # short: the walk alone
    assert keys(a) == keys(b) and len(keys(a)) == 1 and a.launches[0].grid != b.launches[0].grid
    c, d = prog(3, LIMIT), prog(1, 4 * LIMIT)  # long: the gate sum, then the walk
    assert keys(c) == keys(d) and len(keys(c)) == 2 and keys(c)[1] != keys(a)[0]
    e = prog(3, LIMIT, torch.float16)
    assert keys(c)[0] == keys(e)[0]  # the gates' chunk sums read g (fp32 both)
    assert keys(c)[1] != keys(e)[1]  # the walk reads bf16 / fp16 q, k, v


def _rank_error(p, inp, h0, ref_o, ref_h, rank: int, P: int, Tl: int) -> float:
    """Run plan ``p`` on this rank's shard of ``inp`` (``h0`` on rank 0): the relative error
    of its output against the whole sequence's ``ref_o``, and on the last rank of its
    final state against ``ref_h``."""
    mine = slice(rank * Tl, (rank + 1) * Tl)
    o, ht = p.run(*[inp[n][:, mine].contiguous() for n in p.input_names],
                  initial_state=h0 if rank == 0 else None)
    err = _rel(o, ref_o[:, mine])
    return max(err, _rel(ht, ref_h)) if rank == P - 1 else err


def _kept_moves(p) -> dict:
    """The device rounds a scan or hier plan keeps (``sp/scan.py``'s ``_KeptMove``): channel
    -> the identities of its send and receive buffers."""
    from forge_dist.sp.scan import _KeptMove

    return {k: (id(v.sent), id(v.into)) for k, v in p._pass_keep.items()
            if isinstance(v, _KeptMove)}


def _sp_plans_world(group, ops_and_strategies):
    """Every rank plans its shard and runs three calls (fresh data each, so forge's epochs
    advance); returns each (op, strategy)'s largest relative error against one process."""
    import torch.distributed as dist

    from forge_dist import sp

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    Tl = 48  # not a multiple of the chunk: the last chunk is partial on every rank
    errors = {}
    for op, strategy, execution, gated, *start in ops_and_strategies:
        zero_start = start == ["zero"]  # rank 0 without an initial state
        if strategy == "hier":  # nodes [0, 1] and [2] (as test_hier.py places its ranks)
            from forge_dist.sp import layout

            os.environ["FORGE_DIST_NODE"] = str(int(rank == 2))
            layout.forget()
        # 16-token chunks (hgrn: blocks): three per shard, so a decoupled run has two segments
        dims = dict(D=40) if op == "hgrn" else dict(H=H, K=K, V=V)
        # (hgrn: 64 channels a program, not 256, for the interpreter's sake)
        tiles = {"BT": 16, "BD": 64} if op == "hgrn" else {"BT": 16}
        p = plan(op, B=B, T=Tl, **dims, dtype=torch.float32, device="cpu",
                 group=group, strategy=strategy, initial_state=rank == 0 and not zero_start,
                 output_final_state=True, execution=execution, tiles=tiles,
                 gated=gated)
        worst = 0.0
        for step in range(3):
            inp = _inputs(op, T=P * Tl, seed=step)
            if gated is False:
                inp.pop("g", None)
            h0 = None if zero_start else torch.randn(
                *((B, 40) if op == "hgrn" else (B, H, K, V)),
                generator=torch.Generator().manual_seed(10 + step))
            ref_o, ref_h = getattr(ops, op)(*[inp[n] for n in p.input_names], initial_state=h0,
                                            output_final_state=True)
            worst = max(worst, _rank_error(p, inp, h0, ref_o, ref_h, rank, P, Tl))
            if step == 0:
                kept = _kept_moves(p)
                kept_out = p._pass_keep.get("scan-fwd-out")
            if step == 0 and op == "hgrn" and strategy == "forge":
                # the op's forward with a group takes such a plan, twice (the second call
                # from its signature), as the matrix-state ops do
                cache.clear()
                mine = slice(rank * Tl, (rank + 1) * Tl)
                os.environ["FORGE_DIST_KERNELS"] = "triton"  # the kernels on CPU tensors
                with torch.no_grad():
                    for _ in range(2):
                        o_op, _ = ops.hgrn(inp["x"][:, mine].contiguous(),
                                           inp["g"][:, mine].contiguous(),
                                           initial_state=h0 if rank == 0 else None,
                                           group=group, strategy=strategy)
                        worst = max(worst, _rel(o_op, ref_o[:, mine]))
                del os.environ["FORGE_DIST_KERNELS"]
                assert cache.stats()["size"] == 1, cache.stats()
        if strategy == "hier":
            # the rounds kept their buffers from the first call on: later calls reuse them
            assert kept and _kept_moves(p) == kept, (rank, strategy, kept, _kept_moves(p))
        if strategy == "scan":
            # these kinds take every round in one launch (forge.run_scan_rounds), into an
            # output buffer the plan keeps from its first call on: no per-round moves
            assert not kept and not _kept_moves(p) and "scan-moves" not in p._pass_keep
            assert kept_out is not None and p._pass_keep["scan-fwd-out"] is kept_out, rank
            if op != "hgrn":  # the rounds kernel folds the segment summaries: no launch of
                # the program folds them first
                kernels_run = [x["kernel"] for x in p.describe()["launches"]]
                assert "segment_scan" not in kernels_run, (rank, kernels_run)
        if strategy == "hier":
            del os.environ["FORGE_DIST_NODE"]
            layout.forget()
        errors[f"{op}{'-ungated' if gated is False else ''}/{strategy}/{execution}"
               f"{'/zero' if zero_start else ''}"] = worst
    sp.flush()
    everyone = [None] * P
    dist.all_gather_object(everyone, errors, group=group)
    return everyone


def test_sequence_parallel_plans_of_every_strategy_over_gloo():
    """Plans on 3 concurrent gloo ranks: forge (the state pass folds the segment summaries
    in its kernel, simulated transport in shared memory) and the baselines (the program
    folds them into the shard's (M, delta) first), every op, against one process."""
    from tests.sp.distributed import run_world

    # simple_gla without its gate: a scalar-decay variant whose transition is the identity
    cases = [(op, s, e, gated) for op, gated in (("linear_attn", None), ("simple_gla", True),
                                                 ("simple_gla", False), ("gla", None))
             for s in ("forge", "serial", "lasp2", "pipelined") for e in (None, "decoupled")]
    # scan's simple_gla with rank 0 from zero (its lean first send), the others from S0;
    # two segments each (decoupled), which the rounds kernel folds on every rank before the
    # last (on rank 0 with S0, the host folds them)
    cases += [(op, "scan", "decoupled", gated, *start) for op, gated, *start in (
        ("linear_attn", None), ("simple_gla", True, "zero"), ("gla", None),
        ("gla", None, "zero"))]
    cases += [("simple_gla", "hier", None, True), ("gla", "hier", None, None, "zero")]
    # hgrn: its folded summary under forge's kernel (one segment; the last rank's one walk),
    # a baseline and scan over two segments (forge's decoupled form: test_..._sim_forge_hgrn)
    cases += [("hgrn", "forge", "fused", None), ("hgrn", "lasp2", "decoupled", None),
              ("hgrn", "scan", "decoupled", None)]
    everyone = run_world(3, _sp_plans_world, cases,
                         env={"TRITON_INTERPRET": "1", "FORGE_DIST_SIM_JITTER_MS": "3",
                              "FORGE_DIST_TIMEOUT": "120"})
    for rank, errors in enumerate(everyone):
        assert set(errors) == {f"{op}{'-ungated' if g is False else ''}/{s}/{e}"
                               f"{'/zero' if start == ['zero'] else ''}"
                               for op, s, e, g, *start in cases}
        bad = {k: v for k, v in errors.items() if not v < 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def _sp_delta_world(group, cases):
    """As :func:`_sp_plans_world`, for the delta rule: every rank plans its shard (96
    tokens: one whole and one partial 64-token chunk) with an initial state on rank 0 or
    none, and runs three calls; returns each case's largest relative error, and each
    rank's launches."""
    import torch.distributed as dist

    from forge_dist import sp

    rank, P = dist.get_rank(group), dist.get_world_size(group)
    Tl = 96

    def step_inputs(gated, with_h0, step):
        inp = _inputs("gated_delta_rule", T=P * Tl, seed=step)
        if not gated:
            inp.pop("g")
        h0 = (torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(10 + step))
              if with_h0 else None)
        return inp, h0

    # the op on the whole sequence, the same for every strategy and every rank (the
    # interpreted kernels: about half a rank's work if each rank ran them all): each rank
    # computes a share, every rank gets them all
    keys = sorted({(gated, with_h0, step) for _, gated, with_h0 in cases for step in range(3)})
    share = {}
    for key in keys[rank::P]:
        inp, h0 = step_inputs(*key)
        share[key] = ops.gated_delta_rule(inp["q"], inp["k"], inp["v"], inp.get("g"),
                                          beta=inp["beta"], initial_state=h0,
                                          output_final_state=True)
    shares = [None] * P
    dist.all_gather_object(shares, share, group=group)
    refs = {key: ref for s in shares for key, ref in s.items()}
    errors, launches = {}, {}
    for strategy, gated, with_h0 in cases:
        p = plan("gated_delta_rule", B=B, T=Tl, H=H, K=K, V=V, dtype=torch.float32,
                 device="cpu", group=group, strategy=strategy,
                 initial_state=rank == 0 and with_h0, output_final_state=True, gated=gated)
        name = f"{strategy}/{'gated' if gated else 'ungated'}/{'h0' if with_h0 else 'zero'}"
        launches[name] = [x["kernel"] + ("/eye" if x["constexprs"].get("H0_EYE") else "")
                          + ("/side" if x["stream"] == "side" else "")
                          for x in p.describe()["launches"]]
        worst = 0.0
        for step in range(3):
            inp, h0 = step_inputs(gated, with_h0, step)
            ref_o, ref_h = refs[gated, with_h0, step]
            worst = max(worst, _rank_error(p, inp, h0, ref_o, ref_h, rank, P, Tl))
            mine = slice(rank * Tl, (rank + 1) * Tl)
            if step == 0 and gated and with_h0:  # the op's forward takes such a plan too
                cache.clear()
                with torch.no_grad():
                    o_op, _ = ops.gated_delta_rule(
                        *[inp[n][:, mine].contiguous() for n in ("q", "k", "v", "g")],
                        beta=inp["beta"][:, mine].contiguous(),
                        initial_state=h0 if rank == 0 else None, group=group,
                        strategy=strategy)
                launches[name + "/op plans"] = cache.stats()["size"]
                worst = max(worst, _rel(o_op, ref_o[:, mine]))
                if strategy == "forge":  # fp32 summaries asked for: the runner, no plan
                    cache.clear()
                    os.environ["FORGE_DIST_DENSE_SUMMARY"] = "fp32"
                    try:
                        with torch.no_grad():
                            o16, _ = ops.gated_delta_rule(
                                *[inp[n][:, mine].half() for n in ("q", "k", "v")],
                                inp["g"][:, mine].contiguous(),
                                beta=inp["beta"][:, mine].contiguous(),
                                initial_state=h0 if rank == 0 else None, group=group,
                                strategy=strategy)
                    finally:
                        del os.environ["FORGE_DIST_DENSE_SUMMARY"]
                    launches[name + "/op plans, fp32 summary"] = cache.stats()["size"]
                    errors[name + "/fp16 through the runner"] = _rel(o16, ref_o[:, mine])
        errors[name] = worst
    sp.flush()
    everyone = [None] * P
    dist.all_gather_object(everyone, (errors, launches), group=group)
    return everyone


def test_delta_rule_sequence_parallel_plans_over_gloo():
    """The delta rule's plans on 3 concurrent gloo ranks, every strategy, with and without
    g and an initial state: a rank before the last walks its shard's state from zero and
    (unless it is rank 0 starting from zero) its dense transition from the identity
    (``H0_EYE``), then the state pass, then the output walk; the last rank keeps no
    summary.  The summary walks go in pieces, behind the WY factors of each, on the side
    stream.  Against the op on the whole sequence in one process."""
    from tests.sp.distributed import run_world

    # every program form (with and without g and h0) under forge and lasp2; the other
    # strategies differ only in the pass, which runs the same program: one or two forms each
    forms = ((True, True), (True, False), (False, True), (False, False))
    cases = [(s, gated, with_h0) for s in ("forge", "lasp2") for gated, with_h0 in forms]
    cases += [("serial", True, True), ("pipelined", True, False), ("scan", True, True),
              ("scan", False, False)]
    everyone = run_world(3, _sp_delta_world, cases,
                         env={"TRITON_INTERPRET": "1", "FORGE_DIST_SIM_JITTER_MS": "3",
                              "FORGE_DIST_TIMEOUT": "120", "FORGE_DIST_KERNELS": "triton",
                              "FORGE_DIST_DENSE_SUMMARY_PIECES": "2"})
    for rank, (errors, launches) in enumerate(everyone):
        bad = {k: v for k, v in errors.items() if not v < (2e-3 if "fp16" in k else 1e-5)}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errors) == len(cases) + 1
        for name, kernels_run in launches.items():
            if name.endswith("/op plans"):
                assert kernels_run == 1, (rank, name)  # the op ran through one plan
                continue
            if name.endswith("fp32 summary"):
                assert kernels_run == 0, (rank, name)
                continue
            gates = ["gate_cumsum"] if "/gated/" in name else []
            if rank == 2:  # the last: no summary
                want = ["wy"] + gates + ["wy"]
            else:
                # the inverses X, then W and U in two pieces of one chunk, each followed on
                # the side stream by the walk of the shard's state from zero over it (and,
                # but on rank 0 from zero, of its transition from the identity)
                side = ["walk/side"]
                if not (rank == 0 and name.endswith("/zero")):
                    side.append("walk/eye/side")
                want = ["wy"] + gates + ["wy"] + side + ["wy"] + ["walk/side"] * len(side)
            assert kernels_run == want + ["walk"], (rank, name, kernels_run)


def _two_rank_scan_world(group):
    """Two ranks, scan plans of the delta rule (a dense transition: a launch per round;
    the other kinds take every round in one launch) from zero: every call after the first
    replays the kept moves on both ranks (one send, one receive), and the outputs stay
    right."""
    import torch.distributed as dist

    from forge_dist import sp

    rank = dist.get_rank(group)
    Tl = 32
    p = plan("gated_delta_rule", B=B, T=Tl, H=H, K=K, V=V, dtype=torch.float32,
             device="cpu", group=group, strategy="scan", output_final_state=True, gated=True)
    worst, replayed = 0.0, []
    for step in range(3):
        inp = _inputs("gated_delta_rule", T=2 * Tl, seed=20 + step)
        ref_o, ref_h = ops.gated_delta_rule(*[inp[n] for n in p.input_names],
                                            output_final_state=True)
        worst = max(worst, _rank_error(p, inp, None, ref_o, ref_h, rank, 2, Tl))
        assert "scan-fwd-out" not in p._pass_keep  # (the fused launch's)
        moves = p._pass_keep.get("scan-moves")
        replayed.append(None if moves is None else moves.calls)
    sp.flush()
    everyone = [None] * 2
    dist.all_gather_object(everyone, (worst, replayed), group=group)
    return everyone


def test_a_two_rank_scan_plan_replays_its_moves_over_gloo():
    from tests.sp.distributed import run_world

    out = run_world(2, _two_rank_scan_world,
                    env={"TRITON_INTERPRET": "1", "FORGE_DIST_SIM_JITTER_MS": "3",
                         "FORGE_DIST_TIMEOUT": "120"})
    for rank, (worst, replayed) in enumerate(out):
        assert worst < 1e-5, (rank, worst)
        assert replayed == [0, 1, 2], (rank, replayed)  # kept after the first call, replayed
