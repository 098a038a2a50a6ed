"""Hard resets: ``g = -inf`` (a log decay that forgets the state, written on purpose) gives
finite outputs, final states and gradients equal to the fp64 recurrence, for every gated op,
on one rank and on three gloo ranks (lasp2, serial, pipelined), through the PyTorch chunk
forms and through the Triton kernels (``TRITON_INTERPRET=1``).

The resets sit where a cumulative sum inside a chunk used to turn them into NaN: a chunk's
first and last token (for chunks of 16, 32 and 64 tokens), back to back, and a whole chunk
(tokens 64..127, which is also rank 1's whole shard on three ranks); tokens 0..14 keep the
initial state alive, so its gradient is checked too.  Before the fix every
case below returned NaN."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from forge_dist.selftest import call_op, call_reference, rel_err

from ..sp.distributed import run_world

GATED = ("simple_gla", "gla", "gated_delta_rule", "hgrn")
T = 192
RESET_TOKENS = [15, 16, 31, 32, 63, *range(64, 128), 128, 150, 190, 191]
TRITON = {"TRITON_INTERPRET": "1", "FORGE_DIST_KERNELS": "triton", "FORGE_DIST_TIMEOUT": "120"}
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def reset_problem(op: str, seed: int = 0):
    """fp64 inputs of ``op`` over ``T`` tokens with hard resets at ``RESET_TOKENS`` (gla: and
    at 5 % of the other (token, channel) pairs), plus an initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    B, H, K, V = 1, 2, 16, 16
    if op == "hgrn":
        t = {"x": randn(B, T, K), "g": F.logsigmoid(randn(B, T, K) + 2.0),
             "initial_state": randn(B, K)}
    else:
        t = {"q": randn(B, T, H, K), "k": F.normalize(randn(B, T, H, K), dim=-1),
             "v": randn(B, T, H, V), "initial_state": randn(B, H, K, V)}
        t["g"] = F.logsigmoid(randn(*((B, T, H, K) if op == "gla" else (B, T, H))) + 2.0)
        if op == "gated_delta_rule":
            t["beta"] = torch.sigmoid(randn(B, T, H))
    t["g"][:, RESET_TOKENS] = float("-inf")
    if op == "gla":
        more = torch.rand(t["g"].shape, generator=gen, dtype=torch.float64) < 0.05
        t["g"] = t["g"].masked_fill(more, float("-inf"))
    return t


