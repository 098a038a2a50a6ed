"""Sequence-parallel strategies for the inter-rank phase (docs/design.md section 3).

Importing this package registers ``serial``, ``pipelined``, ``lasp2``, ``scan`` (log-depth,
:mod:`forge_dist.sp.scan`), ``hier`` (the scan laid out by node, :mod:`forge_dist.sp.hier`) and ``forge`` (GPU-initiated NVSHMEM puts,
:mod:`forge_dist.sp.forge`) where Triton is installed.
"""
from . import hier, lasp2, pipelined, scan, serial  # noqa: F401  (registration)
from .agreement import forget, poll_flags
from .base import Strategy, names, register, resolve, state_pass
from .p2p import StatePassTimeout

FORGE_IMPORT_ERROR = None
try:  # forge needs Triton; without it (or with a broken one) the other strategies still work
    from . import forge  # noqa: F401
except Exception as err:  # noqa: BLE001 - report the reason in `forge-dist info`
    forge = None
    FORGE_IMPORT_ERROR = f"{type(err).__name__}: {err}"



def flush(wait: bool = True) -> None:
    """Raise the error a finished sequence-parallel call left on this rank, if any.

    Steady-state calls never synchronise the host: a forge timeout or a peer that called with
    other arguments (found on the device, where that call's output became NaN) is raised by
    the next call on the same group, or here.  ``wait=False`` only reads errors already
    visible without waiting for the device."""
    if forge is not None:
        forge.flush(wait=wait)
    poll_flags(wait=wait)


def reset(group=None) -> None:
    """Forget this rank's per-group state (of ``group``, or all): forge channels, agreed
    signatures and pending device errors.  Call it on every rank after an error that every
    rank raised from the same call (an argument mismatch): the group is still in step, and
    the next call's first agreement and channel allocation are collectives, like any first
    call.  After any other error (a timeout, a dead peer, an exception on one rank only) the
    group may hold half-done collectives: make a new process group on every rank instead
    (README, "Sequence parallelism")."""
    if forge is not None:
        forge.reset(group)
    forget(group)


__all__ = ["Strategy", "StatePassTimeout", "flush", "names", "register", "reset", "resolve",
           "state_pass"]
