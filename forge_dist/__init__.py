"""forge_dist: linear attention on sequences too long for one GPU, fast on one GPU too.

``forge_dist.ops`` holds the public functions (FLA conventions); ``forge_dist.variants`` the
math and fp64 references; ``forge_dist.sp`` the inter-rank strategies.
"""
__version__ = "0.1.0"

from .comm_env import set_launch_defaults  # noqa: E402

set_launch_defaults()  # NVLink multicast off before anything can start NCCL or NVSHMEM

from . import ops  # noqa: E402,F401

__all__ = ["ops", "__version__"]
