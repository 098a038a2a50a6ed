"""The ops' short path (forge_dist/ops/planned.py): no-grad calls on one device run a cached
plan.  Under the Triton interpreter (CPU) with ``FORGE_DIST_KERNELS=triton``: every op's
short path equals its general path, is taken only when eligible, and reuses its plan."""

import pytest
import torch
import torch.nn.functional as F

from forge_dist import ops
from forge_dist.kernels import interpreting
from forge_dist.runtime import cache

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1 "
                                       "before triton is imported) or a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, K, V, D = 1, 80, 2, 16, 32, 32


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_KERNELS", "triton")
    monkeypatch.delenv("FORGE_DIST_OPS_PLANS", raising=False)
    cache.clear()


def _inputs(op, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if op == "hgrn":
        t = {"x": r(B, T, D), "g": F.logsigmoid(r(B, T, D) + 2)}
    else:
        t = {"q": r(B, T, H, K), "k": F.normalize(r(B, T, H, K), dim=-1), "v": r(B, T, H, V)}
        if op in ("simple_gla", "gated_delta_rule"):
            t["g"] = F.logsigmoid(r(B, T, H) + 2)
        if op == "gla":
            t["g"] = F.logsigmoid(r(B, T, H, K) + 2)
        if op == "gated_delta_rule":
            t["beta"] = torch.rand(B, T, H, generator=gen)
    return {n: x.to(DEV).requires_grad_(requires_grad) for n, x in t.items()}


def _call(op, t, **kw):
    if op == "gated_delta_rule":
        return ops.gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)
    return getattr(ops, op)(*t.values(), **kw)


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


OPS = ["linear_attn", "simple_gla", "gla", "gated_delta_rule", "hgrn"]


@pytest.mark.parametrize("op", OPS)
def test_short_path_equals_general_path(op, monkeypatch):
    t = _inputs(op)
    h0 = (torch.randn(B, D) if op == "hgrn" else torch.randn(B, H, K, V)).to(DEV)
    with torch.no_grad():
        o, s = _call(op, t, initial_state=h0, output_final_state=True)
        assert cache.stats()["misses"] == 1  # the short path made a plan
        o2, _ = _call(op, t, initial_state=h0, output_final_state=True)
        assert cache.stats()["hits"] == 1 and torch.equal(o, o2)
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "0")
        o_ref, s_ref = _call(op, t, initial_state=h0, output_final_state=True)
    assert cache.stats()["misses"] == 1 and cache.stats()["hits"] == 1
    assert o.dtype == o_ref.dtype and s.shape == s_ref.shape
    assert _rel(o, o_ref) < 1e-5 and _rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("case", ["cu_seqlens", "non-contiguous", "fp16", "fp64", "grad-maps"])
def test_ineligible_calls_take_the_general_path(case):
    t = _inputs("simple_gla", requires_grad=case == "grad-maps")
    kw = {}
    if case == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor([0, 30, T])
    if case == "non-contiguous":
        t["q"] = t["q"].transpose(1, 2).contiguous().transpose(1, 2)
    if case == "fp16":
        t = {n: (x.half() if n in "qkv" else x) for n, x in t.items()}
    if case == "fp64":
        t = {n: x.double() for n, x in t.items()}
    if case == "grad-maps":  # a fused prologue's derivative is not in the planned backward
        from forge_dist.ops import planned

        o, _ = planned.matrix_call("simple_gla", t["q"], t["k"], t["v"], {"g": t["g"]},
                                   scale=K ** -0.5, initial_state=None,
                                   output_final_state=False, cu_seqlens=None, group=None,
                                   use_kernels=True, maps={"q": object()}) or (None, None)
        assert o is None
    else:
        o, _ = _call("simple_gla", t, **kw)
    assert cache.stats()["misses"] == 0 and cache.stats()["hits"] == 0


def test_a_wrong_initial_state_still_gets_the_general_paths_error():
    t = _inputs("simple_gla")
    with torch.no_grad(), pytest.raises(ValueError, match="initial_state"):
        _call("simple_gla", t, initial_state=torch.zeros(B, H, K, V + 1, device=DEV))
    assert cache.stats()["misses"] == 0


