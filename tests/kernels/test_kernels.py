"""Triton chunk kernels against the fp64 token recurrences (forge_dist.variants.reference).

On a CPU machine these run under TRITON_INTERPRET=1 (set by conftest.py) at tiny shapes; on a
GPU machine the same tests run compiled.  ``@pytest.mark.gpu`` tests use real shapes in bf16.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from forge_dist import kernels  # noqa: E402
from forge_dist.kernels import scheduler, vector_state  # noqa: E402
from forge_dist.selftest import call_reference  # noqa: E402
from forge_dist.variants import transitions as tr  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET unset", allow_module_level=True)

KIND = {"linear_attn": tr.Kind.IDENTITY, "simple_gla": tr.Kind.SCALAR, "gla": tr.Kind.DIAGONAL,
        "gated_delta_rule": tr.Kind.DENSE, "deltanet": tr.Kind.DENSE}


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def make(variant, B, T, H, K, V, dtype=torch.float32, device=DEV, gate_scale=1.0, seed=0):
    """Inputs by name (and the reference function's positional tensors)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if variant == "hgrn":
        x = r(B, T, K)
        g = torch.nn.functional.logsigmoid(r(B, T, K)) * gate_scale
        return {"x": x.to(device, dtype), "g": g.to(device, dtype)}
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    inp = {"q": q, "k": k, "v": v}
    if variant == "simple_gla":
        inp["g"] = torch.nn.functional.logsigmoid(r(B, T, H) + 2) * gate_scale
    elif variant == "gla":
        inp["g"] = torch.nn.functional.logsigmoid(r(B, T, H, K) + 2) * gate_scale
    elif variant in ("gated_delta_rule", "deltanet"):
        inp["k"] = k / k.norm(dim=-1, keepdim=True)
        inp["beta"] = torch.rand(B, T, H, generator=gen)
        inp["g"] = (torch.nn.functional.logsigmoid(r(B, T, H) + 2) * gate_scale
                    if variant == "gated_delta_rule" else None)
    return {n: (None if t is None else t.to(device, dtype)) for n, t in inp.items()}


def reference(variant, inp, h0):
    d = {n: (None if t is None else t.detach().double().cpu()) for n, t in inp.items()}
    h0 = None if h0 is None else h0.detach().double().cpu()
    return call_reference(variant, d, initial_state=h0, output_final_state=True)


def op_name(variant):
    return "gated_delta_rule" if variant == "deltanet" else variant


def state_shape(variant, inp):
    if variant == "hgrn":
        B, _, D = inp["x"].shape
        return (B, D)
    B, _, H, K = inp["k"].shape
    return (B, H, K, inp["v"].shape[-1])


CASES = [  # (variant, executions)
    ("linear_attn", ("fused", "decoupled")),
    ("simple_gla", ("fused", "decoupled")),
    ("gla", ("fused", "decoupled")),
    ("gated_delta_rule", ("fused",)),
    ("deltanet", ("fused",)),
    ("hgrn", ("fused", "decoupled")),
]
PARAMS = [(v, e) for v, ex in CASES for e in ex]


@pytest.mark.parametrize("variant,execution", PARAMS)
@pytest.mark.parametrize("shape", [(1, 100, 2, 32, 48), (2, 64, 1, 80, 16)],
                         ids=["T100-K32-V48", "B2-T64-K80-V16"])
def test_forward_matches_reference(variant, execution, shape):
    B, T, H, K, V = shape
    inp = make(variant, B, T, H, K, V)
    h0 = torch.randn(state_shape(variant, inp), device=DEV)
    o, ht = kernels.forward(op_name(variant), inp, None, h0, execution=execution)
    ro, rh = reference(variant, inp, h0)
    assert rel(o, ro) <= 1e-4, rel(o, ro)
    assert rel(ht, rh) <= 1e-4, rel(ht, rh)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32


@pytest.mark.parametrize("variant,cache", [
    ("simple_gla", "walk"), ("gated_delta_rule", "wy"), ("hgrn", "program")])
def test_a_repeated_eager_call_reuses_its_launch_records(variant, cache):
    """The eager path (the runner's and shard_call's work objects) builds its launch records
    once per shape: the walk's schedule, the delta rule's WY launches, hgrn's program.  (hgrn's
    cache was never hit while the works passed ``maps={}`` and it looked for ``None``.)  A
    second call with other tensors of the same shape still gives the reference's result."""
    from forge_dist.kernels import delta, walker

    def hits():
        info = {"walk": walker._kept_schedule, "wy": delta._wy_records,
                "program": vector_state._eager_program}[cache].cache_info()
        return info.currsize, info.hits

    for seed in (0, 1):
        inp = make(variant, 1, 40, 2, 16, 16, seed=seed)
        if seed == 1:
            before = hits()
        o = kernels.make_work(op_name(variant), inp, None, False).finish(None)[0]
        assert rel(o, reference(variant, inp, None)[0]) <= 1e-4
    after = hits()
    if cache == "walk":  # kept after the first call, no new schedule, its lookups hit
        assert before[0] > 0 and after[0] == before[0] and after[1] > before[1], (before, after)
    else:  # nothing new kept, one more hit
        assert after == (before[0], before[1] + 1), (before, after)


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule"])
def test_kept_launch_records_follow_scale_and_tiles(monkeypatch, variant):
    """The kept records' keys hold what changes a launch: the same shape with another
    ``scale``, then with another tile config, still gives the reference's outputs."""
    from forge_dist.kernels import delta

    inp = make(variant, 1, 40, 2, 16, 16)
    d = {n: (None if t is None else t.double().cpu()) for n, t in inp.items()}
    for scale in (0.5, 0.25):
        o = kernels.make_work(op_name(variant), inp, scale, False).finish(None)[0]
        want = call_reference(variant, d, scale=scale, initial_state=None)[0]
        assert rel(o, want) <= 1e-4, (scale, rel(o, want))
    if variant == "gated_delta_rule":
        monkeypatch.setitem(delta.WY_CONFIG, "fused", not delta.WY_CONFIG["fused"])
    else:
        monkeypatch.setenv("FORGE_DIST_EXECUTION", "decoupled")
    o = kernels.make_work(op_name(variant), inp, 0.5, False).finish(None)[0]
    want = call_reference(variant, d, scale=0.5, initial_state=None)[0]
    assert rel(o, want) <= 1e-4, rel(o, want)


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
@pytest.mark.parametrize("tokens_limit", [0, 10 ** 9], ids=["gate-sum-launch", "sum-in-walk"])
def test_scalar_gate_sum_in_walk_or_before(monkeypatch, execution, tokens_limit):
    """simple_gla's walks sum the scalar gates themselves (short inputs) or read a gate sum
    launched before them (long inputs, kernels.walker.sum_gates_in_walk): both against
    the fp64 reference, with an incoming state."""
    from forge_dist.kernels import walker

    monkeypatch.setattr(walker, "SUM_GATES_IN_WALK_MAX_TOKENS", tokens_limit)
    inp = make("simple_gla", 2, 100, 2, 32, 48)
    h0 = torch.randn(state_shape("simple_gla", inp), device=DEV)
    o, ht = kernels.forward("simple_gla", inp, None, h0, execution=execution)
    ro, rh = reference("simple_gla", inp, h0)
    assert rel(o, ro) <= 1e-4 and rel(ht, rh) <= 1e-4, (rel(o, ro), rel(ht, rh))


def test_raw_gates_validation():
    from forge_dist.kernels import scalar, walker

    inp = make("simple_gla", 1, 64, 1, 16, 16)
    cfg = dict(scalar.fused_config(16, 16), tune=False)
    with pytest.raises(ValueError, match="raw_gates needs gate=1"):
        walker.walk(inp["k"], inp["v"], q=inp["q"], g=inp["g"], gate=1, cfg=cfg,
                    prec="ieee", raw_gates=True, g_cum=inp["g"])


@pytest.mark.parametrize("variant", [v for v, _ in CASES if v != "linear_attn"])
def test_steep_gates_stay_finite(variant):
    """Gates of about -20 per token: every exponent must be a non-positive difference."""
    inp = make(variant, 1, 64, 1, 32, 32, gate_scale=20.0 if variant != "deltanet" else 1.0)
    if variant in ("simple_gla", "gla", "gated_delta_rule", "hgrn"):
        inp["g"] = inp["g"] - 20.0
    o, ht = kernels.forward(op_name(variant), inp)
    ro, rh = reference(variant, inp, None)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel(o, ro) <= 1e-4


@pytest.mark.parametrize("raw_gates", [False, True], ids=["gate-sum", "sum-in-walk"])
@pytest.mark.parametrize("n_seg", [1, 3])
def test_scalar_walk_factored_and_exact_decays(raw_gates, n_seg):
    """simple_gla's output walk factors the in-chunk decay where a segment's chunks decay by
    at most FACTOR_SPAN (60) in log and takes the exact BT^2 form elsewhere: mild, steep and
    borderline chunks in one launch (a steep chunk in the middle segment only; a chunk
    summing to exactly -60, still factored, and one just past it; head 2 mild throughout),
    against the fp64 recurrence."""
    from forge_dist.kernels import walker

    B, T, H, K, V, BT = 1, 192, 3, 32, 48, 16
    inp = make("simple_gla", B, T, H, K, V)
    g = inp["g"].clone()
    g[:, 80:96, 0] = -9.0          # head 0: one chunk summing to -144 (exact form there)
    g[:, 16:32, 1] = -60.0 / 16    # head 1: a chunk summing to -60 (factored)
    g[:, 160:176, 1] = -61.0 / 16  # and one just past it (exact form)
    inp["g"] = g
    cfg = dict(BT=BT, BV=32, num_warps=4, num_stages=1, tune=False)
    o, ht = walker.walk(inp["k"], inp["v"], q=inp["q"], g=g, gate=1, scale=K ** -0.5,
                        cfg=cfg, prec="ieee", n_seg=n_seg, raw_gates=raw_gates)
    ro, rh = reference("simple_gla", inp, None)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel(o, ro) < 1e-5 and rel(ht, rh) < 1e-5


def test_scalar_walk_factored_decay_fp16():
    """fp16 operands factor only chunks that decay by at most FACTOR_SPAN_FP16 (8): the
    values scaled by exp(G_C - G) would leave fp16's normal range (6e-5 ~ exp(-9.7)) in a
    chunk decaying by 20, and the first tokens' own contributions would be lost."""
    from forge_dist.kernels import walker

    B, T, H, K, V, BT = 1, 64, 2, 16, 16, 16
    inp = make("simple_gla", B, T, H, K, V)
    g = inp["g"].clone()
    g[:, :, 0] = -1.25  # head 0: every chunk decays by 20 (exact form in fp16)
    g[:, :, 1] = -0.4   # head 1: by 6.4 (factored)
    inp["g"] = g
    half = {n: t.to(torch.float16) for n, t in inp.items()}
    cfg = dict(BT=BT, BV=16, num_warps=4, num_stages=1, tune=False)
    o, ht = walker.walk(half["k"], half["v"], q=half["q"], g=g, gate=1, scale=K ** -0.5,
                        cfg=cfg, prec="ieee", n_seg=1, out_dtype=torch.float32)
    ref_in = {n: t.to(torch.float16).float() for n, t in inp.items()}
    ref_in["g"] = g
    ro, rh = reference("simple_gla", ref_in, None)
    for h in range(H):
        assert rel(o[:, :, h], ro[:, :, h]) < 3e-3, h
    assert rel(ht, rh) < 3e-3


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "gated_delta_rule",
                                     "deltanet", "hgrn"])
