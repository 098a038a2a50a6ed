"""The NVSHMEM host module imports everywhere and explains itself where it cannot run."""
import torch

from forge_dist.comm import nvshmem


def test_imports_and_reports_a_reason_without_gpus(monkeypatch):
    if not torch.cuda.is_available():
        reason = nvshmem.unavailable_reason()
        assert isinstance(reason, str) and "CUDA" in reason
    monkeypatch.delenv("NVSHMEM_REMOTE_TRANSPORT", raising=False)
    assert nvshmem.remote_transport() == "ibrc"  # proxy: NVSHMEM 3.4.5 has no IBGDA
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "none")
    assert nvshmem.remote_transport() == "none"


def test_forge_strategy_is_registered():
    from forge_dist import sp

    assert sp.FORGE_IMPORT_ERROR is None
    assert "forge" in sp.names()
    from forge_dist.sp import forge

    reason = sp.resolve.__globals__["_REGISTRY"]["forge"].available(torch.device("cpu"))
    if forge.interpreted():  # CPU tensors run the simulated transport across processes
        assert reason is None
    else:
        assert isinstance(reason, str) and "TRITON_INTERPRET" in reason
