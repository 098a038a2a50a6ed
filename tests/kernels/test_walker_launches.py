"""The walker's launch records (forge_dist/kernels/walker_launches.py): a summary walk (no
outputs) takes the pattern's own summary tiles, and the states it leaves are the same."""
from __future__ import annotations

import pytest
import torch

from forge_dist import kernels
from forge_dist.kernels import scalar
from forge_dist.kernels.walker_launches import SEGMENTS, walk_launches

from .test_kernels import DEV, make, reference, rel

pytestmark = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="needs triton")

# V = 48 in output tiles of 16 (three programs per head) and summary tiles of 32 (two, the
# second half masked): the summaries and the output walks split V differently
TILES = {"BV": 16, "summary_BV": 32, "summary_warps": 2, "summary_stages": 3}


def test_summary_walks_take_the_summary_tiles():
    cfg = dict(scalar.FUSED_CONFIG, **TILES)
    launches = walk_launches({}, q="q", k="k", v="v", g="g", w=None, h0=None, o="o", ht="ht",
                             B=1, T=256, H=2, K=32, V=48, gate=1, scale=1.0, cfg=cfg,
                             prec="ieee", n_seg=2, summary=SEGMENTS)
    summary, outputs = launches
    assert dict(summary.constexprs)["STORE_O"] is False
    assert (summary.grid[0], summary.num_warps, summary.num_stages) == (2, 2, 3)
    assert dict(outputs.constexprs)["STORE_O"] is True
    assert (outputs.grid[0], outputs.num_warps, outputs.num_stages) == (3, 4, 2)


@pytest.mark.parametrize("variant", ["linear_attn", "simple_gla"])
@pytest.mark.parametrize("n_seg", [1, 3])
def test_summary_tiles_leave_the_recurrences_states(monkeypatch, variant, n_seg):
    """Summary first (summary tiles), then the output walks from an incoming state (output
    tiles): the shard's state from zero, the outputs and the final state equal fp64."""
    for key, n in TILES.items():
        monkeypatch.setitem(scalar.FUSED_CONFIG, key, n)
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", str(n_seg))
    inp = make(variant, 1, 150, 2, 32, 48, seed=3, gate_scale=0.05)
    work = kernels.make_work(variant, inp, None, True)
    delta, _ = work.summary(True)
    _, rz = reference(variant, inp, None)
    assert rel(delta.reshape(rz.shape), rz) <= 1e-4
    S = torch.randn(1, 2, 32, 48, device=DEV)
    o, ht = work.finish(S)
    ro, rh = reference(variant, inp, S)
    assert rel(o, ro) <= 1e-4 and rel(ht.reshape(rh.shape), rh) <= 1e-4


def test_summary_tiles_for_16_bit_operands_up_to_K_128():
    """BV=128 with three stages: 16-bit k and v tiles fit in shared memory (fp32 would need
    about 192 KB); at K = 256 the walk's own tiles hold the state already."""
    for dtype in (torch.bfloat16, torch.float16):
        cfg = scalar.fused_config(128, 128, dtype)
        assert (cfg["summary_BV"], cfg["summary_stages"]) == (128, 3)
    for K, dtype in ((128, torch.float32), (128, None), (256, torch.bfloat16)):
        assert "summary_BV" not in scalar.fused_config(K, K, dtype), (K, dtype)
    # tiles given to a program serve every walk, unless they name the summaries' own
    prog = scalar.forward_program(B=1, T=256, H=2, K=128, V=128, dtype=torch.bfloat16,
                                  gated=True, has_h0=False, scale=1.0, prec="ieee",
                                  execution="decoupled", tiles={"BV": 32}, summary=SEGMENTS)
    summary = next(ln for ln in prog.launches
                   if ln.kernel == "walk" and not dict(ln.constexprs)["STORE_O"])
    assert (summary.grid[0], summary.num_stages) == (4, 2)


def test_summary_tiles_from_the_environment(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_SUMMARY_TILES", "BV=64,num_stages=2")
    cfg = scalar.fused_config(128, 128, torch.bfloat16)
    assert (cfg["summary_BV"], cfg["summary_stages"], cfg["BV"]) == (64, 2, 64)
    monkeypatch.setenv("FORGE_DIST_SUMMARY_TILES", "stages=2")
    with pytest.raises(ValueError, match="FORGE_DIST_SUMMARY_TILES.*'stages=2'"):
        scalar.fused_config(128, 128)