def test_summary_composes(variant):
    """finish(S) == M S + delta, with (delta, M) from summary (the SP contract)."""
    inp = make(variant, 1, 96, 2, 32, 32, seed=1)
    work = kernels.make_work(op_name(variant), inp, None, True)
    assert work is not None
    delta, M = work.summary(True)
    S = torch.randn(state_shape(variant, inp), device=DEV)
    if variant == "hgrn":
        S = S.reshape(S.shape[0], 1, S.shape[1], 1)
        combined = tr.combine(tr.Kind.DIAGONAL, M, S, delta)
    else:
        combined = tr.combine(KIND[variant], M, S, delta)
    o, final = work.finish(S)
    _, rh = reference(variant, inp, S.reshape(state_shape(variant, inp)))
    assert rel(combined.reshape(rh.shape), rh) <= 1e-4
    assert rel(final.reshape(rh.shape), rh) <= 1e-4
    if variant == "linear_attn":
        assert M is None
    elif variant == "gated_delta_rule":
        assert M.shape == (1, 2, 32, 32) and M.dtype == torch.float32


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "gated_delta_rule",
                                     "deltanet", "hgrn"])
def test_backward_matches_reference(variant):
    inp = make(variant, 1, 40, 1, 16, 16, seed=2)
    h0 = torch.randn(state_shape(variant, inp), device=DEV)
    leaves = {n: (None if t is None else t.clone().requires_grad_(True)) for n, t in inp.items()}
    h0l = h0.clone().requires_grad_(True)
    o, ht = kernels.forward(op_name(variant), leaves, None, h0l)
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    (o * go).sum().backward(retain_graph=True)
    (ht * gh).sum().backward()
    ref_leaves = {n: (None if t is None else t.detach().double().cpu().requires_grad_(True))
                  for n, t in inp.items()}
    rh0 = h0.detach().double().cpu().requires_grad_(True)
    ro, rh = call_reference(variant, ref_leaves, initial_state=rh0, output_final_state=True)
    ((ro * go.double().cpu()).sum() + (rh * gh.double().cpu()).sum()).backward()
    for n, t in leaves.items():
        if t is None:
            continue
        assert rel(t.grad, ref_leaves[n].grad) <= 1e-4, (n, rel(t.grad, ref_leaves[n].grad))
    assert rel(h0l.grad, rh0.grad) <= 1e-4