def test_bad_switch_is_named(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "yes")
    with torch.no_grad(), pytest.raises(ValueError, match="FORGE_DIST_OPS_PLANS"):
        _call("linear_attn", _inputs("linear_attn"))


def test_gated_delta_rule_with_fp32_g_and_bf16_beta_takes_the_short_path(monkeypatch):
    """FLA's usual gates (fp32 g, beta in the activation dtype) get a plan with a beta
    buffer of its own dtype (they took the general path before), equal to the reference."""
    from forge_dist.variants import reference as ref

    if interpreting():  # the interpreter multiplies bf16 as raw bits without the shim
        from triton.runtime import interpreter as it

        from forge_dist.kernels.compat import interpreter_bf16_dot
        monkeypatch.setattr(it.InterpreterBuilder, "create_dot",
                            interpreter_bf16_dot(it.InterpreterBuilder.create_dot))
    t = {n: (x.bfloat16() if n in ("q", "k", "v", "beta") else x)
         for n, x in _inputs("gated_delta_rule").items()}
    with torch.no_grad():
        o, _ = _call("gated_delta_rule", t)
    assert cache.stats()["misses"] == 1 and o.dtype == torch.bfloat16
    o_ref, _ = ref.gated_delta_rule_ref(*[t[n].double() for n in ("q", "k", "v", "g", "beta")])
    assert _rel(o, o_ref) < 2e-2


def test_a_bad_strategy_is_refused_on_the_short_path_too():
    with torch.no_grad(), pytest.raises(ValueError, match="strategy"):
        _call("linear_attn", _inputs("linear_attn"), strategy="ring-allreduce")
    assert cache.stats()["misses"] == 0


@pytest.mark.parametrize("h0,final,use_o", [(True, True, True), (False, False, True),
                                            (True, True, False), (False, True, True)])
def test_hgrn_gradients_through_the_plan(h0, final, use_o, monkeypatch):
    """hgrn with gradients takes the short path (its backward is a planned program on the
    kept outputs): gradients of x, g and the initial state equal fp64 autograd, with and
    without an initial state, a final state, and a loss that reads only the final state."""
    from forge_dist.variants.reference import hgrn_ref

    t = _inputs("hgrn", seed=3, requires_grad=True)
    s0 = torch.randn(B, D).to(DEV).requires_grad_(True) if h0 else None
    o, s = _call("hgrn", t, initial_state=s0, output_final_state=final)
    assert cache.stats()["misses"] == 1
    gen = torch.Generator().manual_seed(4)
    w_o, w_s = torch.randn(B, T, D, generator=gen).to(DEV), torch.randn(B, D, generator=gen).to(DEV)
    loss = (o * w_o).sum() if use_o else 0
    if final:
        loss = loss + (s * w_s).sum()
    loss.backward()
    assert cache.stats()["misses"] == 1  # the backward ran on the forward's plan

    leaves = {n: x.detach().double().cpu().requires_grad_(True) for n, x in t.items()}
    s_ref = s0.detach().double().cpu().requires_grad_(True) if h0 else None
    o_r, s_r = hgrn_ref(leaves["x"], leaves["g"], initial_state=s_ref, output_final_state=True)
    loss_r = (o_r * w_o.double().cpu()).sum() if use_o else 0
    if final:
        loss_r = loss_r + (s_r * w_s.double().cpu()).sum()
    loss_r.backward()
    assert _rel(t["x"].grad, leaves["x"].grad) < 1e-5
    assert _rel(t["g"].grad, leaves["g"].grad) < 1e-5
    if h0:
        assert _rel(s0.grad, s_ref.grad) < 1e-5