def _gather(x, group, world):
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reset_errors(op: str, strategy: str, dtype: torch.dtype, group=None) -> dict:
    """Relative errors of o, the final state and every gradient against the fp64 recurrence
    (collective over ``group``; ``inf`` where a value is not finite)."""
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    full = reset_problem(op)
    shard = slice(rank * T // world, (rank + 1) * T // world)
    mine = {n: (x if n == "initial_state" else x[:, shard]).to(dtype).clone()
            for n, x in full.items()}
    mine = {n: x.requires_grad_() for n, x in mine.items()}
    o, final = call_op(op, mine, output_final_state=True, group=group, strategy=strategy)
    gen = torch.Generator().manual_seed(1)
    w_o = torch.randn((1, T) + tuple(o.shape[2:]), generator=gen, dtype=torch.float64)
    w_s = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    last = rank == world - 1
    loss = (o * w_o[:, shard].to(dtype)).sum() + ((final * w_s.to(dtype)).sum() if last else 0)
    loss.backward()

    master = {n: x.clone().requires_grad_() for n, x in full.items()}
    o_ref, final_ref = call_reference(op, master, output_final_state=True)
    ((o_ref * w_o).sum() + (final_ref * w_s).sum()).backward()

    def err(a, b):
        return rel_err(a, b) if torch.isfinite(a).all() else float("inf")
    final = final.detach().clone()
    if world > 1:
        dist.broadcast(final, src=world - 1, group=group)
    errors = {"o": err(_gather(o.detach(), group, world), o_ref),
              "final_state": err(final, final_ref)}
    for n, x in mine.items():
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if n == "initial_state":
            if world > 1:
                dist.all_reduce(grad, group=group)
        else:
            grad = _gather(grad, group, world)
        errors["d" + n] = err(grad, master[n].grad)
    return errors


def _rows(group, cases):
    import os

    torch.set_num_threads(1)  # three ranks share the machine's cores
    rows = []
    for op, strategy, dtype, path in cases:
        os.environ["FORGE_DIST_KERNELS"] = path  # read per call
        rows.append([op, strategy, str(dtype), path,
                     reset_errors(op, strategy, dtype, group)])
    return rows


def _check(errors, dtype):
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, f"relative error above {TOL[dtype]:g} (inf: not finite): {bad}"
    assert {"o", "final_state", "dg", "dinitial_state"} <= set(errors)


# The kernels of hgrn run no in-chunk cumulative sums (a scan of the affine steps), and
# take the interpreter ~30 s at this length: hgrn's resets are checked on the PyTorch path.
KERNEL_OPS = ("simple_gla", "gla", "gated_delta_rule")
# Three ranks, one world: the PyTorch path in fp64 (exact) on lasp2 and in fp32 on serial
# and pipelined (the strategies are bitwise identical to one another otherwise,
# tests/robustness/test_determinism.py), and the kernels on lasp2.
WORLD = ([(op, "lasp2", torch.float64, "torch") for op in GATED]
         + [(op, s, torch.float32, "torch") for op in GATED for s in ("serial", "pipelined")]
         + [(op, "lasp2", torch.float32, "triton") for op in KERNEL_OPS])


@functools.lru_cache(maxsize=None)
def _world_results():
    rows = run_world(3, _rows, WORLD, env=TRITON)
    return {(op, s, d, path): e for op, s, d, path, e in rows}


@pytest.mark.parametrize("op", GATED)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_hard_resets_one_rank_torch_path(op, dtype, monkeypatch):
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    _check(reset_errors(op, "auto", dtype), dtype)


@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule"])  # gla: ~10 s, 3 ranks only
def test_hard_resets_one_rank_kernels(op, monkeypatch):
    pytest.importorskip("triton")
    from forge_dist.kernels import interpreting

    if not interpreting():  # set before Triton's import (tests/conftest.py, without CUDA)
        pytest.skip("needs the Triton interpreter; the GPU runs test_numerics_gpu.py")
    for k, v in TRITON.items():
        monkeypatch.setenv(k, v)
    from forge_dist.ops import attention
    assert attention._use_kernels(torch.device("cpu")), "the kernel path is not selected"
    _check(reset_errors(op, "auto", torch.float32), torch.float32)


@pytest.mark.parametrize("case", WORLD, ids=lambda c: "-".join(map(str, c)))
def test_hard_resets_three_ranks(case):
    if case[3] == "triton":
        pytest.importorskip("triton")
    op, strategy, dtype, path = case
    _check(_world_results()[(op, strategy, str(dtype), path)], dtype)


def test_reset_is_an_exact_zero_of_the_carried_state(monkeypatch):
    """What precedes a reset cannot leak: outputs from the reset on do not change when
    everything before it (inputs and initial state) is replaced."""
    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    t = {n: x.float() for n, x in reset_problem("simple_gla").items()}
    other = {n: x.clone() for n, x in t.items()}
    for n in ("q", "k", "v"):
        other[n][:, :150] = torch.randn_like(other[n][:, :150]) * 100
    other["initial_state"] = other["initial_state"] * 1e6
    a, _ = call_op("simple_gla", t)
    b, _ = call_op("simple_gla", other)
    assert torch.equal(a[:, 150:], b[:, 150:])


@pytest.mark.parametrize("op", GATED)
def test_finite_check_mode_takes_hard_resets_and_still_catches_nan(op, monkeypatch):
    """``FORGE_DIST_CHECK_FINITE=1`` lets a gate's ``-inf`` through (a reset is meant) and
    still names a NaN in the same gate."""
    from forge_dist.ops.checks import NonFiniteError

    monkeypatch.setenv("FORGE_DIST_KERNELS", "torch")
    monkeypatch.setenv("FORGE_DIST_CHECK_FINITE", "1")
    t = reset_problem(op)
    call_op(op, t, output_final_state=True)  # no error
    t["g"][0, 5] = float("nan")
    with pytest.raises(NonFiniteError, match=r"\(nan\) in input 'g'"):
        call_op(op, t, output_final_state=True)
