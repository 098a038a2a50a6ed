"""Cross-rank argument agreement (forge_dist.sp.agreement) in 2- and 3-rank gloo worlds.

A new signature is agreed with one host all-gather; a repeated one makes no collective and is
checked through the signature word that travels with the state.  These tests check both halves
and the messages users see.
"""
import pytest
import torch

from .distributed import run_world

STRATEGIES = ["serial", "lasp2", "pipelined", "scan"]


def _inputs(T, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, 2, 8, generator=gen, dtype=dtype) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 2, generator=gen, dtype=dtype) + 3)
    return q, k, v, g


def _shard(t, rank, T):
    return t[:, rank * T:(rank + 1) * T].contiguous()


def _count_host_agreements_made():
    """Wrap the host agreement with a counter; returns the list that grows per agreement."""
    from forge_dist.sp import agreement

    calls = []
    original = agreement._agree_on_host

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)
    agreement._agree_on_host = counting
    return calls


def _count_host_agreements(group, strategy):
    import torch.distributed as dist

    from forge_dist import ops

    calls = _count_host_agreements_made()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    T = 16
    q, k, v, g = _inputs(T * size, 0)
    ref = ops.simple_gla(q, k, v, g)[0]
    errs = []
    for _ in range(3):  # the same signature three times
        o = ops.simple_gla(*(_shard(t, rank, T) for t in (q, k, v, g)), group=group,
                           strategy=strategy)[0]
        errs.append(float((o - _shard(ref, rank, T)).abs().max()))
    return {"agreements": len(calls), "err": max(errs)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_repeated_signature_is_agreed_once(strategy):
    out = run_world(2, _count_host_agreements, strategy)
    assert out["agreements"] == 1, out
    assert out["err"] < 1e-10, out


def _packing_call(group, strategy, cus):
    """Call simple_gla with this rank's cu_seqlens for each call in ``cus`` (a list of
    per-rank offsets); return each call's error text (or None) and whether o had NaN."""
    import torch.distributed as dist

    from forge_dist import ops, sp

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    T = 64
    q, k, v, g = _inputs(T * size, 1)
    rows = []
    for per_rank in cus:
        cu = torch.tensor(per_rank[rank], dtype=torch.int64)
        try:
            o = ops.simple_gla(*(_shard(t, rank, T) for t in (q, k, v, g)), cu_seqlens=cu,
                               group=group, strategy=strategy)[0]
            sp.flush()
            rows.append({"error": None, "nan": bool(torch.isnan(o).any())})
        except ValueError as err:
            rows.append({"error": str(err), "nan": None})
    everyone = [None] * size
    dist.all_gather_object(everyone, rows, group=group)
    dist.barrier(group=group)  # nobody tears the group down while a peer still gathers
    return everyone


SAME = [0, 50, 100, 192]
OTHER = [0, 53, 98, 192]  # the same weighted sum (1168) as SAME, which the old check summed


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_different_packings_with_equal_weighted_sums_are_refused(strategy):
    rows = run_world(3, _packing_call, strategy, [[SAME, OTHER, SAME]])
    for r in range(3):
        err = rows[r][0]["error"]
        assert err is not None and err.startswith("cu_seqlens:"), rows[r]
        assert "differ first at position 1" in err and "50" in err and "53" in err, err


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_changed_packing_on_an_agreed_signature_is_caught_on_the_device(strategy):
    # call 1 agrees the signature; in call 2 rank 1 alone changes its packing (same number
    # of offsets, so no new signature and no host collective)
    rows = run_world(3, _packing_call, strategy, [[SAME] * 3, [SAME, OTHER, SAME]])
    for r in range(3):
        assert rows[r][0] == {"error": None, "nan": False}, rows[r]
    caught = [r for r in range(3) if rows[r][1]["error"] is not None]
    # serial/pipelined: rank 1 (its peer's word differs) and rank 2 (rank 1's word, and a
    # poisoned state); lasp2: every rank sees every other's word
    assert 1 in caught and 2 in caught, rows
    for r in caught:
        assert "every rank must pass the same value" in rows[r][1]["error"], rows[r]
    # rank 1 knows rank 0's packing (agreed in call 1), so it names the argument
    assert rows[1][1]["error"].startswith("rank 1: cu_seqlens:"), rows[1]
    for r in range(3):
        if r not in caught:
            assert rows[r][1] == {"error": None, "nan": False}, rows


def _mismatch(group, what):
    import torch.distributed as dist

    from forge_dist import ops

    rank = dist.get_rank(group)
    dtype = torch.float64 if (what == "dtype" and rank == 1) else torch.float32
    strategy = "lasp2" if (what == "strategy" and rank == 1) else "serial"
    q, k, v, g = _inputs(16, 0, dtype)
    try:
        ops.simple_gla(q, k, v, g.float(), group=group, strategy=strategy)
        return None
    except ValueError as err:
        return str(err)


def test_a_dtype_mismatch_names_the_dtypes():
    err = run_world(2, _mismatch, "dtype")
    assert err == ("dtype: every rank must pass the same value, but rank 0 has torch.float32 "
                   "and rank 1 has torch.float64"), err


def test_a_strategy_mismatch_names_the_strategies():
    err = run_world(2, _mismatch, "strategy")
    assert err == ("strategy: every rank must pass the same value, but rank 0 has 'serial' "
                   "and rank 1 has 'lasp2'"), err


def _reset_then_agree_again(group):
    from forge_dist import ops, sp

    calls = _count_host_agreements_made()
    q, k, v, g = _inputs(16, 0)
    ops.simple_gla(q, k, v, g, group=group, strategy="serial")
    ops.simple_gla(q, k, v, g, group=group, strategy="serial")
    sp.reset(group)  # every rank: the signature is agreed anew
    ops.simple_gla(q, k, v, g, group=group, strategy="serial")
    return len(calls)


def test_reset_forgets_the_agreed_signatures():
    assert run_world(2, _reset_then_agree_again) == 2


def _forge_other_length(group):
    """Both lengths agreed on every rank; then rank 1 alone calls with the other length
    (no host collective for either): forge's receiver finds it from the tile's word."""
    import torch.distributed as dist

    from forge_dist import ops, sp

    rank = dist.get_rank(group)
    full = {T: _inputs(2 * T, 3, torch.float32) for T in (16, 32)}

    def call(T):
        with torch.no_grad():  # the forward of a plan: the state pass folds in the kernel
            return ops.simple_gla(*(_shard(t, rank, T) for t in full[T]), group=group,
                                  strategy="forge")[0]
    for T in (16, 32):
        call(T)
    sp.flush()
    error, nan = None, None
    try:  # raised by this call (the CPU reads the flag at once) or by the flush (GPU)
        o = call(16 if rank == 0 else 32)
        nan = bool(torch.isnan(o).any())
        sp.flush()
    except sp.agreement.SignatureMismatch as err:
        error = str(err)
    for T in (16, 32):  # the group stays usable
        again = call(T)
    sp.flush()
    everyone = [None] * 2
    dist.all_gather_object(everyone, {"error": error, "nan": nan,
                                      "after": bool(torch.isnan(again).any())}, group=group)
    dist.barrier(group=group)
    return everyone


def test_forge_finds_a_changed_length_on_the_device_and_raises_the_argument_error():
    rows = run_world(2, _forge_other_length, env={"TRITON_INTERPRET": "1",
                                                  "FORGE_DIST_TIMEOUT": "60"})
    assert rows[0] == {"error": None, "nan": False, "after": False}, rows
    assert rows[1]["nan"] in (True, None) and not rows[1]["after"], rows
    assert rows[1]["error"].startswith(
        "rank 1: T (tokens per rank): every rank must pass the same value, but this rank has "
        "32 and rank 0 has 16"), rows
