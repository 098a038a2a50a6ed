"""Bad input gets a clear error naming the argument and what was expected, before any
communication, on every rank (docs/design.md section 9; issue 2's list)."""
import pytest
import torch

from forge_dist import ops

from ..sp.distributed import run_world


def _qkv(B=1, T=16, H=2, K=4, V=3, dtype=torch.float32):
    return (torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype),
            torch.randn(B, T, H, V, dtype=dtype))


def _gates(B=1, T=16, H=2, K=4):
    return -torch.rand(B, T, H), -torch.rand(B, T, H, K), torch.rand(B, T, H)


CASES = {
    # name: (callable, exception type, words the message must contain)
    "k batch differs": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k[:, :, :1], v),
                        ValueError, ["k:", "[1, 16, 2, 4]"]),
    "v length differs": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k, v[:, :8]),
                         ValueError, ["v:", "dimension 1"]),
    "q not 4-D": (lambda q, k, v, g, gk, b: ops.linear_attn(q[0], k, v),
                  ValueError, ["q:", "4 dimensions"]),
    "g heads differ": (lambda q, k, v, g, gk, b: ops.simple_gla(q, k, v, g[..., :1]),
                       ValueError, ["g:", "[1, 16, 2]"]),
    "gla g is scalar": (lambda q, k, v, g, gk, b: ops.gla(q, k, v, g),
                        ValueError, ["g:", "4 dimensions"]),
    "beta shape": (lambda q, k, v, g, gk, b: ops.gated_delta_rule(q, k, v, g, b[:, :3]),
                   ValueError, ["beta:"]),
    "g_gamma shape": (lambda q, k, v, g, gk, b: ops.simple_gla(q, k, v, g_gamma=torch.ones(3)),
                      ValueError, ["g_gamma:", "[2]"]),
    "initial_state V": (lambda q, k, v, g, gk, b: ops.simple_gla(
        q, k, v, g, initial_state=torch.zeros(1, 2, 4, 4)), ValueError,
        ["initial_state:", "[1, 2, 4, 3]"]),
    "initial_state batch": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, initial_state=torch.zeros(2, 2, 4, 3)), ValueError, ["initial_state:"]),
    "integer q": (lambda q, k, v, g, gk, b: ops.linear_attn(q.long(), k, v),
                  TypeError, ["q:", "floating"]),
    "integer g": (lambda q, k, v, g, gk, b: ops.simple_gla(q, k, v, g.long()),
                  TypeError, ["g:", "floating"]),
    "mixed q/k dtypes": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k.double(), v),
                         TypeError, ["k:", "float32", "float64"]),
    "k on another device": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k.to("meta"), v),
                            ValueError, ["k:", "meta"]),
    "g on another device": (lambda q, k, v, g, gk, b: ops.simple_gla(q, k, v, g.to("meta")),
                            ValueError, ["g:", "meta"]),
    "hgrn g shape": (lambda q, k, v, g, gk, b: ops.hgrn(q[:, :, 0], gk[:, :, 0, :2]),
                     ValueError, ["g:"]),
    "cu_seqlens with B=2": (lambda q, k, v, g, gk, b: ops.linear_attn(
        *_qkv(B=2), cu_seqlens=torch.tensor([0, 16])), ValueError, ["cu_seqlens:", "B=2"]),
    "cu_seqlens not from 0": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([1, 16])), ValueError, ["cu_seqlens:", "start at 0"]),
    "cu_seqlens not increasing": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0, 9, 9, 16])), ValueError,
        ["cu_seqlens:", "strictly increasing"]),
    "cu_seqlens wrong end": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0, 8, 15])), ValueError,
        ["cu_seqlens:", "global length 16"]),
    "cu_seqlens float": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0.0, 16.0])), ValueError, ["cu_seqlens:", "int"]),
    "varlen initial_state rows": (lambda q, k, v, g, gk, b: ops.linear_attn(
        q, k, v, cu_seqlens=torch.tensor([0, 4, 16]), initial_state=torch.zeros(1, 2, 4, 3)),
        ValueError, ["initial_state:", "[2, 2, 4, 3]"]),
    "unknown strategy": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k, v, strategy="ring"),
                         ValueError, ["strategy:", "'ring'", "lasp2"]),
    "group not a group": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k, v, group="world"),
                          ValueError, ["group:"]),
    "scale not finite": (lambda q, k, v, g, gk, b: ops.linear_attn(q, k, v, scale=float("nan")),
                         ValueError, ["scale:"]),
    "empty sequence": (lambda q, k, v, g, gk, b: ops.linear_attn(q[:, :0], k[:, :0], v[:, :0]),
                       ValueError, ["q:", "empty"]),
    "lightning layer_idx": (lambda q, k, v, g, gk, b: ops.lightning_attn(
        q, k, v, layer_idx=5, num_layers=4), ValueError, ["layer_idx:"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case):
    fn, exc, words = CASES[case]
    q, k, v = _qkv()
    g, gk, b = _gates()
    with pytest.raises(exc) as info:
        fn(q, k, v, g, gk, b)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_group_without_init_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        ops.linear_attn(*_qkv(), group=object())


def _mismatch(group, what):
    """Each rank makes one inconsistent call and reports the error it raised."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    T = 16 if (what != "shard length" or rank == 0) else 12
    q, k, v = _qkv(T=T)
    kwargs = {}
    if what == "strategy":
        kwargs["strategy"] = "serial" if rank == 0 else "lasp2"
    if what == "dtype" and rank == 1:
        q, k, v = (t.double() for t in (q, k, v))
    if what == "cu_seqlens":
        kwargs["cu_seqlens"] = torch.tensor([0, 5 + rank, 32])
    try:
        ops.linear_attn(q, k, v, group=group, **kwargs)
    except ValueError as err:
        # Everyone must still be able to talk: a barrier proves no rank is stuck.
        dist.barrier(group=group)
        return {"rank": rank, "error": str(err)}
    return {"rank": rank, "error": None}


@pytest.mark.parametrize("what,words", [
    ("shard length", ["T (tokens per rank)", "rank 0 has 16", "rank 1 has 12"]),
    ("strategy", ["strategy: every rank must pass the same value"]),
    ("dtype", ["dtype: every rank must pass the same value"]),
    ("cu_seqlens", ["cu_seqlens: every rank must pass the same values, but rank 0 and rank 1 "
                    "differ first at position 1: rank 0 has 5 and rank 1 has 6"]),
])
def test_mismatch_across_ranks_raises_on_every_rank(what, words):
    results = run_world(2, _gather_for, what)
    assert all(r["error"] is not None for r in results), results
    for r in results:
        for word in words:
            assert word in r["error"], r["error"]


def _gather_for(group, what):
    import torch.distributed as dist

    mine = _mismatch(group, what)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone
