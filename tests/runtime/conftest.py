"""The sm_90 kernel cache that the static-dispatcher tests share (compiled once a session)."""
import pytest

from forge_dist.runtime import aot

from .static_fakes import SMALL, TARGET


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """``(cache dir, compile report)`` of :data:`SMALL` compiled for sm_90 on this CPU."""
    if aot.ptxas_version(TARGET) is None:
        pytest.skip("Triton's bundled ptxas is not available here")
    d = tmp_path_factory.mktemp("aot") / "cache"
    rep = aot.compile_all(SMALL, target=TARGET, cache_dir=d)
    return d, rep
