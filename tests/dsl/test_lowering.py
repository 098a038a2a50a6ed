"""The Triton template path (TRITON_INTERPRET=1 on the CPU) and the lowering decisions."""
import pytest
import torch
import torch.nn.functional as F

from forge_dist import dsl, kernels
from forge_dist.dsl import builtins, library, references
from forge_dist.variants import reference as ref


def test_lowering_decisions():
    assert library.elu_linear_attn.lowering.template == "linear_attn"
    assert set(library.elu_linear_attn.lowering.texts["q"].split(" -> ")[1:]) == {"elu", "add"}
    assert builtins.simple_gla.lowering.template == "simple_gla"
    assert builtins.gla.lowering.template == "gla"
    assert builtins.gated_delta_rule.lowering.template == "gated_delta_rule"
    assert builtins.hgrn.lowering.template == "hgrn"
    # RetNet's fixed decay per head: simple_gla with the decay read from the program
    assert library.retnet.lowering.template == "simple_gla"
    assert library.retnet.lowering.constant_g is not None
    # RG-LRU: hgrn, its input scaling sqrt(1 - a^2) borrowing the decay's inputs r, lam
    low = library.rg_lru.lowering
    assert low.template == "hgrn" and low.roles == {"x": ("x", "i"), "g": ("r", "lam")}
    assert low.reads["x"] == ("x", "i", "r", "lam") and low.reads["g"] == ("r", "lam")
    # forget gates normalised over each token's channels: a token-local prologue (PyTorch)
    v = _softmax_gates(-1)
    assert v.lowering.template == "hgrn" and v.lowering.texts["g"] == "f -> log_softmax"
    assert "g: f -> log_softmax (PyTorch)" in v.describe()
    # normalised over the chunk's tokens instead: that mixes tokens, never a prologue
    v = _softmax_gates(-2)
    assert v.lowering is None and "validation failed" in v.lowering_reason
    assert "graph executor" in v.describe()


def _softmax_gates(dim: int):
    def chunk(x, f):
        h = dsl.cache("h", (dsl.helpers.segsum_exp_vec(F.log_softmax(f, dim).cumsum(-2))
                            * x[..., None, :, :]).sum(-2))
        return h[..., -1, :]

    def decay(state, chunk_state, f):
        return state * F.log_softmax(f, dim).sum(-2).exp() + chunk_state

    def merge(state, h, f):
        return h + F.log_softmax(f, dim).cumsum(-2).exp() * state[..., None, :]
    return dsl.variant(f"softmax_gates{dim}", chunk_mode=chunk, decay_mode=decay,
                       merge_mode=merge, state="vector", inputs=("x", "f"), chunk_size=16)


def test_dense_and_vector_programs_that_are_not_the_template_are_not_lowered():
    """Same kinds and inputs as gated_delta_rule / hgrn, different math: validation refuses
    (the delta rule without its correction of the state's contribution; hgrn reading out
    the state one token late)."""
    T = builtins.T

    def gdn_merge(state, q, k, g, u, w, scale):
        G = g.cumsum(-1)
        A = (q @ T(k)) * dsl.helpers.segsum_exp(G)
        return scale * (A @ u + (q * G.exp()[..., None]) @ state)  # no "- w @ state"
    v = dsl.variant("not_gdn", chunk_mode=builtins._gdn_chunk, decay_mode=builtins._gdn_decay,
                    merge_mode=gdn_merge, inputs=("q", "k", "v", "g", "beta"))
    assert v.kind.value == "dense"
    assert v.lowering is None and "validation failed" in v.lowering_reason

    def hgrn_merge(state, h, g):
        return h + (g.cumsum(-2) - g).exp() * state[..., None, :]
    v = dsl.variant("not_hgrn", chunk_mode=builtins._hgrn_chunk,
                    decay_mode=builtins._hgrn_decay, merge_mode=hgrn_merge, state="vector",
                    inputs=("x", "g"), chunk_size=16)
    assert v.lowering is None and "validation failed" in v.lowering_reason


