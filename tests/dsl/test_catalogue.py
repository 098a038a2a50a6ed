"""The catalogue of user-written variants (tests/dsl/catalogue.py): the path each takes, and
its results against the fp64 token recurrence of the nearest built-in on mapped inputs, on
one process and on 3 gloo ranks (every runnable entry in one spawned world)."""
import functools
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from forge_dist import dsl
from forge_dist.dsl import DSLError, generated

from ..sp.distributed import run_world
from .catalogue import CATALOGUE, RUNNABLE

STRATEGIES = ("serial", "pipelined", "lasp2")  # (not from .cases: it builds the built-ins)
TOL64 = 1e-10
SCALE = 0.5
CHUNK = 4  # small chunks: several per rank and a ragged tail at these lengths


def test_catalogue_size_and_kinds():
    assert len(CATALOGUE) >= 20
    paths = [e.path for e in CATALOGUE.values()]
    assert {"generated", "refused", "residual:simple_gla",
            "residual:gated_delta_rule"} <= set(paths)
    assert {p for p in paths if p.startswith("template:")} == {
        "template:linear_attn", "template:simple_gla", "template:gla",
        "template:gated_delta_rule", "template:hgrn"}


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_describe_reports_the_expected_path(name):
    entry = CATALOGUE[name]
    if entry.path == "refused":
        with pytest.raises(DSLError, match="not affine"):
            entry.variant  # noqa: B018 - compiling it must fail
        return
    v = entry.variant
    text = v.describe()
    cuda = torch.device("cuda")
    if entry.path.startswith(("template:", "residual:")):
        form, template = entry.path.split(":")
        assert v.lowering is not None and v.lowering.template == template, v.lowering_reason
        assert f"Triton template {template!r} on CUDA" in text
        assert (v.lowering.residual is not None) == (form == "residual")
        assert ("chunk-local residual" in text) == (form == "residual")
        assert v.path(cuda) == "template"
    else:
        assert v.lowering is None and v.lowering_reason and v.lowering_hint
        assert "generated on CUDA" in text and v.lowering_reason in text
        assert v.path(cuda) == "generated"
    assert v.path(torch.device("cpu")) == "executor"


def _shard(x, rank, T_local):
    return {k: t[:, rank * T_local:(rank + 1) * T_local].clone() for k, t in x.items()}


def check(name, group=None, strategy="auto", T_local=19):
    """Max relative error of o and the final state against the fp64 reference (collective
    over ``group``)."""
    entry = CATALOGUE[name]
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    x, h0 = entry.problem(T_local * world, seed=len(name))
    v = entry.variant if world == 1 else entry.unlowered
    o, final = v(**_shard(x, rank, T_local), scale=SCALE, initial_state=h0,
                             output_final_state=True, group=group, chunk_size=CHUNK,
                             strategy=strategy)
    o_ref, f_ref = entry.reference(x, h0, SCALE)
    if world > 1:
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o.contiguous(), group=group)
        o = torch.cat(parts, dim=1)
        dist.broadcast(final, src=world - 1, group=group)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return {"o": rel(o, o_ref), "final_state": rel(final, f_ref)}


@pytest.mark.parametrize("name", RUNNABLE)
def test_world1_fp64(name):
    errs = check(name)
    assert max(errs.values()) < TOL64, errs


# On 3 ranks by default: every template and every kind of generated entry (each rank builds
# the variants it runs, ~0.5 s of CPU apiece); FORGE_DIST_TEST_FULL_CATALOGUE=1: all of them.
WORLD3 = RUNNABLE if os.environ.get("FORGE_DIST_TEST_FULL_CATALOGUE") == "1" else [
    "relu_times_relu", "renamed_linear_attn", "gate_named_a", "second_decay", "input_gate",
    "output_gate",
    "retnet_head_decay", "gla_gate_gk", "gla_output_gate", "gated_delta_a_b", "deltanet_lr",
    "gated_delta_output_gate", "hgrn_u_f", "hgrn_output_gate", "rg_lru", "hgrn_softmax_gate",
    "mamba2_d_skip",
    "strict_readout", "gated_delta_bonus", "gated_delta_strict_readout"]