@pytest.mark.parametrize("variant", ["simple_gla", "gla", "gated_delta_rule", "hgrn"])
def test_summary_backward(variant):
    """Gradients through (delta, M) of summary() equal those of the PyTorch chunk form
    (mild gates, so that M, and with it dM, is of order one)."""
    inp = make(variant, 1, 48, 1, 16, 16, seed=3, gate_scale=0.05)
    leaves = {n: (None if t is None else t.clone().requires_grad_(True)) for n, t in inp.items()}
    work = kernels.make_work(op_name(variant), leaves, None, True)
    delta, M = work.summary(True)
    gd, gm = torch.randn_like(delta), torch.randn_like(M)
    ((delta * gd).sum() + (M * gm).sum()).backward()
    # fp64 gradients of the PyTorch chunk form of the same summary
    f64 = {n: (None if inp.get(n) is None else inp[n].detach().double().requires_grad_(True))
           for n in work.names}
    r = work._summary_torch([f64[n] for n in work.names], True)
    ((r.delta * gd.double()).sum() + (r.transition * gm.double()).sum()).backward()
    for n in work.names:
        if leaves.get(n) is None:
            continue
        if f64[n].grad is None:  # q does not reach the summary
            assert leaves[n].grad is None or not leaves[n].grad.any(), n
            continue
        assert rel(leaves[n].grad, f64[n].grad) <= 1e-4, n


