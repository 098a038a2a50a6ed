"""Static dispatcher and plans on real GPUs (skipped without them).

* ``gpu``: every variant's static plan (AOT cubins through the CUDA driver) equals the same
  plan through Triton's JIT, and so does its bound run (``plan.bind``); a CUDA graph of a static plan replays correctly with inputs
  changing between replays; both driver bindings (cuda.bindings, ctypes) work.
* ``multigpu``: 1000 CUDA-graph replays of a 2-rank forge step (forge_graph_worker.py under
  torchrun), each with different inputs than the one before, all correct; then 1000 more
  back to back without host sync (the chain's epoch lives on the device).
"""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
B, T, H, K, V, D = 1, 1000, 4, 128, 128, 512   # T: a partial last chunk


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(op, seed=0, T=T):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    bf = torch.bfloat16
    if op == "hgrn":
        return [r(B, T, D).to(bf), torch.nn.functional.logsigmoid(r(B, T, D) + 2).to(bf)]
    q, k, v = r(B, T, H, K).to(bf), r(B, T, H, K), r(B, T, H, V).to(bf)
    if op == "gated_delta_rule":
        k = torch.nn.functional.normalize(k, dim=-1)
    out = [q, k.to(bf), v]
    if op in ("simple_gla", "gated_delta_rule"):
        out.append(torch.nn.functional.logsigmoid(r(B, T, H) + 4))
    if op == "gla":
        out.append(torch.nn.functional.logsigmoid(r(B, T, H, K) + 4))
    if op == "gated_delta_rule":
        out.append(torch.rand(B, T, H, device="cuda", generator=gen))
    return out