def test_not_the_template_is_not_lowered():
    """The delta rule read before each token's own update (a strict mask inside the chunk):
    no template, no epilogue, and no residual form (its merge reads the WY caches)."""
    def merge(state, q, k, g, u, w, scale):
        G = g.cumsum(-1)
        A = (q @ k.transpose(-1, -2)) * dsl.helpers.segsum_exp(G, strict=True)
        return scale * (A @ (u - w @ state) + (q * G.exp()[..., None]) @ state)
    v = dsl.variant("strict_gdn", chunk_mode=builtins._gdn_chunk,
                    decay_mode=builtins._gdn_decay, merge_mode=merge,
                    inputs=("q", "k", "v", "g", "beta"))
    assert v.kind.value == "dense"
    assert v.lowering is None and "validation failed" in v.lowering_reason


def test_a_strict_readout_lowers_with_a_residual():
    """Same states and readout as simple_gla, but each token reads the state before its own
    key: the template's kernels carry the state, and a chunk-local residual (the program's
    outputs from a zero chunk-start state minus the template's) adds the difference."""
    def merge(state, q, k, v, g, scale):
        G = g.cumsum(-1)
        o = ((q @ k.transpose(-1, -2)) * dsl.helpers.segsum_exp(G, strict=True)) @ v + \
            (q * G.exp()[..., None]) @ state
        return scale * o
    v = dsl.variant("strict", chunk_mode=builtins._sg_chunk, decay_mode=builtins._sg_decay,
                    merge_mode=merge, inputs=("q", "k", "v", "g"))
    low = v.lowering
    assert low is not None and low.template == "simple_gla" and low.residual is not None
    assert low.epilogue is None and "chunk-local residual" in v.describe()


def test_a_gate_on_an_input_the_template_reads_is_an_epilogue():
    """``o * sigmoid(v)``: the gate reads v, which the template reads too, so v keeps its
    role and the epilogue reads it as well (it takes no input of its own)."""
    def merge(state, q, k, v, g, scale):
        G = g.cumsum(-1)
        o = ((q @ k.transpose(-1, -2)) * dsl.helpers.segsum_exp(G)) @ v + \
            (q * G.exp()[..., None]) @ state
        return scale * o * torch.sigmoid(v)
    v = dsl.variant("gated_out", chunk_mode=builtins._sg_chunk, decay_mode=builtins._sg_decay,
                    merge_mode=merge, inputs=("q", "k", "v", "g"))
    low = v.lowering
    assert low is not None and low.template == "simple_gla"
    assert (low.epilogue.reads, low.epilogue.only) == (("v",), ())
    assert "epilogue: (o, v) -> {sigmoid, mul}" in v.describe()


@pytest.fixture
def triton_on_cpu(monkeypatch):
    if not kernels.HAVE_TRITON or not kernels.interpreting():
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    monkeypatch.setenv("FORGE_DIST_DSL_TRITON", "1")
    used = []
    real = kernels.make_work

    def spy(*a, **k):
        w = real(*a, **k)
        used.append(type(w).__name__ if w is not None else None)
        return w
    monkeypatch.setattr(kernels, "make_work", spy)
    return used


# case -> (catalogue entry, what its lowering must be): a decay shared by two gates, an
# input gate broadcast onto the keys, an output gate as an epilogue (a map of z as one
# generated kernel with o, or z itself: one PyTorch op), Mamba2's skip term as an additive
# epilogue (its v also the template's, d only the epilogue's), RetNet's per-head constant
# decay computed from shapes
LOWERED_ENTRIES = {
    "shared": ("second_decay", lambda low: low.roles["g"] == ("a", "b")),
    "broadcast": ("input_gate", lambda low: low.roles["k"] == ("k", "i")),
    "epilogue": ("output_gate", lambda low: low.epilogue.reads == ("z",)
                 and low.epilogue.how() == "Triton kernel"),
    "identity_epilogue": ("output_gate_linear",
                          lambda low: low.epilogue.reads == ("z",)
                          and low.epilogue.how() == "PyTorch"),
    "residual": ("strict_readout", lambda low: low.residual is not None),
    "additive_epilogue": ("mamba2_d_skip",
                          lambda low: (low.epilogue.reads, low.epilogue.only) == (("v", "d"),
                                                                                  ("d",))
                          and low.epilogue.how() == "Triton kernel"),
    "constant_decay": ("retnet_head_decay", lambda low: low.constant_g is not None),
}


