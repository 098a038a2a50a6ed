"""``prepare()`` of the decay works: segment states are kept only when the summary runs
segments (with one, the finish walks from the incoming state and would never read them).
Under TRITON_INTERPRET=1 on the CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from forge_dist import kernels  # noqa: E402

from .backward_common import require_kernels  # noqa: E402

require_kernels()


@pytest.mark.parametrize("variant", ["simple_gla", "gla"])
@pytest.mark.parametrize("segments", ["1", "2"])
def test_prepare_keeps_states_only_for_segments(variant, segments, monkeypatch):
    monkeypatch.setenv("FORGE_DIST_SEGMENTS", segments)
    gen = torch.Generator().manual_seed(2)
    B, T, H, K, V = 1, 160, 2, 16, 16
    g_shape = (B, T, H) if variant == "simple_gla" else (B, T, H, K)
    inputs = {"q": torch.randn(B, T, H, K, generator=gen),
              "k": torch.randn(B, T, H, K, generator=gen),
              "v": torch.randn(B, T, H, V, generator=gen),
              "g": -torch.rand(*g_shape, generator=gen) * 0.2}
    S_in = torch.randn(B, H, K, V, generator=gen)
    work = kernels.make_work(variant, inputs, None, False)
    work.prepare()
    assert (work.segments is not None) == (segments != "1")
    o, ht = work.finish(S_in)
    want_o, want_ht = kernels.make_work(variant, inputs, None, False).finish(S_in)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, want_ht, rtol=1e-5, atol=1e-5)