def test_unsupported_cases_fall_back():
    inp = make("simple_gla", 1, 16, 1, 32, 32)
    assert kernels.make_work("simple_gla", {**inp, "q": inp["q"].double(),
                                            "k": inp["k"].double(), "v": inp["v"].double()},
                             None, False) is None
    assert "head dims" in kernels.supported("simple_gla", make("simple_gla", 1, 16, 1, 512, 32))
    assert kernels.supported("nope", inp).startswith("unknown variant")
    with pytest.raises(ValueError, match="gla expects g"):
        kernels.forward("gla", inp)


def test_scheduler_algorithm1_and_forcing(monkeypatch):
    dev = scheduler.Device(n_sm=132, bandwidth=4.8e12, max_concurrency=264)
    # B*H*P_state >= SMs: fused fast path
    s, info = scheduler.algorithm1(8, 4096, 32, 128, 128, 64, 128, 64, device=dev)
    assert s == "fused" and info["P_fused"] == 512
    # few heads, long sequence: decoupled's chunk parallelism pays for its extra traffic
    s, info = scheduler.algorithm1(1, 65536, 2, 128, 128, 64, 128, 64, device=dev)
    assert s == "decoupled" and info["t_dec"] < info["t_fused"]
    # one chunk: no extra parallelism to gain
    s, _ = scheduler.algorithm1(1, 64, 2, 128, 128, 64, 128, 64, device=dev)
    assert s == "fused"
    # the segment count grows with the sequence but keeps >= 4 chunks per segment
    s, info = scheduler.algorithm1(1, 4096, 32, 128, 128, 64, 128, 64, device=dev)
    assert s == "decoupled" and 2 <= info["n_seg"] <= 64 // scheduler.MIN_CHUNKS_PER_SEGMENT
    least = min(info["candidates"].values())
    assert least <= info["t_dec"] <= least * (1 + scheduler.NEAR_TIE)
    # ... and of near-equal estimates takes the fewest segments
    assert all(c > least * (1 + scheduler.NEAR_TIE)
               for n, c in info["candidates"].items() if n < info["n_seg"])
    monkeypatch.setenv("FORGE_DIST_EXECUTION", "decoupled")
    assert scheduler.choose(8, 4096, 32, 128, 128, 64, 64)[0] == "decoupled"
    assert scheduler.choose(8, 4096, 32, 128, 128, 64, 64, decoupled_available=False)[0] == "fused"
    monkeypatch.setenv("FORGE_DIST_EXECUTION", "bogus")
    with pytest.raises(ValueError, match="FORGE_DIST_EXECUTION"):
        scheduler.choose(1, 64, 1, 64, 64, 64, 64)


