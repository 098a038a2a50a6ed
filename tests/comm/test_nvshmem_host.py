"""The NVSHMEM host module imports everywhere and explains itself where it cannot run."""
import torch

from forge_dist.comm import nvshmem


def test_imports_and_reports_a_reason_without_gpus():
    reason = nvshmem.unavailable_reason()
    if not torch.cuda.is_available():
        assert isinstance(reason, str) and "CUDA" in reason
    assert nvshmem.remote_transport() in ("ibrc", "ibgda", "ucx", "libfabric", "none") or \
        isinstance(nvshmem.remote_transport(), str)


def test_forge_strategy_is_registered():
    from forge_dist import sp

    assert sp.FORGE_IMPORT_ERROR is None
    assert "forge" in sp.names()
    reason = sp.resolve.__globals__["_REGISTRY"]["forge"].available(torch.device("cpu"))
    assert isinstance(reason, str) and reason
