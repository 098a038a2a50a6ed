"""Environment defaults every launch of ours sets before NCCL or NVSHMEM initialise.

NVLink multicast (NVLS) stays off: on shared hosts a program using it can take the GPUs out
of service.  Values a user set explicitly are kept.
"""
import os

LAUNCH_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def set_launch_defaults() -> None:
    """Set :data:`LAUNCH_DEFAULTS` where the environment does not already say otherwise."""
    for key, value in LAUNCH_DEFAULTS.items():
        os.environ.setdefault(key, value)