def test_vector_state_schedule_fills_the_gpu_once():
    """hgrn: segments until about RESIDENT_PER_SM programs per SM run, no further (past that
    only the state traffic differs and the fewest segments win), and none shorter than
    VECTOR_STATE_MIN_TOKENS; the backward's reverse walk saturates later."""
    dev = scheduler.Device(n_sm=132, bandwidth=4.8e12, max_concurrency=264)
    sched = lambda T, **kw: scheduler.schedule_vector_state(1, T, 4096, 8, 256, device=dev, **kw)
    assert sched(1024).n_seg == 1024 // scheduler.VECTOR_STATE_MIN_TOKENS
    for T in (16384, 65536, 262144):  # 16 channel tiles x 64 segments >= 7 x 132 programs
        assert sched(T).n_seg == 64 and sched(T).strategy == "decoupled"
    assert sched(65536, resident_per_sm=scheduler.VECTOR_STATE_BWD_RESIDENT_PER_SM).n_seg == 128
    assert sched(65536, request="fused") == scheduler.Schedule("fused", 1, "forced")


def test_execution_is_reported():
    inp = make("simple_gla", 1, 192, 1, 32, 32)
    for ex in ("fused", "decoupled"):
        work = kernels.make_work("simple_gla", inp, None, False, execution=ex)
        work.finish(None)
        assert work.execution == ex
        assert work.n_seg == (1 if ex == "fused" else 2)
    # one chunk cannot be split: the report says what ran
    work = kernels.make_work("simple_gla", make("simple_gla", 1, 64, 1, 32, 32), None, False,
                             execution="decoupled")
    work.finish(None)
    assert work.execution == "fused" and "one segment" in work.execution_reason


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "hgrn"])
@pytest.mark.parametrize("n_seg", [2, 3, 5])
def test_segments_forward_and_summary(monkeypatch, variant, n_seg):
    """DECOUPLED over uneven segments (the last one ragged) with an initial state: outputs,
    final state and the SP summary all equal the fp64 recurrence."""
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", str(n_seg))
    # 5 chunks of 64, the last ragged; hgrn (8-token blocks, slow under the interpreter):
    # 13 blocks, so 5 segments of 3 blocks, the last ragged too, 64 channels a program
    monkeypatch.setitem(vector_state.FUSED_CONFIG, "BD", 64)
    inp = make(variant, 2, 300 if variant != "hgrn" else 100, 2, 32, 24, seed=7)
    h0 = torch.randn(state_shape(variant, inp), device=DEV)
    work = kernels.make_work(variant, inp, None, True)
    o, ht = work.finish(h0 if variant != "hgrn" else h0.reshape(2, 1, 32, 1))
    assert work.execution == "decoupled" and work.n_seg == min(n_seg, 5)
    ro, rh = reference(variant, inp, h0)
    assert rel(o, ro) <= 1e-4 and rel(ht.reshape(rh.shape), rh) <= 1e-4
    delta, M = work.summary(True)
    _, rz = reference(variant, inp, None)
    assert rel(delta.reshape(rz.shape), rz) <= 1e-4


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "hgrn"])
@pytest.mark.parametrize("n_seg", [1, 3])
def test_finish_reuses_summary_segments(monkeypatch, variant, n_seg):
    """The sequence-parallel order: summary first, then finish(S_in) runs only the segment
    output walks (the incoming state folded into every segment's start), with mild gates so
    that S_in reaches every segment.  Outputs and final state equal the fp64 recurrence."""
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", str(n_seg))
    inp = make(variant, 2, 150 if variant != "hgrn" else 60, 2, 32, 24, seed=11,
               gate_scale=0.02)
    work = kernels.make_work(variant, inp, None, True)
    delta, M = work.summary(True)
    assert work.segments is not None and work.segments.n_seg == n_seg
    S = torch.randn(state_shape(variant, inp), device=DEV)
    o, ht = work.finish(S if variant != "hgrn" else S.reshape(2, 1, -1, 1))
    assert work.segments is None  # released: the autograd graph must not keep them
    ro, rh = reference(variant, inp, S)
    assert rel(o, ro) <= 1e-4 and rel(ht.reshape(rh.shape), rh) <= 1e-4
    _, rz = reference(variant, inp, None)
    assert rel(delta.reshape(rz.shape), rz) <= 1e-4
    if variant != "linear_attn":  # M from the summary's summed segment decays
        g = inp["g"].double().sum(dim=1).exp()
        assert rel(M.reshape(g.shape), g) <= 1e-5


