"""Every layer at SP = 2 (and GDN at SP = 3) against the same layer at SP = 1.

Inside one gloo world each rank runs the whole sequence single-device (``group=None``) and then
its shard with the group; outputs are gathered, input gradients gathered and parameter
gradients summed over ranks, and all compared with the single-device run.  Packed layouts put
documents across rank boundaries, including one that starts two tokens before a boundary
(the convolution halo must carry its tokens) and one that starts right after it (the halo must
be masked).
"""
import torch

from tests.sp.distributed import run_world

from .helpers import FACTORIES, gather_tokens, make_layer, rel_err, sum_ranks

T_LOCAL = 12
# For T = 24 (2 ranks): [10, 13) straddles the boundary at 12; 13 starts right after it.
CU = {2: [0, 10, 13, 24], 3: [0, 5, 11, 13, 26, 36]}


def _compare(group, name, dtype, packed, world, strategy="auto"):
    rank = torch.distributed.get_rank(group)
    T = T_LOCAL * world
    B = 1 if packed else 2
    cu = torch.tensor(CU[world]) if packed else None
    layer = make_layer(name, dtype, strategy=strategy)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, 16, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(B, T, 16, generator=gen, dtype=torch.float64).to(dtype)

    x1 = x.clone().requires_grad_()
    o1 = layer(x1, cu_seqlens=cu, group=None)[0]
    (o1 * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)

    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    xs = x[:, sl].clone().requires_grad_()
    o = layer(xs, cu_seqlens=cu, group=group)[0]
    (o * w[:, sl]).sum().backward()
    errs = {"out": rel_err(gather_tokens(o.detach(), group), o1),
            "dx": rel_err(gather_tokens(xs.grad, group), x1.grad)}
    for n, p in layer.named_parameters():
        errs["d." + n] = rel_err(sum_ranks(p.grad, group), ref_grads[n])
    return errs


def _all_layers(group):
    world = torch.distributed.get_world_size(group)
    out = {}
    for name in FACTORIES:
        for dtype in (torch.float64, torch.float32):
            for packed in (False, True):
                prec = "fp64" if dtype == torch.float64 else "fp32"
                key = f"{name}/{prec}/{'packed' if packed else 'batched'}"
                out[key] = _compare(group, name, dtype, packed, world)
    return out


def _gdn_three(group):
    out = {}
    for strategy in ("serial", "lasp2", "pipelined"):
        for packed in (False, True):
            out[f"gdn/fp64/{strategy}/{packed}"] = _compare(group, "gdn", torch.float64, packed, 3,
                                                       strategy)
    out["mamba2/fp32/packed"] = _compare(group, "mamba2", torch.float32, True, 3)
    return out


def _check(results):
    bad = []
    for key, errs in results.items():
        tol = 1e-5 if "/fp32" in key else 1e-10  # fp32: rtol 1e-5 (brief); fp64: tight
        for what, e in errs.items():
            if not e <= tol:
                bad.append(f"{key} {what}: {e:.2e} > {tol:g}")
    assert not bad, "\n".join(bad)


def test_every_layer_sp2_matches_sp1():
    results = run_world(2, _all_layers)
    assert len(results) == len(FACTORIES) * 4
    _check(results)


def test_sp3_strategies_match_sp1():
    _check(run_world(3, _gdn_three))
