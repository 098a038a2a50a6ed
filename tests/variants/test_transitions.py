"""The affine algebra: composition is associative, application matches dense matrices,
gradients and tiles are right for every kind."""
import pytest
import torch

from forge_dist.variants import transitions as tr
from forge_dist.variants.transitions import Kind

B, H, K, V = 2, 3, 4, 5
gen = torch.Generator().manual_seed(0)


def rand_M(kind):
    if kind is Kind.IDENTITY:
        return None
    shape = {Kind.SCALAR: (B, H), Kind.DIAGONAL: (B, H, K), Kind.DENSE: (B, H, K, K)}[kind]
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def dense(kind, M):
    """The same transition as an explicit K x K matrix."""
    eye = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    if kind is Kind.IDENTITY:
        return eye
    if kind is Kind.SCALAR:
        return M[..., None, None] * eye
    if kind is Kind.DIAGONAL:
        return torch.diag_embed(M)
    return M


@pytest.mark.parametrize("kind", list(Kind))
def test_apply_compose_transpose(kind):
    S = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    M1, M2, M3 = rand_M(kind), rand_M(kind), rand_M(kind)
    assert torch.allclose(tr.apply(kind, M1, S), dense(kind, M1) @ S)
    assert torch.allclose(tr.apply_transposed(kind, M1, S),
                          dense(kind, M1).transpose(-1, -2) @ S)
    left = tr.compose(kind, M3, tr.compose(kind, M2, M1))
    right = tr.compose(kind, tr.compose(kind, M3, M2), M1)
    assert torch.allclose(dense(kind, left), dense(kind, right))
    assert torch.allclose(dense(kind, left), dense(kind, M3) @ dense(kind, M2) @ dense(kind, M1))


@pytest.mark.parametrize("kind", [Kind.SCALAR, Kind.DIAGONAL, Kind.DENSE])
def test_transition_grad_matches_autograd(kind):
    M = rand_M(kind).requires_grad_()
    S = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    lam = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    (tr.apply(kind, M, S) * lam).sum().backward()
    assert torch.allclose(tr.transition_grad(kind, lam, S), M.grad)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("shape", [(K, V), (7, 1)])
def test_tiles_cover_the_state_and_combine_independently(kind, shape):
    k_dim, v_dim = shape
    if kind is Kind.DENSE and v_dim == 1:
        pytest.skip("a dense state with one column has one tile")
    M = None if kind is Kind.IDENTITY else {
        Kind.SCALAR: torch.rand(B, H), Kind.DIAGONAL: torch.rand(B, H, k_dim),
        Kind.DENSE: torch.rand(B, H, k_dim, k_dim)}[kind].double()
    S = torch.randn(B, H, k_dim, v_dim, dtype=torch.float64)
    dS = torch.randn_like(S)
    whole = tr.combine(kind, M, S, dS)
    tiled = torch.full_like(S, float("nan"))
    tiles = tr.tile_slices(kind, k_dim, v_dim, 3)
    assert len(tiles) > 1
    for ks, vs in tiles:
        tiled[..., ks, vs] = tr.combine(kind, tr.slice_transition(kind, M, ks), S[..., ks, vs],
                                        dS[..., ks, vs])
    assert torch.allclose(tiled, whole)


def test_zero_and_promote():
    z = tr.zero(Kind.IDENTITY, B, H, K, dtype=torch.float64, device="cpu")
    S = torch.randn(B, H, K, V, dtype=torch.float64)
    assert tr.apply(tr.with_boundaries(Kind.IDENTITY), z, S).abs().max() == 0
    ones = tr.promote(Kind.IDENTITY, Kind.SCALAR, None, B, H, K, dtype=torch.float64,
                      device="cpu")
    assert torch.equal(tr.apply(Kind.SCALAR, ones, S), S)
    with pytest.raises(ValueError, match="cannot promote"):
        tr.promote(Kind.DENSE, Kind.SCALAR, torch.eye(K), B, H, K, dtype=torch.float64,
                   device="cpu")