@pytest.mark.parametrize("dtype,wy_calls,tol", [(torch.float16, 1, 2e-3),
                                                  (torch.float32, 2, 1e-4)],
                         ids=["fp16", "fp32"])
def test_delta_rule_summary_shares_wy(monkeypatch, dtype, wy_calls, tol):
    """A 16-bit segment's summary uses the forward's operands and the same WY factors
    (computed once for summary and finish); fp32 keeps its own fp32 factors.  Both compose
    to the fp64 recurrence: M S + delta and finish(S) give the final state."""
    from forge_dist.kernels import delta as delta_mod

    calls = []
    real = delta_mod.wy
    monkeypatch.setattr(delta_mod, "wy", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    inp = make("gated_delta_rule", 1, 130, 2, 32, 32, dtype=dtype, seed=1, gate_scale=0.05)
    work = kernels.make_work("gated_delta_rule", inp, None, True)
    work.prepare()
    delta, M = work.summary(True)
    S = torch.randn(1, 2, 32, 32, device=DEV)
    o, final = work.finish(S)
    assert len(calls) == wy_calls
    ro, rh = reference("gated_delta_rule", inp, S)
    assert rel(tr.combine(tr.Kind.DENSE, M, S, delta), rh) <= tol
    assert rel(final, rh) <= tol and rel(o, ro) <= tol


def test_dense_summary_precision_validation(monkeypatch):
    from forge_dist.kernels import delta as delta_mod

    monkeypatch.setenv("FORGE_DIST_DENSE_SUMMARY", "bf16")
    with pytest.raises(ValueError, match="FORGE_DIST_DENSE_SUMMARY"):
        delta_mod.summary_precision()


def test_segment_count_validation(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", "zero")
    with pytest.raises(ValueError, match="FORGE_DIST_SEGMENTS"):
        scheduler.schedule(1, 4096, 2, 128, 128, 64, 64)


# ------------------------------------------------------------------------------------------
# Real GPU: bf16 at real shapes against an fp32 reference, and FLA's forward if installed.
# ------------------------------------------------------------------------------------------

def _fp32_reference(variant, inp, h0):
    """Chunked fp32 PyTorch forms (the token recurrence is too slow at real T)."""
    from forge_dist.variants import decay_attention, delta_rule, vector_state
    f = {n: (None if t is None else t.float()) for n, t in inp.items()}
    if variant == "hgrn":
        s = vector_state.summarize(f["x"], f["g"], need_transition=False)
        B, D = h0.shape
        o_p, s_p = s.readout(h0.reshape(B, 1, D, 1))
        return s.o_zero + o_p, (s.delta + s_p).reshape(B, D)
    K = f["q"].shape[-1]
    if variant in ("gated_delta_rule", "deltanet"):
        s = delta_rule.summarize(f["q"], f["k"], f["v"], f["g"], f["beta"], K ** -0.5,
                                 need_transition=False)
    else:
        s = decay_attention.summarize(f["q"], f["k"], f["v"], f.get("g"), K ** -0.5,
                                      need_transition=False)
    o_p, s_p = s.readout(h0)
    return s.o_zero + o_p, s.delta + s_p


@pytest.mark.gpu
@pytest.mark.parametrize("variant,execution", PARAMS)
@pytest.mark.parametrize("K", [80, 128, 256])
def test_gpu_bf16_real_shapes(variant, execution, K):
    T, H = (2048, 4) if variant != "hgrn" else (4096, 1)
    V = 128 if variant != "hgrn" else None
    inp = make(variant, 2, T, H, K if variant != "hgrn" else 1024, V or 0, dtype=torch.bfloat16,
               device="cuda")
    h0 = torch.randn(state_shape(variant, inp), device="cuda") * 0.1
    o, ht = kernels.forward(op_name(variant), inp, None, h0, execution=execution)
    ro, rh = _fp32_reference(variant, inp, h0)
    assert rel(o, ro) <= 5e-3, rel(o, ro)
    assert rel(ht, rh) <= 5e-3, rel(ht, rh)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla", "gated_delta_rule",
                                     "hgrn"])
