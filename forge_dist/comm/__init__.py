"""GPU-initiated communication for the inter-rank phase (docs/design.md section 4).

Layout:

* :mod:`forge_dist.comm.device` -- Triton device functions: put-with-signal of one tile,
  bounded signal wait, remote signal set, fence, quiet_put, my_pe/n_pes, error recording.  Every
  function takes a ``TRANSPORT`` constexpr: :data:`SIM` (all ranks' buffers in one process,
  a leading rank axis) or :data:`NVSHMEM` (PyTorch's NVSHMEM device bitcode).  The same
  kernel source runs on both.
* :mod:`forge_dist.comm.nvshmem` -- the host side of NVSHMEM: availability, symmetric
  allocation through ``torch.distributed._symmetric_memory`` (which owns NVSHMEM under
  torchrun), and wrapping kernels with ``requires_nvshmem``.  It is the only module of the
  project that imports PyTorch's private ``_nvshmem_triton``.
* :mod:`forge_dist.comm.sim` -- the simulated transport (``SimWorld``/``SimRank``).
* :mod:`forge_dist.comm.channel` -- a one-directional, tile-major rank-to-rank channel
  (receive/send buffers, epoch signals, credits, error flag) over either transport.

Environment (defaults set here, before anything can initialise NCCL or NVSHMEM):

* ``NVSHMEM_DISABLE_NVLS=1``, ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``:
  NVLink multicast stays off (it is not needed for point-to-point puts and breaks on some
  hosts).  A value the user already exported is kept.
* ``FORGE_DIST_TIMEOUT``: bound in seconds on every device-side wait (default 60).
* ``NVSHMEM_REMOTE_TRANSPORT``: NVSHMEM's own selector for the inter-node transport.

Multi-node: torch 2.11 pins NVSHMEM 3.4.5, whose device bitcode has no IBGDA (GPU-initiated
InfiniBand arrived in 3.5.19), so a put to a PE on another node goes through NVSHMEM's proxy
thread over IB RC (``NVSHMEM_REMOTE_TRANSPORT=ibrc``, NVSHMEM's default), not directly from
the GPU; intra-node puts are NVLink loads/stores issued by the SMs.  With a newer NVSHMEM
installed (``NVSHMEM_LIB_DIR`` pointing at its ``libnvshmem_device.bc``) set
``NVSHMEM_IB_ENABLE_IBGDA=1`` / ``NVSHMEM_REMOTE_TRANSPORT`` as NVSHMEM documents; nothing
in our kernels changes.  ``NVSHMEM_REMOTE_TRANSPORT=none`` keeps a job on one node.
"""
from __future__ import annotations

from ..comm_env import set_launch_defaults

set_launch_defaults()

SIM = 0
NVSHMEM = 1

__all__ = ["SIM", "NVSHMEM"]
