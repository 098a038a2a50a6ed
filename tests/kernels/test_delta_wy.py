"""The gated-delta-rule WY factors (``kernels.delta.wy``) against fp64, for each design of
``WY_CONFIG`` (two launches or one, the inverse's K tile), on the inputs that broke earlier
inverses: aligned keys (a product-of-powers inverse lost all accuracy there) and gates of
-20 per token, plus a ragged last chunk.  Under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist.kernels import delta  # noqa: E402

from .backward_common import DEV, rel, require_kernels  # noqa: E402

require_kernels()

DESIGNS = {"split": {}, "split_bk16": {"solve_BK": 16}, "fused": {"fused": True}}


def reference(k, v, g, beta, BT=64):
    """fp64 ``(W, U, X)`` per chunk: ``X = (I + A)^{-1}``, ``W = X diag(b e^G) K``,
    ``U = X diag(b) V`` (X in the ``[B, T, H, BT]`` layout of ``wy(store_x=True)``)."""
    B, T, H, K = k.shape
    kd, vd, bd = k.double().cpu(), v.double().cpu(), beta.double().cpu()
    gd = torch.zeros_like(bd) if g is None else g.double().cpu()
    W = torch.zeros(B, T, H, K, dtype=torch.float64)
    U = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    X = torch.zeros(B, T, H, BT, dtype=torch.float64)
    for t0 in range(0, T, BT):
        n = min(T, t0 + BT) - t0
        kc, vc = kd[:, t0:t0 + n].transpose(1, 2), vd[:, t0:t0 + n].transpose(1, 2)
        bc = bd[:, t0:t0 + n].transpose(1, 2)
        G = gd[:, t0:t0 + n].transpose(1, 2).cumsum(-1)
        strict = torch.ones(n, n, dtype=torch.bool).tril(-1)
        decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~strict, float("-inf")))
        A = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
        Xc = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
        W[:, t0:t0 + n] = (Xc @ (kc * (bc * G.exp())[..., None])).transpose(1, 2)
        U[:, t0:t0 + n] = (Xc @ (vc * bc[..., None])).transpose(1, 2)
        X[:, t0:t0 + n, :, :n] = Xc.transpose(1, 2)
    return W, U, X


def _inputs(case, T, gen, H=2, K=32, V=48):
    if case == "random":
        k = torch.randn(1, T, H, K, generator=gen)
        g, beta = -torch.rand(1, T, H, generator=gen) * 0.3, torch.rand(1, T, H, generator=gen)
    elif case == "steep":
        k = torch.randn(1, T, H, K, generator=gen)
        g, beta = torch.full((1, T, H), -20.0), torch.rand(1, T, H, generator=gen)
    else:  # aligned: a shared direction, beta near 1, mild decay
        noise = {"aligned": 1.0, "identical": 0.0}[case]
        k = torch.randn(K, generator=gen) + noise * torch.randn(1, T, H, K, generator=gen)
        g, beta = torch.full((1, T, H), -1e-3), torch.full((1, T, H), 0.99)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, H, V, generator=gen)
    return k, v, g, beta


@pytest.mark.parametrize("design", sorted(DESIGNS))
@pytest.mark.parametrize("case", ["random", "steep", "aligned", "identical"])
def test_delta_wy_designs_match_fp64(monkeypatch, design, case):
    """fp32 inputs: W, U and the kept inverse X at fp32 accuracy, X zero above each chunk's
    diagonal, for every design (T=100: one full and one ragged chunk)."""
    for key, value in DESIGNS[design].items():
        monkeypatch.setitem(delta.WY_CONFIG, key, value)
    gen = torch.Generator().manual_seed(11)
    k, v, g, beta = (t.to(DEV) for t in _inputs(case, 100, gen))
    for gate in (g, None):
        W, U, X = reference(k, v, gate, beta)
        w, u, xs = delta.wy(k, v, gate, beta, BT=64, prec="ieee" if DEV == "cpu" else "tf32x3",
                            dtype=torch.float32, store_x=True)
        assert xs.dtype == torch.float32 and torch.isfinite(w).all() and torch.isfinite(u).all()
        errs = (rel(w, W), rel(u, U), rel(xs, X))
        assert max(errs) < 1e-5, (gate is None, errs)
        upper = torch.ones(64, 64, dtype=torch.bool).triu(1)
        x_chunk = xs[:, :64].cpu().permute(0, 2, 1, 3)  # [B, H, row, col]
        assert (x_chunk[..., upper] == 0).all()


@pytest.fixture
def bf16_dots(monkeypatch):
    """Triton 3.6's interpreter multiplies bf16 tensors as their raw uint16 bits: widen them
    to fp32 for this test (the GPU needs nothing)."""
    if DEV != "cpu":
        return
    from triton.runtime import interpreter as it

    from forge_dist.kernels.compat import interpreter_bf16_dot

    monkeypatch.setattr(it.InterpreterBuilder, "create_dot",
                        interpreter_bf16_dot(it.InterpreterBuilder.create_dot))


@pytest.mark.parametrize("x_dtype", ["input", "fp32"])
@pytest.mark.parametrize("design", ["split", "fused"])
def test_delta_wy_bf16_inputs(monkeypatch, bf16_dots, x_dtype, design):
    """bf16 inputs: X kept in bf16 (W, U from bf16 operands) or fp32 (TF32 products); W and
    U in bf16 at the bf16 level against fp64 on the same bf16 values (the interpreter rounds
    to bf16 by truncation: about twice the GPU's error)."""
    monkeypatch.setitem(delta.WY_CONFIG, "x_dtype", x_dtype)
    for key, value in DESIGNS[design].items():
        monkeypatch.setitem(delta.WY_CONFIG, key, value)
    gen = torch.Generator().manual_seed(12)
    k, v, g, beta = _inputs("random", 100, gen)
    k, v = k.bfloat16(), v.bfloat16()
    W, U, _ = reference(k, v, g, beta)
    k, v, g, beta = (t.to(DEV) for t in (k, v, g, beta))
    assert delta.wy_x_dtype(k.dtype) == (torch.bfloat16 if x_dtype == "input" else torch.float32)
    w, u = delta.wy(k, v, g, beta, BT=64, prec="ieee" if DEV == "cpu" else "tf32",
                    dtype=torch.bfloat16)
    assert w.dtype == u.dtype == torch.bfloat16
    assert rel(w, W) < 1.5e-2 and rel(u, U) < 1.5e-2, (rel(w, W), rel(u, U))


def test_delta_wy_kernels_compile_for_sm90(monkeypatch, tmp_path):
    """The launches of both designs for bf16 inputs (bf16 X, the benchmark's) and of the
    backward's fp32 X compile for Hopper with Triton's compiler and ptxas, no GPU needed."""
    from forge_dist.runtime import aot

    if aot.ptxas_version("cuda:90") is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    specs = delta.wy_kernel_specs(128, 128, dtype=torch.bfloat16)
    specs += delta.wy_kernel_specs(128, 128, dtype=torch.bfloat16, store_x=True)
    specs += delta.wy_kernel_specs(128, 128, dtype=torch.bfloat16, store_a=True)[1:]
    monkeypatch.setitem(delta.WY_CONFIG, "fused", True)
    specs += delta.wy_kernel_specs(128, 128, dtype=torch.bfloat16)
    assert len({s.key for s in specs}) == len(specs) == 6
    rep = aot.compile_specs(specs, tmp_path / "cache")
    assert sorted(rep["compiled"]) == sorted(s.key for s in specs), rep


@pytest.mark.parametrize("raw,msg", [("BV=24", "BV=24"), ("num_warps=3", "num_warps=3"),
                                     ("BK=16", "BK=16"), ("BV=8", "BV=8"),
                                     ("num_stages=0", "num_stages=0")])
def test_summary_tiles_switch_is_checked(monkeypatch, raw, msg):
    """FORGE_DIST_DENSE_SUMMARY_TILES: only the summary walks' tile keys, with values a
    kernel compiles for; a bad one is named as written."""
    from forge_dist.kernels.delta import summary_config

    monkeypatch.setenv("FORGE_DIST_DENSE_SUMMARY_TILES", raw)
    with pytest.raises(ValueError, match=f"got '{msg}'"):
        summary_config(128, 128, torch.bfloat16)
    monkeypatch.setenv("FORGE_DIST_DENSE_SUMMARY_TILES", "BV=16, num_warps=2,num_stages=3")
    cfg = summary_config(128, 128, torch.bfloat16)
    assert (cfg["BV"], cfg["num_warps"], cfg["num_stages"]) == (16, 2, 3)


def test_summary_pieces_cover_the_shard(monkeypatch):
    """A rank's summary walks go in pieces of at least PIECE_MIN_CHUNKS chunks (one piece
    below that), SUMMARY_PIECES at long shards; FORGE_DIST_DENSE_SUMMARY_PIECES sets the
    count (at most one piece per chunk) and a bad value is named as written."""
    monkeypatch.delenv("FORGE_DIST_DENSE_SUMMARY_PIECES", raising=False)
    assert delta.summary_pieces(96) == [(0, 2)]
    assert delta.summary_pieces(16384) == [(0, 128), (128, 128)]
    assert len(delta.summary_pieces(1 << 20)) == delta.SUMMARY_PIECES
    for T in (96, 1000, 32768, 32768 + 5):
        for env in (None, "3", "64"):
            if env is None:
                monkeypatch.delenv("FORGE_DIST_DENSE_SUMMARY_PIECES", raising=False)
            else:
                monkeypatch.setenv("FORGE_DIST_DENSE_SUMMARY_PIECES", env)
            pieces = delta.summary_pieces(T)
            n = -(-T // delta.WY_BT)
            assert pieces[0][0] == 0 and sum(c for _, c in pieces) == n
            assert all(lo + c == nxt for (lo, c), (nxt, _) in zip(pieces, pieces[1:]))
            assert min(c for _, c in pieces) >= 1
            want = (min(int(env), n) if env is not None else
                    max(1, min(delta.SUMMARY_PIECES, n // delta.PIECE_MIN_CHUNKS)))
            assert len(pieces) == want
    monkeypatch.setenv("FORGE_DIST_DENSE_SUMMARY_PIECES", "0")
    with pytest.raises(ValueError, match="FORGE_DIST_DENSE_SUMMARY_PIECES.*'0'"):
        delta.summary_pieces(1024)