def test_gpu_matches_fla(variant):
    fla_ops = pytest.importorskip("fla.ops")  # noqa: F841
    inp = make(variant, 1, 4096, 8, 128, 128, dtype=torch.bfloat16, device="cuda")
    o, ht = kernels.forward(variant, inp, None, None)
    try:
        if variant == "linear_attn":
            from fla.ops.linear_attn import chunk_linear_attn
            fo, fh = chunk_linear_attn(inp["q"], inp["k"], inp["v"], normalize=False,
                                       output_final_state=True)
        elif variant == "simple_gla":
            from fla.ops.simple_gla import chunk_simple_gla
            fo, fh = chunk_simple_gla(inp["q"], inp["k"], inp["v"], g=inp["g"],
                                      output_final_state=True)
        elif variant == "gla":
            from fla.ops.gla import chunk_gla
            fo, fh = chunk_gla(inp["q"], inp["k"], inp["v"], g=inp["g"], output_final_state=True)
        elif variant == "gated_delta_rule":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            fo, fh = chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=inp["g"],
                                            beta=inp["beta"], output_final_state=True)
        else:
            from fla.ops.hgrn import chunk_hgrn
            fo, fh = chunk_hgrn(inp["x"], inp["g"], output_final_state=True)
    except Exception as e:  # FLA may refuse some paths on this Triton
        pytest.skip(f"FLA refused: {type(e).__name__}: {e}")
    assert rel(o, fo.float()) <= 1e-2, rel(o, fo.float())
    assert rel(ht, fh.float()) <= 1e-2, rel(ht, fh.float())


