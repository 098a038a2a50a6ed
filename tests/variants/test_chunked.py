"""variants.chunked.LogDecay: in-chunk decays through hard resets (``g = -inf``), against
products of ``exp(g)`` taken token by token (where a reset is an exact 0)."""
import pytest
import torch

from forge_dist.variants import chunked as ck


def _gates(C=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = -torch.rand(3, C, generator=gen, dtype=torch.float64)
    g[0, [0, 5, 6, C - 1]] = float("-inf")  # first, back to back, last
    g[1] = float("-inf")                      # every token
    return g                                  # row 2: no reset


def _product(g, j, i):
    """exp(g_{j+1} + ... + g_i) as a product of exp(g_t) (1 when j == i)."""
    return torch.exp(g[..., j + 1:i + 1]).prod(-1)


@pytest.mark.parametrize("strict", [False, True])
def test_matrix_is_the_product_of_the_decays_between(strict):
    g = _gates()
    C = g.shape[-1]
    D = ck.LogDecay(g, dim=-1).matrix(strict=strict)
    assert torch.isfinite(D).all()
    for i in range(C):
        for j in range(C):
            kept = i > j or (i == j and not strict)
            want = _product(g, j, i) if kept else torch.zeros_like(D[..., 0, 0])
            torch.testing.assert_close(D[..., i, j], want, rtol=1e-12, atol=0)


def test_from_start_to_end_and_total():
    g = _gates()
    C = g.shape[-1]
    d = ck.LogDecay(g, dim=-1)
    padded = torch.cat([torch.zeros_like(g[..., :1]), g], -1)  # a token of g = 0 before
    torch.testing.assert_close(d.from_start(), torch.stack(
        [_product(padded, 0, i + 1) for i in range(C)], -1), rtol=1e-12, atol=0)
    torch.testing.assert_close(d.to_end(), torch.stack(
        [_product(g, j, C - 1) for j in range(C)], -1), rtol=1e-12, atol=0)
    torch.testing.assert_close(d.total(), torch.exp(g).prod(-1), rtol=1e-12, atol=0)


def test_gradients_are_finite_and_zero_at_resets():
    g = _gates().requires_grad_()
    d = ck.LogDecay(g, dim=-1)
    (d.matrix().sum() + d.from_start().sum() + d.to_end().sum() + d.total().sum()).backward()
    assert torch.isfinite(g.grad).all()
    assert (g.grad[torch.isneginf(g)] == 0).all()


def test_token_axis_not_last_is_refused_by_matrix():
    with pytest.raises(ValueError, match="last"):
        ck.LogDecay(torch.zeros(4, 3), dim=0).matrix()