@pytest.mark.parametrize("case", ["elu", "gla", "gated_delta_rule", "hgrn", "hgrn-runner",
                                  "rg_lru", "softmax_gate", *LOWERED_ENTRIES])
def test_triton_template_path(triton_on_cpu, case, monkeypatch):
    """Forward and gradients through the template's kernels.  hgrn differentiates through
    its cached plan (the ops' short path); with plans off, through the runner's works.
    shared: a decay summed from two gates (one role, two inputs) on the simple_gla
    template, gradients reaching both gates; broadcast: an input gate, a per-head scalar
    broadcast onto the keys (``k * sigmoid(i)[..., None]``); epilogue: an output gate
    (``o * sigmoid(z)``) after the template, gradients reaching z; additive_epilogue:
    ``o + v * d[..., None]``, gradients reaching v through both the template and the
    epilogue, and d."""
    from forge_dist.runtime import cache

    cache.clear()
    if case == "hgrn-runner":
        monkeypatch.setenv("FORGE_DIST_OPS_PLANS", "0")
    torch.manual_seed(0)
    B, T, H, K, V = 1, 21, 1, 16, 16
    q, k, v = (torch.randn(B, T, H, d, requires_grad=True) for d in (K, K, V))
    h0 = torch.randn(B, H, K, V, requires_grad=True)
    if case == "gated_delta_rule":
        k = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2).requires_grad_()
        beta = torch.rand(B, T, H).requires_grad_()
        o, s = builtins.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                         output_final_state=True)
        leaves = [q, k, v, g, beta, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = ref.gated_delta_rule_ref(*mref[:5], initial_state=mref[5],
                                            output_final_state=True)
    elif case == "rg_lru":  # hgrn's plan on prologues that read several inputs each
        x, r, i = (torch.randn(B, T, 24, requires_grad=True) for _ in range(3))
        lam = (torch.randn(B, T, 24) + 2).requires_grad_()
        h0 = torch.randn(B, 24, requires_grad=True)
        o, s = library.rg_lru(x, r, i, lam, initial_state=h0, output_final_state=True)
        leaves = [x, r, i, lam, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = references.rg_lru_ref(*mref[:4], initial_state=mref[4],
                                         output_final_state=True)
    elif case == "softmax_gate":  # hgrn's plan on a token-local reduction (PyTorch)
        from tests.dsl.catalogue import CATALOGUE

        entry = CATALOGUE["hgrn_softmax_gate"]
        assert entry.variant.lowering.texts["g"] == "f -> log_softmax"
        u, f, h0 = (torch.randn(*s, requires_grad=True) for s in ((B, T, 24), (B, T, 24),
                                                                   (B, 24)))
        o, s = entry.variant(u, f, initial_state=h0, output_final_state=True)
        leaves = [u, f, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = ref.hgrn_ref(mref[0], F.log_softmax(mref[1], -1), initial_state=mref[2],
                                output_final_state=True)
    elif case.startswith("hgrn"):
        x = torch.randn(B, T, 24, requires_grad=True)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, 24) + 2).requires_grad_()
        h0 = torch.randn(B, 24, requires_grad=True)
        o, s = builtins.hgrn(x, g, initial_state=h0, output_final_state=True)
        leaves = [x, g, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = ref.hgrn_ref(*mref[:2], initial_state=mref[2], output_final_state=True)
    elif case in LOWERED_ENTRIES:  # catalogue entries on simple_gla, checked by its reference
        from tests.dsl.catalogue import CATALOGUE

        name, lowered = LOWERED_ENTRIES[case]
        entry = CATALOGUE[name]
        assert lowered(entry.variant.lowering)
        extra = {n: (torch.randn(B, T, H, V) if d == "V" else torch.randn(B, T, H).add(2))
                 .requires_grad_() for n, d in entry.inputs.items() if n not in "qkv"}
        o, s = entry.variant(q, k, v, **extra, initial_state=h0, output_final_state=True)
        leaves = [q, k, v, *extra.values(), h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        x = dict(zip(["q", "k", "v", *extra], mref[:-1]))
        m = entry.mapped(x)
        o_r, s_r = ref.simple_gla_ref(m["q"], m["k"], m["v"], m["g"].double(),
                                      initial_state=mref[-1], output_final_state=True)
        o_r = o_r if entry.post is None else entry.post(o_r, x, 1.0 / K ** 0.5)
    elif case == "elu":
        o, s = library.elu_linear_attn(q, k, v, initial_state=h0, output_final_state=True)
        leaves = [q, k, v, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = references.elu_linear_attn_ref(*mref[:3], initial_state=mref[3],
                                                  output_final_state=True)
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) + 2).requires_grad_()
        o, s = builtins.gla(q, k, v, g, initial_state=h0, output_final_state=True)
        leaves = [q, k, v, g, h0]
        mref = [t.detach().double().requires_grad_() for t in leaves]
        o_r, s_r = ref.gla_ref(*mref[:4], initial_state=mref[4], output_final_state=True)
    if case in ("hgrn", "rg_lru", "softmax_gate"):
        assert cache.stats()["misses"] == 1 and not triton_on_cpu  # a plan, not the runner
    else:
        assert triton_on_cpu and all(u is not None and u.endswith("Work")
                                     for u in triton_on_cpu), triton_on_cpu
    (o.sum() + (s * s).sum()).backward()
    (o_r.sum() + (s_r * s_r).sum()).backward()
    for a, b in [(o, o_r), (s, s_r)] + [(x.grad, y.grad) for x, y in zip(leaves, mref)]:
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-4, err


@pytest.mark.parametrize("name", ["strict_readout", "gated_delta_bonus"])
def test_a_residual_form_through_the_templates_kernels(triton_on_cpu, name):
    """A template's kernels (simple_gla; the delta rule, whose residual runs the WY factors
    of both programs) plus the chunk-local residual: outputs, final state and every
    gradient against the variant's fp64 recurrence, on a ragged length."""
    from tests.dsl.catalogue import CATALOGUE

    entry = CATALOGUE[name]
    assert entry.variant.lowering.residual is not None
    x, h0 = entry.problem(21, K=16, V=16, seed=6)
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    h0f = h0.float().requires_grad_()
    o, s = entry.variant(**leaves, scale=0.3, initial_state=h0f, output_final_state=True)
    assert triton_on_cpu and all(u is not None and u.endswith("Work") for u in triton_on_cpu)
    master = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0m = h0.clone().requires_grad_()
    o_r, s_r = entry.reference(master, h0m, 0.3)
    gen = torch.Generator().manual_seed(7)
    up = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    ((o * up.float()).sum() + (s * s).sum()).backward()
    ((o_r * up).sum() + (s_r * s_r).sum()).backward()
    pairs = [(o, o_r), (s, s_r), (h0f.grad, h0m.grad)] + \
        [(leaves[n].grad, master[n].grad) for n in x]
    for a, b in pairs:
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


def test_a_vector_states_epilogue_through_the_hgrn_plan(triton_on_cpu, monkeypatch):
    """HGRN with its outputs gated by a third input: the hgrn template's plan, then the
    gate as one generated kernel over ``[B, T, D]``; outputs, final state and every
    gradient against the fp64 recurrence."""
    from forge_dist.kernels import prologue
    from tests.dsl.catalogue import CATALOGUE

    entry = CATALOGUE["hgrn_output_gate"]
    assert entry.variant.lowering.epilogue.reads == ("z",)
    ran = []
    real = prologue._MapNFn.apply
    monkeypatch.setattr(prologue._MapNFn, "apply", lambda *a: ran.append(1) or real(*a))
    x, h0 = entry.problem(21, D=24, seed=8)
    leaves = {n: t.float().requires_grad_() for n, t in x.items()}
    h0f = h0.float().requires_grad_()
    o, s = entry.variant(**leaves, initial_state=h0f, output_final_state=True)
    assert ran  # the epilogue's kernel
    master = {n: t.clone().requires_grad_() for n, t in x.items()}
    h0m = h0.clone().requires_grad_()
    o_r, s_r = entry.reference(master, h0m, 1.0)
    (o.sum() + (s * s).sum()).backward()
    (o_r.sum() + (s_r * s_r).sum()).backward()
    for a, b in [(o, o_r), (s, s_r), (h0f.grad, h0m.grad)] + \
            [(leaves[n].grad, master[n].grad) for n in x]:
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


def test_a_residual_with_packed_sequences_takes_the_unlowered_path(triton_on_cpu):
    """With ``cu_seqlens`` a residual's chunks would straddle the sequences' starts, so the
    call runs the program itself (the executor on the CPU): each packed sequence equals the
    same variant on that sequence alone (through the template and its residual)."""
    from tests.dsl.catalogue import CATALOGUE

    entry = CATALOGUE["strict_readout"]
    x, _ = entry.problem(26, K=16, V=16, seed=5)
    x = {n: t.float() for n, t in x.items()}
    cu = torch.tensor([0, 11, 26])
    seen = []
    real = entry.variant.lowering.residual.__class__.__call__
    entry.variant.lowering.residual.__class__.__call__ = \
        lambda self, *a: seen.append(1) or real(self, *a)
    try:
        o, _ = entry.variant(**x, cu_seqlens=cu)
        assert not seen  # the packed call ran no residual
        parts = [entry.variant(**{n: t[:, lo:hi] for n, t in x.items()})[0]
                 for lo, hi in ((0, 11), (11, 26))]
        assert len(seen) == 2  # each sequence alone: the template and its residual
    finally:
        entry.variant.lowering.residual.__class__.__call__ = real
    want = torch.cat(parts, dim=1)
    assert ((o - want).norm() / want.norm()).item() < 1e-5


def test_gate_and_skip_term_in_one_epilogue(triton_on_cpu):
    """``o * sigmoid(z) + v * d[..., None]``: one epilogue of four inputs (o, v, z, d) as one
    generated kernel, z and d its own; forward and every gradient against fp64."""
    def merge(state, q, k, v, g, z, d, scale):
        G = g.cumsum(-1)
        o = ((q @ k.transpose(-1, -2)) * dsl.helpers.segsum_exp(G)) @ v + \
            (q * G.exp()[..., None]) @ state
        return scale * o * torch.sigmoid(z) + v * d[..., None]
    var = dsl.variant("gate_skip", chunk_mode=builtins._sg_chunk,
                      decay_mode=builtins._sg_decay, merge_mode=merge,
                      inputs={"q": "K", "k": "K", "v": "V", "g": "", "z": "V", "d": ""})
    epi = var.lowering.epilogue
    assert (epi.reads, epi.only, epi.how()) == (("v", "z", "d"), ("z", "d"), "Triton kernel")
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 19, 2, 16, 16
    shapes = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, H, V), "g": (B, T, H),
              "z": (B, T, H, V), "d": (B, T, H)}
    x = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    x["g"] = F.logsigmoid(x["g"] + 2)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = var(**leaves)
    mref = {n: t.double().requires_grad_() for n, t in x.items()}
    o_r, _ = ref.simple_gla_ref(mref["q"], mref["k"], mref["v"], mref["g"])
    o_r = o_r * torch.sigmoid(mref["z"]) + mref["v"] * mref["d"][..., None]
    assert triton_on_cpu and all(u is not None and u.endswith("Work") for u in triton_on_cpu)
    up = torch.randn(o.shape, generator=gen)
    (o * up).sum().backward()
    (o_r * up.double()).sum().backward()
    for a, b in [(o, o_r)] + [(leaves[n].grad, mref[n].grad) for n in shapes]:
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.parametrize("case", ["elu", "simple_gla", "gated_delta_rule", "hgrn"])
def test_no_grad_calls_run_the_templates_cached_plan(triton_on_cpu, case):
    """A no-grad call on one device takes the ops' short path (a cached plan of the
    template) on the prologue outputs, and equals the fp64 reference."""
    from forge_dist.runtime import cache

    cache.clear()
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    B, T, H, K, V = 1, 37, 2, 16, 16
    q, k, v = r(B, T, H, K), torch.nn.functional.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g = torch.nn.functional.logsigmoid(r(B, T, H) + 2)
    h0 = r(B, H, K, V)
    with torch.no_grad():
        if case == "elu":
            o, s = library.elu_linear_attn(q, k, v, initial_state=h0, output_final_state=True)
            o_r, s_r = references.elu_linear_attn_ref(q.double(), k.double(), v.double(),
                                                      initial_state=h0.double(),
                                                      output_final_state=True)
        elif case == "simple_gla":
            o, s = builtins.simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
            o_r, s_r = ref.simple_gla_ref(q.double(), k.double(), v.double(), g.double(),
                                          initial_state=h0.double(), output_final_state=True)
        elif case == "gated_delta_rule":
            beta = torch.rand(B, T, H, generator=gen)
            o, s = builtins.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                             output_final_state=True)
            o_r, s_r = ref.gated_delta_rule_ref(q.double(), k.double(), v.double(), g.double(),
                                                beta.double(), initial_state=h0.double(),
                                                output_final_state=True)
        else:
            x, gx, hx = r(B, T, 24), torch.nn.functional.logsigmoid(r(B, T, 24) + 2), r(B, 24)
            o, s = builtins.hgrn(x, gx, initial_state=hx, output_final_state=True)
            o_r, s_r = ref.hgrn_ref(x.double(), gx.double(), initial_state=hx.double(),
                                    output_final_state=True)
    assert cache.stats()["misses"] == 1 and not triton_on_cpu  # a plan, not the runner
    assert s.shape == s_r.shape
    for a, b in ((o, o_r), (s, s_r)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4


def _act_sg_chunk(k, v, g):
    return builtins._sg_chunk(torch.relu(k), v, F.logsigmoid(g))


def _act_sg_decay(state, chunk_state, g):
    return builtins._sg_decay(state, chunk_state, F.logsigmoid(g))


def _act_sg_merge(state, q, k, v, g, scale):
    return builtins._sg_merge(state, torch.relu(q), torch.relu(k), v, F.logsigmoid(g), scale)


def _act_hgrn_chunk(x, g):
    return builtins._hgrn_chunk(F.silu(x), F.logsigmoid(g))


def _act_hgrn_decay(state, chunk_state, g):
    return builtins._hgrn_decay(state, chunk_state, F.logsigmoid(g))


def _act_hgrn_merge(state, h, g):
    return builtins._hgrn_merge(state, h, F.logsigmoid(g))


ACT_SG = dsl.variant("relu_logsigmoid_gla", chunk_mode=_act_sg_chunk, decay_mode=_act_sg_decay,
                     merge_mode=_act_sg_merge, inputs=("q", "k", "v", "g"), fuse_prologues=True)
ACT_HGRN = dsl.variant("silu_hgrn", chunk_mode=_act_hgrn_chunk, decay_mode=_act_hgrn_decay,
                       merge_mode=_act_hgrn_merge, state="vector", inputs=("x", "g"),
                       chunk_size=16, fuse_prologues=True)


def _kernel_prologue_variants(monkeypatch):
    """The same programs with the default lowering, their one-op prologues made generated
    elementwise kernels too (by default a single op stays a PyTorch op)."""
    from forge_dist.dsl import lowering

    monkeypatch.setattr(lowering, "PROLOGUE_KERNEL_MIN_OPS", 1)
    sg = dsl.variant("relu_logsigmoid_gla", chunk_mode=_act_sg_chunk, decay_mode=_act_sg_decay,
                     merge_mode=_act_sg_merge, inputs=("q", "k", "v", "g"))
    hg = dsl.variant("silu_hgrn", chunk_mode=_act_hgrn_chunk, decay_mode=_act_hgrn_decay,
                     merge_mode=_act_hgrn_merge, state="vector", inputs=("x", "g"),
                     chunk_size=16)
    return sg, hg


def test_prologues_are_fused_into_the_templates(monkeypatch):
    """With fuse_prologues=True, feature maps and gate activations are written as Triton maps
    the templates apply as they load; the delta rule's kernels take no maps, so its
    prologues run as generated elementwise kernels, as every prologue does by default;
    chains the codegen cannot translate stay PyTorch ops."""
    if not kernels.HAVE_TRITON:
        pytest.skip("needs triton")
    assert set(ACT_SG.lowering.fused) == {"q", "k", "g"}
    assert set(ACT_HGRN.lowering.fused) == {"x", "g"}
    assert not library.elu_linear_attn.lowering.fused  # the default
    assert "q -> elu -> add (Triton kernel)" in library.elu_linear_attn.describe()
    assert "(fused)" in ACT_SG.describe() and "q -> relu" in ACT_SG.describe()
    one_op = dsl.variant("relu_logsigmoid_gla", chunk_mode=_act_sg_chunk,
                         decay_mode=_act_sg_decay, merge_mode=_act_sg_merge,
                         inputs=("q", "k", "v", "g"))
    assert {k: one_op.lowering.how(k) for k in "qkvg"} == {k: "PyTorch" for k in "qkvg"}
    sg_k, _ = _kernel_prologue_variants(monkeypatch)
    assert {k: sg_k.lowering.how(k) for k in "qkvg"} == {
        "q": "Triton kernel", "k": "Triton kernel", "v": "PyTorch", "g": "Triton kernel"}

    def alpha_merge(state, q, k, v, scale):  # add's alpha has no translation: PyTorch
        return builtins._la_merge(state, torch.add(q, 1.0, alpha=2.0), k, v, scale)
    v = dsl.variant("alpha_q_la", chunk_mode=builtins._la_chunk, decay_mode=builtins._la_decay,
                    merge_mode=alpha_merge, inputs=("q", "k", "v"))
    assert v.lowering is not None and v.lowering.how("q") == "PyTorch"
    assert "q: q -> add (PyTorch)" in v.describe()

    def gdn_merge(state, q, k, g, u, w, scale):
        return builtins._gdn_merge(state, F.silu(q), k, g, u, w, scale)
    v = dsl.variant("silu_q_gdn", chunk_mode=builtins._gdn_chunk, decay_mode=builtins._gdn_decay,
                    merge_mode=gdn_merge, inputs=("q", "k", "v", "g", "beta"),
                    fuse_prologues=True)  # (PROLOGUE_KERNEL_MIN_OPS = 1 here)
    assert v.lowering.template == "gated_delta_rule" and not v.lowering.fused
    assert "q: q -> silu (Triton kernel)" in v.describe()


def test_a_broadcast_input_gate_runs_as_one_kernel():
    """The input gate ``k * sigmoid(i)[..., None]`` (a per-head scalar onto the keys) runs
    as one generated kernel; a map where a scalar meets the keys without ``[..., None]``
    would broadcast another way and is never one (lowering._broadcast_is_flat)."""
    if not kernels.HAVE_TRITON:
        pytest.skip("needs triton")
    from tests.dsl.catalogue import CATALOGUE

    v = CATALOGUE["input_gate"].variant
    assert v.lowering.roles["k"] == ("k", "i") and v.lowering.how("k") == "Triton kernel"
    assert "(Triton kernel)" in v.describe()
    from forge_dist.dsl import lowering

    def g(k, i):
        return k * torch.sigmoid(i)[..., None]

    def h(k, i):  # i meets k directly: PyTorch would align i's H with k's trailing dim
        return k * torch.sigmoid(i)
    for fn, flat in ((g, True), (h, False)):
        nodes = [n for n in torch.fx.symbolic_trace(fn).graph.nodes if n.op != "output"]
        assert lowering._broadcast_is_flat(nodes, {"k": "K", "i": ""}) is flat


@pytest.mark.parametrize("case", ["simple_gla", "hgrn"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("fuse", [True, False], ids=["in-template", "prologue-kernels"])
def test_fused_prologue_variants_against_fp64(triton_on_cpu, monkeypatch, case, grad, fuse):
    """Forward and gradients of the raw inputs (the runner's works) and the no-grad short
    path (a cached plan) against the fp64 references on mapped inputs: prologues fused into
    the template's kernels, or run as generated elementwise kernels before them."""
    from forge_dist.kernels import prologue
    from forge_dist.runtime import cache

    launched = []
    real_launch = prologue._launch
    monkeypatch.setattr(prologue, "_launch", lambda kernel, fn, *t: (
        launched.append(kernel), real_launch(kernel, fn, *t)))
    ACT_SG, ACT_HGRN = (globals()["ACT_SG"], globals()["ACT_HGRN"]) if fuse else (
        _kernel_prologue_variants(monkeypatch))
    cache.clear()
    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if case == "simple_gla":
        B, T, H, K, V = 1, 29, 2, 16, 16
        leaves = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), r(B, T, H) + 2, r(B, H, K, V)]
    else:
        leaves = [r(1, 29, 24), r(1, 29, 24) + 2, r(1, 24)]
    leaves = [t.requires_grad_(grad) for t in leaves]
    mref = [t.detach().double().requires_grad_(grad) for t in leaves]
    with torch.set_grad_enabled(grad):
        if case == "simple_gla":
            q, k, v, g, h0 = leaves
            o, s = ACT_SG(q, k, v, g, initial_state=h0, output_final_state=True)
            q, k, v, g, h0 = mref
            o_r, s_r = ref.simple_gla_ref(q.relu(), k.relu(), v, F.logsigmoid(g),
                                          initial_state=h0, output_final_state=True)
        else:
            x, g, h0 = leaves
            o, s = ACT_HGRN(x, g, initial_state=h0, output_final_state=True)
            x, g, h0 = mref
            o_r, s_r = ref.hgrn_ref(F.silu(x), F.logsigmoid(g), initial_state=h0,
                                    output_final_state=True)
    if grad and (fuse or case != "hgrn"):  # the runner's works
        assert triton_on_cpu and all(u and u.endswith("Work") for u in triton_on_cpu)
    if grad:  # (hgrn with prologue kernels differentiates through its cached plan)
        (o.sum() + (s * s).sum()).backward()
        (o_r.sum() + (s_r * s_r).sum()).backward()
    else:  # a plan with the maps, not the runner
        assert cache.stats()["misses"] == 1 and not triton_on_cpu
    n_maps = 3 if case == "simple_gla" else 2  # q, k, g / x, g
    if fuse:
        assert not launched
    else:  # each prologue once forward, its derivative once per gradient asked
        assert launched.count(prologue._map_kernel) == n_maps
        assert launched.count(prologue._map_grad_kernel) == (n_maps if grad else 0)
    pairs = [(o, o_r), (s, s_r)] + ([(a.grad, b.grad) for a, b in zip(leaves, mref)]
                                    if grad else [])
    for a, b in pairs:
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-4, err


def test_a_gate_broadcast_once_and_reused_keeps_its_prologue():
    """DeltaNet whose step size is ``sigmoid(lr)[..., None]``, formed once and read twice:
    the prologue of beta ends at the sigmoid (the broadcast is the phase's own), as before
    per-head scalars could join other roles."""
    from tests.dsl.catalogue import T, _delta_decay, _delta_merge

    def chunk(k, v, lr):
        b1 = torch.sigmoid(lr)[..., None]
        C = k.shape[-2]
        system = k.new_ones(C).diag() + b1 * (k @ T(k)).tril(-1)

        def solve(rhs):
            return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = solve(b1 * v), solve(b1 * k)
        dsl.cache("u", u)
        dsl.cache("w", w)
        return T(k) @ u

    v = dsl.variant("deltanet_sigmoid_once", chunk_mode=chunk, decay_mode=_delta_decay,
                    merge_mode=_delta_merge, inputs={"q": "K", "k": "K", "v": "V", "lr": ""})
    assert v.lowering is not None, v.lowering_reason
    assert v.lowering.texts["beta"] == "lr -> sigmoid"


def test_the_right_shared_assignment_survives_the_candidate_cap():
    """Unconventional names and a decay summed from three gates: the assignments whose
    shared roles never meet are dropped before the cap, so the right one is validated."""
    from tests.dsl.catalogue import _chunk_state, _retention

    def G(a, b, c):
        return (F.logsigmoid(a) + F.logsigmoid(b) + F.logsigmoid(c)).cumsum(-1)

    def chunk(key, value, a, b, c):
        return _chunk_state(key, value, G(a, b, c))

    def decay(state, chunk_state, a, b, c):
        return state * G(a, b, c)[..., -1].exp()[..., None, None] + chunk_state

    def merge(state, query, key, value, a, b, c, scale):
        return _retention(query, key, value, G(a, b, c), state, scale)

    v = dsl.variant("three_gates", chunk_mode=chunk, decay_mode=decay, merge_mode=merge,
                    inputs={"query": "K", "key": "K", "value": "V", "a": "", "b": "",
                            "c": ""})
    assert v.lowering is not None, v.lowering_reason
    assert v.lowering.roles["g"] == ("a", "b", "c")
    assert v.lowering.texts["g"] == ("(a, b, c) -> {log_sigmoid, log_sigmoid, add, "
                                     "log_sigmoid, add}")