def test_hgrn_gradients_of_the_plan_equal_the_general_path(monkeypatch):
    """Several segments (forward and backward DECOUPLED), short path against the runner."""
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", "3")
    grads = []
    for plans in ("1", "0"):
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", plans)
        t = _inputs("hgrn", seed=5, requires_grad=True)
        s0 = torch.randn(B, D, generator=torch.Generator().manual_seed(6)).to(DEV)
        s0.requires_grad_(True)
        o, s = _call("hgrn", t, initial_state=s0, output_final_state=True)
        (o.square().sum() + s.sum()).backward()
        grads.append([t["x"].grad, t["g"].grad, s0.grad])
    assert cache.stats()["misses"] == 1
    launches = [ln["kernel"] for ln in next(iter(cache._PLANS.values())).describe()[
        "backward_launches"]["with dht"]]
    assert launches == ["hgrn_bwd", "hgrn_scan", "hgrn_bwd"]  # three segments: decoupled
    for a, b in zip(*grads):
        assert _rel(a, b) < 1e-5


MATRIX = ["linear_attn", "simple_gla", "gla", "gated_delta_rule"]


@pytest.mark.parametrize("op", MATRIX)
@pytest.mark.parametrize("h0,final,use_o", [(True, True, True), (False, False, True),
                                            (True, True, False)])
def test_matrix_gradients_through_the_plan_equal_the_general_path(op, h0, final, use_o,
                                                                  monkeypatch):
    """The matrix-state ops with gradients take the short path: one plan runs the forward
    and, from the kept inputs, the backward; every gradient (inputs and initial state)
    equals the general path's (the runner's autograd over the same kernels), with and
    without an initial state and a final state, and for a loss that reads only the final
    state (no output gradient)."""
    gen = torch.Generator().manual_seed(4)
    w_o = torch.randn(B, T, H, V, generator=gen).to(DEV)
    w_s = torch.randn(B, H, K, V, generator=gen).to(DEV)
    s_init = torch.randn(B, H, K, V, generator=gen).to(DEV)
    grads = []
    for plans in ("1", "0"):
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", plans)
        t = _inputs(op, seed=3, requires_grad=True)
        s0 = s_init.clone().requires_grad_(True) if h0 else None
        o, s = _call(op, t, initial_state=s0, output_final_state=final)
        loss = (o * w_o).sum() if use_o else 0
        if final:
            loss = loss + (s * w_s).sum()
        loss.backward()
        grads.append([x.grad for x in t.values()] + ([s0.grad] if h0 else []))
        if plans == "1":
            assert cache.stats()["misses"] == 1  # forward and backward on one plan
            (p,) = cache._PLANS.values()
            assert p.describe()["backward_launches"]
    assert cache.stats()["misses"] == 1
    for a, b in zip(*grads):
        assert a is not None
        # q does not reach the final state: its gradient is exactly zero on both paths
        assert torch.equal(a, b) if not b.any() else _rel(a, b) < 1e-5


def test_matrix_gradients_only_where_asked():
    """Inputs that need no gradient get none; a frozen initial state is read, not
    differentiated; the plan's backward runs once per backward pass."""
    t = _inputs("gated_delta_rule", seed=7)
    t["q"].requires_grad_(True)
    t["beta"].requires_grad_(True)
    s0 = torch.randn(B, H, K, V).to(DEV)
    o, _ = _call("gated_delta_rule", t, initial_state=s0)
    o.square().sum().backward()
    assert t["q"].grad is not None and t["beta"].grad is not None
    assert all(t[n].grad is None for n in ("k", "v", "g"))
    assert t["beta"].grad.dtype == t["beta"].dtype and cache.stats()["misses"] == 1


@pytest.mark.parametrize("grad", [False, True])
def test_hgrn_with_bf16_x_and_fp32_gates_takes_the_plan(grad, monkeypatch):
    """Gates kept in fp32 beside bf16 x (the benchmarks' inputs, and a common choice) run
    the plan, forward and backward, as the general path does (it used to refuse them, so
    such calls paid the general path's host time, ~0.4 ms on an H100)."""
    def run():
        t = _inputs("hgrn", seed=7, requires_grad=grad)
        t["x"] = t["x"].detach().bfloat16().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            o, s = _call("hgrn", t, output_final_state=True)
        if not grad:
            return o, s
        o.float().square().sum().backward()
        return o, s, t["x"].grad, t["g"].grad

    planned = run()
    assert cache.stats()["misses"] == 1  # the plan was made (gate_dtype fp32)
    monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "0")
    general = run()
    assert cache.stats()["misses"] == 1
    for a, b in zip(planned, general):
        assert a.dtype == b.dtype and _rel(a, b) < 1e-2  # bf16 outputs (x's dtype)
    if grad:
        assert planned[3].dtype == torch.float32  # dg in the gates' dtype