def _world3_rows(group, names):
    return {n: check(n, group, STRATEGIES[i % len(STRATEGIES)], T_local=7)
            for i, n in enumerate(names)}


@functools.lru_cache(maxsize=None)
def _world3():
    return run_world(3, _world3_rows, WORLD3, env={"FORGE_DIST_TIMEOUT": "120"})


@pytest.mark.parametrize("name", WORLD3)
def test_world3_gloo(name):
    """Catalogue entries on 3 ranks (strategies taken in turn), one spawned world."""
    errs = _world3()[name]
    assert max(errs.values()) < TOL64, errs


def test_generated_path_runs_the_graphs_it_is_given():
    """The generated path's wiring: the executor runs the five graphs it is handed (here
    counting wrappers; on CUDA their torch.compile forms, exercised with Inductor by the GPU
    test below) and gives the traced graphs' results: outputs, state, transition (the
    linear part of decay_mode) and the readout of a carried state (that of merge_mode)."""
    entry = CATALOGUE["retnet_head_decay"]
    v = entry.unlowered  # (what the generated path runs: the traced phases)
    calls = {}

    def counted(name, fn):
        def run(*a):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a)
        return run
    eager = generated.eager_graphs(v)
    graphs = generated.Graphs(**{f: counted(f, getattr(eager, f)) for f in
                                 ("chunk", "decay", "merge", "decay_linear", "merge_linear")})
    S0 = torch.randn(1, 2, 6, 5, dtype=torch.float64)
    x, _ = entry.problem(10)
    a = v.summarize(x, SCALE, True, CHUNK, graphs=graphs)
    b = v.summarize(x, SCALE, True, CHUNK)
    for p, q in [(a.o_zero, b.o_zero), (a.delta, b.delta), (a.transition, b.transition),
                 (a.readout(S0)[0], b.readout(S0)[0])]:
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    # two pieces (full chunks, ragged tail): chunk and decay's linear part once per piece
    # (decay_mode itself not at all: its offset is its chunk_state argument); merge per
    # piece for o_zero, merge's linear part per piece for the readout
    assert v.decay_offset == "chunk_state"
    assert calls == {"chunk": 2, "decay_linear": 2, "merge": 2, "merge_linear": 2}, calls


def test_decay_offset_shortcut_agrees_with_running_decay_mode():
    from forge_dist.dsl import builtins

    scaled = dsl.variant("scaled_offset", chunk_mode=builtins._la_chunk,
                         decay_mode=lambda state, chunk_state: 0.9 * state + 2.0 * chunk_state,
                         merge_mode=builtins._la_merge, inputs=("q", "k", "v"))
    assert scaled.decay_offset is None  # 2 * chunk_state: decay_mode(0) has to run
    v = CATALOGUE["gated_delta_a_b"].compile(lower=False)
    x, _ = CATALOGUE["gated_delta_a_b"].problem(10)
    a = v.summarize(x, SCALE, True, CHUNK)
    v.decay_offset = None
    b = v.summarize(x, SCALE, True, CHUNK)
    torch.testing.assert_close(a.delta, b.delta, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.o_zero, b.o_zero, rtol=1e-12, atol=1e-12)


