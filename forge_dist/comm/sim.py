"""The simulated transport: every rank's symmetric buffers in one process.

``SimWorld(P)`` holds each channel's buffers with a leading rank axis; ``SimWorld(P)[r]`` (a
:class:`SimRank`) is passed where a process group would be, and the strategy launches rank
``r``'s kernel with the ``SIM`` transport.  The caller runs ranks in chain order (forward:
0..P-1, backward: P-1..0), under ``TRITON_INTERPRET=1`` on the CPU or compiled on one GPU.
The kernels, tile schedule, epochs, credits and error records are the ones used over NVSHMEM.
"""
from .channel import SimRank, SimWorld

__all__ = ["SimRank", "SimWorld"]
