"""forge_dist: linear attention on sequences too long for one GPU, fast on one GPU too.

``forge_dist.ops`` holds the public functions (FLA conventions); ``forge_dist.variants`` the
math and fp64 references; ``forge_dist.sp`` the inter-rank strategies.
"""
__version__ = "0.1.0"

from . import ops  # noqa: E402,F401

__all__ = ["ops", "__version__"]
