"""Host side of the NVSHMEM transport: availability, symmetric buffers, kernel wrapping.

Under torchrun, ``torch.distributed._symmetric_memory`` with the NVSHMEM backend owns
NVSHMEM: the first symmetric allocation initialises it (a hidden collective over the world),
and every later allocation is a collective too (``nvshmem_malloc``).  Rules that follow:

* call ``torch.cuda.set_device(local_rank)`` before anything here;
* every rank allocates the same buffers in the same order (our channels are created on the
  first call of a state pass with a given shape, which every rank makes in the same order,
  like any NCCL collective); :func:`setup` may be called right after
  ``init_process_group`` to do the initialisation eagerly;
* PEs are global ranks (NVSHMEM's world team), so kernels get global peer ranks.

PyTorch's ``_nvshmem_triton`` is private and has changed in every release since 2.8; only
this package imports it.  Checked against torch 2.11 (NVSHMEM 3.4.5):
``requires_nvshmem(jit_fn)`` and the device functions ``putmem_signal_block(dst, src,
size_bytes, signal, sig_val, sig_op, pe)``, ``signal_op(addr_int64, value, op, pe)``,
``fence()``, ``quiet()``, ``my_pe()``, ``n_pes()``.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import set_launch_defaults  # noqa: F401  (importing the package sets them)

_BACKEND_SET = False


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """``None`` when NVSHMEM-backed Triton kernels can run in this process, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401  (optional: the gpu extra)
    except ImportError:
        return "Triton is not installed"
    try:  # optional: torch's private NVSHMEM modules (the bridge pulls in inductor, ~1 s)
        from torch.distributed import _symmetric_memory as symm_mem  # optional: see above
        from torch.distributed._symmetric_memory import _nvshmem_triton as nv
    except Exception as err:  # noqa: BLE001
        return f"this torch has no NVSHMEM Triton bridge ({err})"
    if not hasattr(nv, "requires_nvshmem") or not hasattr(nv, "putmem_signal_block"):
        return "torch's _nvshmem_triton lacks requires_nvshmem/putmem_signal_block"
    try:
        if not symm_mem.is_nvshmem_available():
            return "NVSHMEM is not available in this torch build or on this system"
    except Exception as err:  # noqa: BLE001
        return f"NVSHMEM availability check failed ({err})"
    try:
        nv.NvshmemLibFinder.find_device_library()
    except Exception as err:  # noqa: BLE001
        return f"NVSHMEM device bitcode not found ({err}); set NVSHMEM_LIB_DIR"
    return None


def _ensure_backend() -> None:
    global _BACKEND_SET
    if _BACKEND_SET:
        return
    # lazy: private torch module, kept out of `import forge_dist.ops` (test_import_cost)
    from torch.distributed import _symmetric_memory as symm_mem

    # get_backend reports the default ("CUDA") before any allocation, so just ask for
    # NVSHMEM; torch refuses only once a symmetric tensor of another backend exists.
    try:
        symm_mem.set_backend("NVSHMEM")
    except Exception as err:  # noqa: BLE001
        current = None
        try:
            current = symm_mem.get_backend(torch.device("cuda", torch.cuda.current_device()))
        except Exception:  # noqa: BLE001
            pass
        if current != "NVSHMEM":
            raise RuntimeError(f"forge needs the NVSHMEM symmetric-memory backend but this "
                               f"process already uses {current} ({err}); call "
                               "forge_dist.comm.nvshmem.setup before any other symmetric "
                               "allocation") from err
    _BACKEND_SET = True


def symmetric_empty(shape, dtype: torch.dtype, device: torch.device, group) -> torch.Tensor:
    """A symmetric tensor (collective: every rank calls it with the same arguments)."""
    # lazy: private torch module, kept out of `import forge_dist.ops` (test_import_cost)
    from torch.distributed import _symmetric_memory as symm_mem

    _ensure_backend()
    t = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
    symm_mem.rendezvous(t, group=group if group is not None else dist.group.WORLD)
    return t


def setup(group=None) -> None:
    """Initialise NVSHMEM now (one tiny symmetric allocation), then barrier.

    Call right after ``init_process_group`` (and ``torch.cuda.set_device``) on every rank;
    without it the first forge state pass does the same implicitly.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"forge_dist.comm.nvshmem.setup: {reason}")
    device = torch.device("cuda", torch.cuda.current_device())
    _keep.append(symmetric_empty((8,), torch.int64, device, group))
    torch.cuda.synchronize()
    dist.barrier(group=group)


_keep: list = []


def wrap(jit_fn):
    """``requires_nvshmem(jit_fn)``: the kernel links NVSHMEM's bitcode and its CUDA module
    is initialised for NVSHMEM after compilation."""
    # lazy: the bridge pulls in torch's inductor, dynamo and Triton (~1 s on a CPU machine)
    from torch.distributed._symmetric_memory import _nvshmem_triton as nv

    return nv.requires_nvshmem(jit_fn)


def global_rank(group, group_rank: int) -> int:
    """The NVSHMEM PE (global rank) of ``group_rank`` in ``group``."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def remote_transport() -> str:
    """The inter-node transport NVSHMEM will use (``NVSHMEM_REMOTE_TRANSPORT``, default
    ``ibrc``: proxy-driven, since NVSHMEM 3.4.5's device bitcode has no IBGDA)."""
    return os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "ibrc")