@pytest.mark.parametrize("gates,path", [("mild", "one_product"), ("mild", "subblocks"),
                                        ("steep", "default")])
def test_gla_gate_kernel_paths(monkeypatch, gates, path):
    """Both ways the gate kernel forms the in-chunk attention: one product (a chunk's decay
    span below the limit) and sub-blocks (above it; forced here for mild gates by a negative
    limit).  Gates of -20 per token take the sub-block path by default and stay exact."""
    from forge_dist.kernels import vector
    if path == "subblocks":
        monkeypatch.setattr(vector, "span_max", lambda dtype: -1.0)
    inp = make("gla", 1, 77, 2, 48, 32, seed=4)
    if gates == "steep":
        inp["g"] = inp["g"] - 20.0
    h0 = torch.randn(1, 2, 48, 32, device=DEV)
    o, ht = kernels.forward("gla", inp, None, h0)
    ro, rh = reference("gla", inp, h0)
    assert torch.isfinite(o).all()
    assert rel(o, ro) <= 1e-4 and rel(ht, rh) <= 1e-4


@pytest.mark.parametrize("variant", ["gated_delta_rule", "deltanet"])
@pytest.mark.parametrize("noise", [1.0, 0.0], ids=["correlated", "identical"])
def test_delta_rule_aligned_keys(variant, noise):
    """Keys sharing a direction (repeated tokens) with beta near 1: the in-chunk WY inverse
    must stay accurate (a product-of-powers inverse returned errors of 1e3-1e19 here)."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, K = 1, 128, 1, 32
    base = torch.randn(K, generator=gen)
    k = base + noise * torch.randn(B, T, H, K, generator=gen)
    inp = {"q": torch.randn(B, T, H, K, generator=gen), "k": k / k.norm(dim=-1, keepdim=True),
           "v": torch.randn(B, T, H, K, generator=gen), "beta": torch.full((B, T, H), 0.99),
           "g": torch.full((B, T, H), -1e-3) if variant == "gated_delta_rule" else None}
    inp = {n: (None if t is None else t.to(DEV)) for n, t in inp.items()}
    o, ht = kernels.forward("gated_delta_rule", inp, None, None)
    ro, rh = reference(variant, inp, None)
    assert rel(o, ro) <= 1e-4 and rel(ht, rh) <= 1e-4, (rel(o, ro), rel(ht, rh))


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla", "gla"])
def test_fp16_inputs_whose_states_pass_fp16_range(monkeypatch, variant):
    """k v^T ~ 1e6 per token: a chunk state passes fp16's 65504 while the output (q / 1000)
    fits.  The ops run fp16 inputs through the kernels in fp32 (else the state operand of
    the output dot, cast to the input dtype, is inf)."""
    from forge_dist import ops
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    if DEV == "cpu" and not kernels.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 96, 1, 16, 16
    q = (torch.randn(B, T, H, K, generator=gen) / 1000).half()
    k = (torch.randn(B, T, H, K, generator=gen) * 1000 / K ** 0.5).half()
    v = (torch.randn(B, T, H, V, generator=gen) * 1000).half()
    g = {"linear_attn": (), "simple_gla": (-0.01 * torch.rand(B, T, H, generator=gen),),
         "gla": (-0.01 * torch.rand(B, T, H, K, generator=gen),)}[variant]
    o, s = getattr(ops, variant)(*(x.to(DEV) for x in (q, k, v) + g), output_final_state=True)
    o_ref, s_ref = call_reference(variant, dict(
        q=q.double(), k=k.double(), v=v.double(), **({"g": g[0].double()} if g else {})),
        output_final_state=True)
    assert o.dtype == torch.float16 and torch.isfinite(o).all() and torch.isfinite(s).all()
    assert o_ref.abs().max() < 60000 and s_ref.abs().max() > 65504  # the case it is about
    assert rel(o.cpu(), o_ref) < 5e-3 and rel(s.cpu(), s_ref) < 1e-4