def test_compiled_graphs_are_torch_compile_of_the_traced_ones(monkeypatch):
    """compiled_graphs hands each of the five graphs to torch.compile with dynamic sizes
    (one compile for every chunk count and tail length)."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn, kw)) or fn)
    v = CATALOGUE["retnet_head_decay"].unlowered
    graphs = generated.compiled_graphs(v)
    eager = generated.eager_graphs(v)
    assert [fn for fn, _ in seen] == [eager.chunk, eager.decay, eager.merge,
                                      eager.decay_linear, eager.merge_linear]
    assert all(kw == {"backend": "inductor", "dynamic": True} for _, kw in seen)
    assert graphs.merge is eager.merge


def test_warns_once_per_variant_off_the_templates(monkeypatch):
    cuda = torch.device("cuda")
    v = CATALOGUE["gated_delta_strict_readout"].variant
    v._warned_path = False
    with pytest.warns(UserWarning, match=r"'gated_delta_strict_readout' runs on CUDA "
                                         r"through the Inductor-compiled .*translation "
                                         r"validation failed.*To lower it: ") as record:
        generated.warn_once(v, cuda, v.path(cuda))
        generated.warn_once(v, cuda, v.path(cuda))
    assert len(record) == 1
    t = CATALOGUE["gate_named_a"].variant
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generated.warn_once(t, cuda, t.path(cuda))  # a template: silent
        generated.warn_once(v, torch.device("cpu"), v.path(torch.device("cpu")))
    monkeypatch.setenv("FORGE_DIST_DSL_COMPILE", "0")
    assert v.path(cuda) == "executor" and "FORGE_DIST_DSL_COMPILE=0" in v.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["relu_pow2", "gla_gate_gk", "gated_delta_a_b", "hgrn_u_f",
                                  "second_decay", "output_gate", "output_gate_linear",
                                  "gla_output_gate", "gated_delta_output_gate",
                                  "hgrn_output_gate", "rg_lru",
                                  "hgrn_softmax_gate", "mamba2_d_skip", "strict_readout",
                                  "gated_delta_bonus", "gated_delta_strict_readout",
                                  "input_gate"])
def test_catalogue_on_cuda(name):
    """On CUDA: template entries through their Triton kernels, the others through the
    Inductor-compiled generated path (with its one warning), fp32 against fp64, forward and
    the gradients of every input."""
    entry = CATALOGUE[name]
    v = entry.variant
    x, h0 = entry.problem(200, H=4, K=32, V=32, D=32, seed=3)
    leaves = {k: t.float().cuda().requires_grad_() for k, t in x.items()}
    h0c = h0.float().cuda().requires_grad_()
    v._warned_path = False
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        o, final = v(**leaves, scale=SCALE, initial_state=h0c, output_final_state=True)
    assert any("runs on CUDA through" in str(w.message) for w in record) == \
        (entry.path == "generated")
    master = {k: t.clone().requires_grad_() for k, t in x.items()}
    h0m = h0.clone().requires_grad_()
    o_ref, f_ref = entry.reference(master, h0m, SCALE)
    (o.sum() + (final * final).sum()).backward()
    (o_ref.sum() + (f_ref * f_ref).sum()).backward()
    pairs = [(o, o_ref), (final, f_ref)] + [(leaves[k].grad, master[k].grad) for k in x]
    for a, b in pairs:
        err = ((a.double().cpu() - b).norm() / b.norm()).item()
        assert err < 5e-3, (name, err)  # tf32 dots in the templates


@pytest.mark.parametrize("kind", ["identity", "scalar", "diagonal"])
@pytest.mark.parametrize("with_s0", [False, True])
def test_scan_kernel_matches_the_loop(monkeypatch, kind, with_s0):
    """The generated path's state pass as one Triton kernel (the interpreter on the CPU)
    equals the executor's loop; calls needing gradients and dense transitions keep the
    loop."""
    from forge_dist import kernels
    from forge_dist.dsl import scan
    from forge_dist.variants import chunked as ck
    from forge_dist.variants.transitions import Kind

    if not kernels.HAVE_TRITON or (not torch.cuda.is_available() and
                                   not kernels.interpreting()):
        pytest.skip("needs triton on CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("FORGE_DIST_DSL_TRITON", "1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    B, H, NT, R, V = 2, 3, 6, 5, 7
    kind = Kind(kind)
    dS = torch.randn(B, H, NT, R, V, generator=gen).to(dev)
    M = {Kind.IDENTITY: None, Kind.SCALAR: torch.rand(B, H, NT, generator=gen) - 0.2,
         Kind.DIAGONAL: torch.rand(B, H, NT, R, generator=gen)}[kind]
    M = None if M is None else M.to(dev)
    S0 = torch.randn(B, H, R, V, generator=gen).to(dev) if with_s0 else None
    assert scan.eligible(kind, M, dS, S0)
    got = scan.scan_chunks(kind, M, dS, S0)
    want = ck.scan_chunks(kind, M, dS, S0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not scan.eligible(kind, M, dS.clone().requires_grad_(), S0)
    assert not scan.eligible(Kind.DENSE, M, dS, S0)


def test_calls_on_the_generated_path_run_its_graphs_and_scan(monkeypatch):
    """A call whose path is ``generated`` (forced here on the CPU) runs the variant's
    generated graphs and scan kernel through the runner, and stays right."""
    from forge_dist import kernels
    from forge_dist.dsl import scan

    if not kernels.HAVE_TRITON or (not torch.cuda.is_available() and
                                   not kernels.interpreting()):
        pytest.skip("needs triton on CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("FORGE_DIST_DSL_TRITON", "1")
    entry = CATALOGUE["gla_output_gate"]
    v = entry.compile(lower=False)
    used = []
    real_scan = scan.scan_chunks
    monkeypatch.setattr(generated, "path_for", lambda v, device: generated.GENERATED)
    monkeypatch.setattr(generated, "compiled_graphs", lambda v: generated.Graphs(
        **vars(generated.eager_graphs(v)) | {"scan": lambda *a: used.append(1) or
                                             real_scan(*a)}))
    x, h0 = entry.problem(21, seed=4)
    with torch.no_grad():
        o, final = v(**{k: t.float() for k, t in x.items()}, scale=SCALE,
                     initial_state=h0.float(), output_final_state=True, chunk_size=CHUNK)
    o_ref, f_ref = entry.reference(x, h0, SCALE)
    assert used and v._compiled is not None
    for a, b in ((o, o_ref), (final, f_ref)):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5


def _template_rows(group, names, strategy="serial"):
    """Entries lowered with shared roles or an epilogue, through their template's kernels
    (interpreted) on this world's ranks under ``strategy`` (forge: the simulated transport):
    relative error against the fp64 recurrence, and whether every part ran a kernel work."""
    from forge_dist import kernels

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    used = []
    real = kernels.make_work
    kernels.make_work = lambda *a, **k: used.append(real(*a, **k)) or used[-1]
    out = {}
    for n in names:
        entry = CATALOGUE[n]
        used.clear()
        x, h0 = entry.problem(8 * world, K=16, V=16, seed=2)
        xs = {k: t.float() for k, t in _shard(x, rank, 8).items()}
        o, final = entry.variant(**xs, scale=SCALE, initial_state=h0.float(),
                                 output_final_state=True, group=group, strategy=strategy)
        parts = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(parts, o.contiguous(), group=group)
        dist.broadcast(final, src=world - 1, group=group)
        o_ref, f_ref = entry.reference(x, h0, SCALE)
        err = max(((a.double() - b).norm() / b.norm()).item()
                  for a, b in ((torch.cat(parts, dim=1), o_ref), (final, f_ref)))
        out[n] = [err, bool(used) and all(w is not None for w in used)]
    return out


def test_shared_roles_and_epilogues_run_their_template_across_ranks():
    """second_decay (a shared decay), input_gate (a broadcast input gate), the output
    gates and Mamba2's skip term (epilogues, also on a vector state), RetNet's constant
    decay and the residual form on two ranks through the template's Triton kernels."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    names = ["second_decay", "input_gate", "output_gate", "gla_output_gate",
             "gated_delta_output_gate", "retnet_head_decay", "mamba2_d_skip",
             "strict_readout", "gated_delta_bonus", "hgrn_output_gate"]
    rows = run_world(2, _template_rows, names, env={"FORGE_DIST_DSL_TRITON": "1",
                                                    "FORGE_DIST_TIMEOUT": "120"})
    for n in names:
        err, kernels_ran = rows[n]
        assert kernels_ran and err < 1e-4, (n, rows[n])


def test_epilogues_and_residuals_under_forge_across_three_ranks():
    """The epilogue and residual forms under forge (the simulated transport carries the
    template's state) on three ranks: the middle rank both receives and sends."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    names = ["mamba2_d_skip", "strict_readout", "gated_delta_bonus", "hgrn_output_gate"]
    rows = run_world(3, _template_rows, names, "forge",
                     env={"FORGE_DIST_DSL_TRITON": "1", "FORGE_DIST_TIMEOUT": "120"})
    for n in names:
        err, kernels_ran = rows[n]
        assert kernels_ran and err < 1e-4, (n, rows[n])