@pytest.mark.parametrize("op", OPS)
def test_front_takes_a_repeated_call_straight_to_its_plan(op, monkeypatch):
    """The second call of a signature runs its plan without the op's own checks."""
    from forge_dist.ops import checks, planned

    t = _inputs(op)
    with torch.no_grad():
        o, _ = _call(op, t)
        assert len(planned._FRONT) >= 1

        def full_path(*args, **kwargs):
            raise AssertionError("the full path ran")
        monkeypatch.setattr(checks, "tensor", full_path)
        o2, _ = _call(op, t)
    assert torch.equal(o, o2) and cache.stats() == {"hits": 1, "misses": 1,
                                                    "evictions": 0, "size": 1}


@pytest.mark.parametrize("op", OPS)
def test_front_takes_a_repeated_training_call_straight_to_its_plan(op, monkeypatch):
    """With gradients too: the second call of a signature skips the op's checks and runs
    the plan's autograd function; its gradients equal the first call's."""
    from forge_dist.ops import checks

    grads, op_checks = [], checks.tensor
    for i in range(2):
        t = _inputs(op, seed=2, requires_grad=True)
        if i == 1:
            def full_path(*args, **kwargs):
                raise AssertionError("the full path ran")
            monkeypatch.setattr(checks, "tensor", full_path)
        o, _ = _call(op, t)
        o.square().sum().backward()
        grads.append([x.grad for x in t.values()])
    assert cache.stats() == {"hits": 1, "misses": 1, "evictions": 0, "size": 1}
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # the same signature without gradients is another front entry: the full path first
    # (which finds the same plan), then the plan's run
    monkeypatch.setattr(checks, "tensor", op_checks)
    with torch.no_grad():
        o1, _ = _call(op, _inputs(op, seed=2))
        monkeypatch.setattr(checks, "tensor", full_path)
        o2, _ = _call(op, _inputs(op, seed=2))
    assert torch.equal(o1, o2) and cache.stats()["misses"] == 1 and cache.stats()["hits"] == 3


def test_front_sends_what_the_plan_refuses_down_the_full_path(monkeypatch):
    t = _inputs("simple_gla")
    with torch.no_grad():
        o, _ = _call("simple_gla", t)
        # the same signature with a non-contiguous k: the plan refuses it before launching,
        # the op's general path runs it
        k_strided = t["k"].transpose(1, 2).contiguous().transpose(1, 2)
        o2, _ = _call("simple_gla", dict(t, k=k_strided))
        assert _rel(o2, o) < 1e-5 and cache.stats()["hits"] == 1
        # another k shape: the op's own error, naming k
        with pytest.raises(ValueError, match="k"):
            _call("simple_gla", dict(t, k=t["k"][:, :40]))
        # a switch flipped between calls: the full path decides afresh (no plan now)
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "0")
        o3, _ = _call("simple_gla", t)
        assert cache.stats()["hits"] == 1 and _rel(o3, o) < 1e-5
    monkeypatch.delenv("FORGE_DIST_OPS_PLANS")
    # grad mode and an input that needs a gradient: another signature for the front, so the
    # op's checks, then the same plan with its backward
    t4 = {n: x.clone().requires_grad_(True) for n, x in t.items()}
    o4, _ = _call("simple_gla", t4)
    o4.sum().backward()
    assert t4["q"].grad is not None and cache.stats()["hits"] == 2


def test_front_reads_a_tensor_scale_afresh_each_call():
    """A 0-d tensor scale changed in place: the second call must use the new value (a front
    keyed on the tensor's identity returned the first call's result)."""
    t = _inputs("simple_gla")
    s = torch.tensor(0.5)
    with torch.no_grad():
        _call("simple_gla", t, scale=s)
        s.fill_(0.125)
        o2, _ = _call("simple_gla", t, scale=s)
        ref, _ = _call("simple_gla", t, scale=0.125)
    assert _rel(o2, ref) < 1e-6