CASES = [("linear_attn", "fused"), ("simple_gla", "fused"), ("simple_gla", "decoupled"),
         ("gla", None), ("gated_delta_rule", None), ("hgrn", None)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    os.environ.pop("TRITON_INTERPRET", None)
    from forge_dist.runtime import aot

    major, minor = torch.cuda.get_device_capability()
    d = tmp_path_factory.mktemp("aot_gpu")
    cfg = dict(heads=[H], head_dims=[[K, V]], hgrn_dims=[D], dtypes=["bfloat16"],
               sequence_parallel=False)
    rep = aot.compile_all(cfg, target=f"cuda:{major}{minor}", cache_dir=d)
    assert rep["compiled"], rep
    return d


def _plan(op, execution, backend, cache_dir, **kw):
    from forge_dist.runtime import plan

    if op == "hgrn":
        return plan(op, B=B, T=T, D=D, dtype=torch.bfloat16, backend=backend,
                    cache_dir=cache_dir, output_final_state=True, **kw)
    return plan(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, backend=backend,
                cache_dir=cache_dir, execution=execution, output_final_state=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("op,execution", CASES)
def test_static_equals_jit(cache_dir, op, execution):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    ps = _plan(op, execution, "static", cache_dir)
    pj = _plan(op, execution, "triton", cache_dir)
    assert all(x["path"].startswith("cubin") for x in ps.describe()["launches"]), ps.describe()
    x = _inputs(op)
    os_, hs = ps.run(*x)
    oj, hj = pj.run(*x)
    torch.cuda.synchronize()
    assert _rel(os_, oj) < 1e-3 and _rel(hs, hj) < 1e-4
    ro, rh = ps._run_torch(dict(zip(ps.input_names, [t.float() for t in x])), None)
    assert _rel(os_, ro) < 5e-3 and _rel(hs, rh) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("op,execution", [("simple_gla", "fused"), ("gla", None)])
def test_bound_static_run_equals_run(cache_dir, op, execution):
    """``plan.bind`` on the static backend launches the same cubins as ``run``; refilled
    inputs give the new result."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    p = _plan(op, execution, "static", cache_dir)
    x1, x2 = _inputs(op, seed=1), _inputs(op, seed=2)
    bufs = [t.clone() for t in x1]
    bound = p.bind(*bufs)
    o, h = bound()
    r1 = p.run(*x1)
    torch.cuda.synchronize()
    assert torch.equal(o, r1[0]) and torch.equal(h, r1[1])
    for b, t in zip(bufs, x2):
        b.copy_(t)
    o, h = bound()
    r2 = p.run(*x2)
    torch.cuda.synchronize()
    assert torch.equal(o, r2[0]) and torch.equal(h, r2[1])


@pytest.mark.gpu
@pytest.mark.parametrize("op,execution", CASES)
def test_jit_plans_relaunch_their_compiled_kernels(op, execution):
    """After its first call a JIT plan relaunches each compiled kernel directly
    (kernels/jit_launch.py) through its specialised run (runtime/fastpath.py): same results
    as the first call and as a fresh plan's JIT call;
    an input at an unaligned address goes back through the JIT and stays correct."""
    p = _plan(op, execution, "triton", None)
    x = _inputs(op)
    assert "run" not in vars(p)
    o1, h1 = p.run(*x)
    assert all(c is not None for c in p.finish_exec._compiled)
    # run is now specialised to the compiled kernels (runtime/fastpath.py)
    assert "run" in vars(p) and "relaunch_usable()" in p.run.__source__
    o2, h2 = p.run(*x)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    x2 = _inputs(op, seed=3)
    o3, _ = p.run(*x2)
    o3_ref, _ = _plan(op, execution, "triton", None).run(*x2)  # a fresh plan: its first
    torch.cuda.synchronize()                                     # call goes through the JIT
    assert torch.equal(o3, o3_ref)
    first = x2[0]
    shifted = torch.empty(first.numel() + 8, dtype=first.dtype, device="cuda")[1:]
    shifted = shifted[:first.numel()].view(first.shape)  # 2 bytes past a 16-byte boundary
    shifted.copy_(first)
    o4, _ = p.run(shifted, *x2[1:])
    torch.cuda.synchronize()
    assert torch.equal(o4, o3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["static", "triton"])
def test_hgrn_plan_backward_on_the_gpu(cache_dir, backend):
    """The hgrn backward program (static cubins, or JIT relaunches) against fp32 autograd
    of the PyTorch chunk form."""
    if backend == "static" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    from forge_dist.variants import vector_state

    p = _plan("hgrn", None, backend, cache_dir, initial_state=True)
    x, g = _inputs("hgrn", seed=4)
    gen = torch.Generator(device="cuda").manual_seed(5)
    s0 = torch.randn(B, D, device="cuda", generator=gen)
    do = torch.randn(B, T, D, device="cuda", generator=gen).to(x.dtype)
    dht = torch.randn(B, D, device="cuda", generator=gen)
    o, _ = p.run(x, g, initial_state=s0)
    for _ in range(2):  # the second call relaunches (triton) what the first compiled
        dx, dg, dS = p.run_backward(g, o, do, dht=dht, initial_state=s0,
                                    need_initial_grad=True)
    if backend == "static":
        paths = [ln["path"] for ln in p.describe()["backward_launches"]["with dht"]]
        assert all(x.startswith("cubin") for x in paths), paths
    xf, gf = x.float().requires_grad_(True), g.float().requires_grad_(True)
    sf = s0.clone().requires_grad_(True)
    summ = vector_state.summarize(xf, gf, need_transition=False)
    o_part, s_part = summ.readout(sf[:, None, :, None])
    o_ref = summ.o_zero + o_part
    ht_ref = summ.delta.reshape(B, D) + s_part.reshape(B, D)
    ((o_ref * do.float()).sum() + (ht_ref * dht).sum()).backward()
    assert _rel(dx, xf.grad) < 1e-2 and _rel(dg, gf.grad) < 1e-2 and _rel(dS, sf.grad) < 1e-2



@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["static", "triton"])
@pytest.mark.parametrize("op", ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"])
def test_backward_programs_run_specialised(cache_dir, backend, op):
    """From its second call a plan's backward program runs its straight-line code
    (``fastpath.specialise_program``): gradients bitwise equal to the first, general call's;
    on the Triton backend an unaligned ``do`` goes through the general call (the JIT) and
    gives them too."""
    if backend == "static" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    p = _plan(op, None, backend, cache_dir)
    x = _inputs(op, seed=6)
    o, _ = p.run(*x)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    first = p.run_backward(*((x[1], o, do) if op == "hgrn" else (*x, do)))
    exe = p._bwd_execs[False]
    assert exe._fast is not None, exe.paths
    if backend == "static":
        assert all(path.startswith("cubin") for path in exe.paths), exe.paths
    runs = [p.run_backward(*((x[1], o, do) if op == "hgrn" else (*x, do))) for _ in range(2)]
    if backend == "triton":
        shifted = torch.empty(do.numel() + 8, dtype=do.dtype, device="cuda")[1:do.numel() + 1]
        shifted = shifted.view(do.shape)  # 2 bytes past a 16-byte boundary
        shifted.copy_(do)
        runs.append(p.run_backward(*((x[1], o, shifted) if op == "hgrn" else (*x, shifted))))
    torch.cuda.synchronize()
    for again in runs:
        assert len(again) == len(first)
        for a, b in zip(first, again):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.gpu
def test_ctypes_driver(cache_dir):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    from forge_dist.runtime import aot, plan
    from forge_dist.runtime.dispatcher import CtypesDriver, Dispatcher

    disp = Dispatcher(aot.CubinCache(cache_dir, "cuda:90"), CtypesDriver())
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16, backend="static",
             dispatcher=disp, execution="fused")
    pj = _plan("simple_gla", "fused", "triton", cache_dir)
    x = _inputs("simple_gla")
    assert _rel(p.run(*x)[0], pj.run(*x)[0]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["static", "triton"])
def test_graph_replays_with_changing_inputs(cache_dir, backend):
    if backend == "static" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the AOT config targets sm_90")
    p = _plan("simple_gla", "fused", backend, cache_dir)
    ref = _plan("simple_gla", "fused", "triton", cache_dir)
    static_in = [t.clone() for t in _inputs("simple_gla")]
    out = torch.empty(B, T, H, V, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            p.run(*static_in, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ht = p.run(*static_in, out=out)
    sets = [_inputs("simple_gla", seed=i) for i in range(4)]
    refs = [ref.run(*x) for x in sets]
    for i in range(100):
        for dst, src in zip(static_in, sets[i % 4]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, refs[i % 4][0]) < 1e-3 and _rel(ht, refs[i % 4][1]) < 1e-4, i


@pytest.mark.multigpu
def test_forge_graph_replays(tmp_path):
    """2 x 1000 graph replays of a 2-rank forge plan step, inputs changing every replay."""
    from tests.torchrun_workers import run_workers

    reports, _ = run_workers(ROOT / "tests" / "runtime" / "forge_graph_worker.py", tmp_path, 2)
    for r, rep in reports.items():
        assert rep["ok"], f"rank {r}: {rep['detail']}"