@pytest.mark.parametrize("op,grad", [("simple_gla", False), ("hgrn", False), ("hgrn", True),
                                     ("simple_gla", True)])
def test_a_plan_refusal_inside_the_ops_falls_back_to_the_general_path(op, grad, monkeypatch):
    """A cubin plan refuses a contiguous tensor off 16-byte alignment (PlanError); the op
    must then run the general path, not raise the plan's error."""
    from forge_dist.runtime import PlanError

    t = _inputs(op, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        o, _ = _call(op, t)
        (p,) = cache._PLANS.values()

        def refuse(*args, **kwargs):
            raise PlanError("k: data pointer not 16-byte aligned (the cubins assume it)")
        monkeypatch.setattr(p, "run", refuse)
        o2, _ = _call(op, t)
    assert _rel(o2, o) < 1e-5
    if grad:
        o2.sum().backward()
        assert all(x.grad is not None for x in t.values())


def test_front_sees_switches_when_os_environ_is_replaced(monkeypatch):
    import os

    t = _inputs("simple_gla")
    with torch.no_grad():
        _call("simple_gla", t)
        hits = cache.stats()["hits"]
        monkeypatch.setattr(os, "environ", dict(os.environ, FORGE_DIST_OPS_PLANS="0"))
        _call("simple_gla", t)
    assert cache.stats()["hits"] == hits  # the switch turned the short path off


def test_each_thread_gets_its_own_plan():
    """A plan's workspaces and parameter buffers are shared by its runs: two threads must
    not run one plan, so the cache keys on the thread too."""
    import threading

    t = _inputs("simple_gla")
    got = {}

    def call():
        with torch.no_grad():
            got["o"] = _call("simple_gla", t)[0]
    with torch.no_grad():
        o, _ = _call("simple_gla", t)
    th = threading.Thread(target=call)
    th.start()
    th.join()
    assert cache.stats()["misses"] == 2 and _rel(got["o"], o) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("op", MATRIX)
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_gpu_bf16_training_call_equals_the_general_path(op, gate_dtype, monkeypatch):
    """On the GPU at a real head size, bf16 q/k/v with fp32 or bf16 gates: the planned
    forward + backward gives the general path's outputs to fp32 rounding and its
    gradients bit for bit (the same backward kernels on the same inputs)."""
    if op == "linear_attn" and gate_dtype != torch.float32:
        pytest.skip("no gate")
    gen = torch.Generator().manual_seed(11)
    Bg, Tg, Hg, Kg = 2, 1000, 4, 128

    def r(*s):
        return torch.randn(*s, generator=gen).cuda()
    base = {"q": r(Bg, Tg, Hg, Kg), "k": F.normalize(r(Bg, Tg, Hg, Kg), dim=-1),
            "v": r(Bg, Tg, Hg, Kg)}
    if op in ("simple_gla", "gated_delta_rule"):
        base["g"] = F.logsigmoid(r(Bg, Tg, Hg) + 3)
    if op == "gla":
        base["g"] = F.logsigmoid(r(Bg, Tg, Hg, Kg) + 3)
    if op == "gated_delta_rule":
        base["beta"] = torch.sigmoid(r(Bg, Tg, Hg))
    do, w_s = r(Bg, Tg, Hg, Kg).bfloat16(), r(Bg, Hg, Kg, Kg)
    s_init = r(Bg, Hg, Kg, Kg)
    runs = []
    for plans in ("1", "0"):
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", plans)
        t = {n: (x.to(gate_dtype) if n in ("g", "beta") else x.bfloat16()).requires_grad_(True)
             for n, x in base.items()}
        s0 = s_init.clone().requires_grad_(True)
        o, s = _call(op, t, initial_state=s0, output_final_state=True)
        torch.autograd.backward([o, s], [do, w_s])
        runs.append((o.detach(), s.detach(), [x.grad for x in t.values()] + [s0.grad]))
    assert cache.stats()["misses"] == 1
    (o1, s1, g1), (o2, s2, g2) = runs
    assert _rel(o1, o2) < 1e-2 and _rel(s1, s2) < 1e-3
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("grad", [False, True])
def test_calls_inside_a_graph_capture_get_plans_of_their_own(grad, monkeypatch):
    """Inside a CUDA graph capture the ops keep their planned path on a captured plan: kept
    apart from the LRU (``clear()`` keeps it, only ``release_captured()`` drops it), found
    again by the next capture of the signature, and never handed to an eager call, even on
    the capture stream's handle (a later stream can get it back from PyTorch's pool).  The
    capture is simulated here; the GPU test below captures."""
    from forge_dist.ops import planned

    monkeypatch.setattr(cache, "_CAPTURED", {})
    monkeypatch.setattr(planned, "_capturing", lambda device: True)
    t = _inputs("simple_gla", requires_grad=grad)

    def call():
        with torch.set_grad_enabled(grad):
            o, _ = _call("simple_gla", t)
        if grad:
            o.sum().backward()
            assert all(x.grad is not None for x in t.values())
        return o
    o_captured = call()
    (p,) = cache.captured_plans()
    assert p.op == "simple_gla" and ("captured", True) in p.cache_key
    assert cache.stats()["size"] == 0 and cache.stats()["misses"] == 0  # not in the LRU
    if grad:
        assert p._bwd_execs  # the planned backward ran on it
    call()  # the next capture of the signature: the same plan
    assert cache.captured_plans() == (p,)
    # an eager call (here on the same stream handle, 0 on the CPU) gets its own plan
    monkeypatch.setattr(planned, "_capturing", lambda device: False)
    o_eager = call()
    assert cache.stats()["misses"] == 1 and cache.captured_plans() == (p,)
    (eager,) = cache._PLANS.values()
    assert eager is not p and torch.equal(o_eager.detach(), o_captured.detach())
    cache.clear()
    assert cache.captured_plans() == (p,)
    assert cache.release_captured() == 1 and cache.captured_plans() == ()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_training_step_in_a_cuda_graph(op):
    """``torch.cuda.make_graphed_callables`` over two stacked layers of the op (bf16, real
    head size): the captured forward and planned backward, replayed on new inputs, give the
    eager calls' outputs and gradients bit for bit, and the capture pinned its plan."""
    gen = torch.Generator().manual_seed(21)
    Tg, Hg, Kg, Dg = 1000, 4, 128, 512

    def fresh():
        r = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
        if op == "hgrn":
            t = [r(1, Tg, Dg).bfloat16(), F.logsigmoid(r(1, Tg, Dg) + 2).bfloat16()]
            return t, r(1, Tg, Dg).bfloat16()
        t = [r(1, Tg, Hg, Kg).bfloat16(), F.normalize(r(1, Tg, Hg, Kg), dim=-1).bfloat16(),
             r(1, Tg, Hg, Kg).bfloat16()]
        if op in ("simple_gla", "gated_delta_rule"):
            t.append(F.logsigmoid(r(1, Tg, Hg) + 3))
        if op == "gla":
            t.append(F.logsigmoid(r(1, Tg, Hg, Kg) + 3))
        if op == "gated_delta_rule":
            t.append(torch.sigmoid(r(1, Tg, Hg)))
        return t, r(1, Tg, Hg, Kg).bfloat16()

    fn = getattr(ops, op)

    def stack(*xs):
        h = xs[0]
        for _ in range(2):  # q (x) of the second layer is the first layer's output
            h, _ = fn(h, *xs[1:])
        return h
    sample, _ = fresh()
    cache.release_captured()
    graphed = torch.cuda.make_graphed_callables(
        stack, tuple(x.requires_grad_(True) for x in sample))
    captured = [p for p in cache.captured_plans() if p.op == op]
    assert captured and all(p._bwd_execs for p in captured)  # forward and backward planned
    for _ in range(3):
        new, do = fresh()
        args = [x.clone().requires_grad_(True) for x in new]
        out = graphed(*args)
        out.backward(do)
        got = [out.detach().clone()] + [a.grad.clone() for a in args]
        eager = [x.clone().requires_grad_(True) for x in new]
        out_e = stack(*eager)
        out_e.backward(do)
        want = [out_e.detach()] + [a.grad for a in eager]
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    del graphed
    torch.cuda.synchronize()
    cache.release_captured()  # the graphs are gone
