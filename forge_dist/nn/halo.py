"""Halo exchange for short causal convolutions under sequence parallelism.

A causal convolution of width ``W + 1`` needs, at the first token of rank r's shard, the last
``W`` inputs of rank r-1's shard.  :func:`halo_exchange` sends each rank's last ``W`` tokens to
the next rank and returns the ``W`` tokens received from the previous one (zeros on rank 0).
It is differentiable: in backward the gradient of the received halo goes back to rank r-1,
where it adds onto the gradient of the tokens that were sent.

Every rank of the group makes the same calls in the same order whatever its data, so the
communication pattern never depends on ``cu_seqlens``; masking of taps that would cross a
packed-sequence boundary is the convolution's job (:mod:`forge_dist.nn.conv`).

For a layer whose strategy passes its states GPU-initiated (``forge``, ``scan``, ``hier``,
or ``auto`` where it resolves to one of them; :data:`GPU_INITIATED`), where that transport
runs (NVSHMEM on CUDA, or the
simulated transport of gloo ranks under Triton's interpreter), the halo travels as
``forge`` passes a state: one
kernel on every rank puts its tail to the neighbour and waits on the GPU for the other
neighbour's (:func:`forge_dist.sp.forge.pass_along`), so the host neither waits nor runs a
collective; its arguments are agreed on the host once per new shape, then checked on the
device by the signature word the tiles carry; each new shape allocates its channel in
symmetric memory once, as the op's state passes do.  Elsewhere (the host-driven strategies,
a group without that transport, or ``FORGE_DIST_HALO=p2p``) it is one send and one receive
of the process group; ``FORGE_DIST_HALO=device`` asks for the GPU-initiated path whatever
the strategy and raises where it cannot run.  Measured
on 2 x H200: the process group's exchange cost a layer call about 350 us of host time
(docs/performance.md, "Layers").
"""
from __future__ import annotations

import weakref
from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import env_reader
from ..sp import agreement, forge, p2p, resolve

GPU_INITIATED = ("forge", "scan", "hier", "auto")  # strategies whose layers' halos may
#                                                  travel GPU-initiated (see the module)
_HALO_MODE = env_reader("FORGE_DIST_HALO")
_MODES = ("auto", "device", "p2p")
# Per group, held weakly: device -> (GPU-initiated?, why not); device -> the strategy auto
# resolves to; (direction, word, shape, dtype, device) -> the kept launch's dict
_TRANSPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_AUTO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _of(table: "weakref.WeakKeyDictionary", group) -> dict:
    """``group``'s dict in ``table``."""
    known = table.get(group)
    if known is None:
        known = table[group] = {}
    return known


def _mode() -> str:
    mode = _HALO_MODE() or "auto"
    if mode not in _MODES:
        raise ValueError(f"FORGE_DIST_HALO must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


def _transport_reason(group, device: torch.device):
    """Why the GPU-initiated transport cannot carry this group's halos on ``device``
    (``None``: it can)."""
    if forge is None:  # (Triton missing or broken: forge_dist.sp says why)
        return "forge's kernels could not be imported"
    if dist.get_backend(group) == "gloo":
        if device.type == "cpu" and forge.interpreted():
            return None
        return "a gloo group runs it only on CPU tensors under Triton's interpreter"
    if device.type != "cuda":
        return f"tensors on {device}"
    return forge.FORGE.available(device)


def _resolved(group, device: torch.device) -> str:
    """The strategy ``auto`` resolves to for this group's state passes on ``device``."""
    known = _of(_AUTO, group)
    name = known.get(device)
    if name is None:
        name = known[device] = resolve("auto", device, group).name
    return name


def _on_device(group, device: torch.device, strategy: str = "auto") -> bool:
    """Whether this group's halos on ``device`` travel GPU-initiated (see the module).  The
    first halo of a group on a device agrees on it across the ranks (one all-gather): the
    GPU-initiated path only where every rank has it, so no rank puts while another posts
    a process-group receive."""
    mode = _mode()
    if mode == "p2p" or (mode == "auto" and strategy not in GPU_INITIATED):
        return False
    if mode == "auto" and strategy == "auto" and _resolved(group, device) not in GPU_INITIATED:
        return False  # auto's state pass is host-driven here (a subgroup, the CPU): so is this
    known = _of(_TRANSPORT, group)
    found = known.get(device)
    if found is None:
        reason = _transport_reason(group, device)
        flag = torch.tensor([int(reason is None)], dtype=torch.int64,
                            device=agreement.signature_device(group, device))
        everyone = [int(f) for f in p2p.all_gather(flag, group, "whether every rank has the "
                                                   "GPU-initiated halo transport")]
        if reason is None and not all(everyone):
            missing = [r for r, f in enumerate(everyone) if not f]
            reason = f"rank(s) {missing} of the group do not have it"
        found = known[device] = (reason is None, reason)
    ok, reason = found
    if not ok and mode == "device":
        raise RuntimeError(f"FORGE_DIST_HALO=device: the GPU-initiated transport is not "
                           f"available for this group's halos ({reason})")
    return ok


def _device_exchange(send: Tensor, *, to_next: bool, group, what: str) -> Tensor:
    """:func:`_exchange` through :func:`forge_dist.sp.forge.pass_along`: ``send [B, W, D]``
    travels as a ``[B, 1, W, D]`` state in float32 (float64 stays float64)."""
    B, W, D = send.shape
    wide = torch.float64 if send.dtype == torch.float64 else torch.float32
    fields = {"B": B, "halo tokens": W, "channels (all convolutions)": D,
              "dtype": send.dtype, "op": what}
    _, word = agreement.agree(group, send.device, fields)
    # per word: a kept launch sends the word of its first call
    keep = _of(_KEPT, group).setdefault((to_next, word, B, W, D, wide, send.device), {})
    got = forge.pass_along(group, send.to(wide).view(B, 1, W, D), to_next=to_next, word=word,
                           what=what, keep=keep)
    return got.view(B, W, D).to(send.dtype)


def _exchange(send: Tensor, shape, dtype, device, *, to_next: bool, group, what: str,
              on_device: bool):
    """Send ``send`` one rank along the chain and receive one tensor from the other side.

    ``to_next=True``: send to rank+1, receive from rank-1 (forward direction).
    ``to_next=False``: send to rank-1, receive from rank+1 (backward direction).
    The end of the chain that has no peer sends nothing / receives zeros.
    """
    if on_device:  # (decided by halo_exchange, the same for both directions)
        return _device_exchange(send, to_next=to_next, group=group, what=what)
    rank, size = p2p.rank_and_size(group)
    dst = rank + 1 if to_next else rank - 1
    src = rank - 1 if to_next else rank + 1
    recv_buf = torch.zeros(shape, dtype=dtype, device=device)
    works = []
    if 0 <= src < size:  # post the receive before the send: no ordering deadlock on gloo
        works.append((p2p.irecv(recv_buf, src, group), src))
    if 0 <= dst < size:
        works.append((p2p.isend(send, dst, group), dst))
    for work, peer in works:
        p2p.wait(work, group, peer, what)
    return recv_buf


class _HaloExchange(torch.autograd.Function):
    """``x [B, T, D]`` -> the previous rank's last ``width`` tokens ``[B, width, D]``."""

    @staticmethod
    def forward(ctx, x: Tensor, width: int, group, on_device: bool):
        ctx.width, ctx.group, ctx.on_device = width, group, on_device
        ctx.x_meta = (x.shape, x.dtype, x.device)
        B, _, D = x.shape
        tail = x[:, x.shape[1] - width:].contiguous()
        return _exchange(tail, (B, width, D), x.dtype, x.device, to_next=True, group=group,
                         what="a convolution halo", on_device=on_device)

    @staticmethod
    def backward(ctx, grad_halo: Tensor):
        shape, dtype, device = ctx.x_meta
        B, T, D = shape
        w = ctx.width
        grad_tail = _exchange(grad_halo.contiguous().to(dtype), (B, w, D), dtype, device,
                              to_next=False, group=ctx.group,
                              what="the gradient of a convolution halo",
                              on_device=ctx.on_device)
        grad_x = torch.zeros(shape, dtype=dtype, device=device)
        grad_x[:, T - w:] = grad_tail
        return grad_x, None, None, None


def halo_exchange(x: Tensor, width: int, group, strategy: str = "auto") -> Tensor:
    """The ``width`` tokens that precede this rank's shard in the global sequence.

    Args:
        x: ``[B, T_local, D]``, this rank's shard (``T_local >= width``).
        width: number of tokens to exchange (``kernel_size - 1``).
        group: a process group, or ``None`` (single rank: returns zeros).
        strategy: the calling layer's state-pass strategy, which decides the transport
            (see the module).
    Returns:
        ``[B, width, D]``: rank r-1's last ``width`` tokens; zeros on rank 0.
    """
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    _, size = p2p.rank_and_size(group)
    if width == 0 or size == 1:
        return x.new_zeros(B, width, D)
    if T < width:
        raise ValueError(f"x: the local shard has {T} tokens, fewer than the convolution "
                         f"halo of {width}; use at least {width} tokens per rank")
    return _HaloExchange.apply(x, width, group, _on_device(group, x.device, strategy))


def halo_exchanges(xs: Sequence[Tensor], width: int, group,
                   strategy: str = "auto") -> List[Tensor]:
    """:func:`halo_exchange` of several shards of one layer (``[B, T_local, D_i]``, one dtype)
    in one exchange: their last ``width`` tokens travel side by side, so a layer with three
    convolutions posts one send and one receive instead of three of each."""
    for x in xs:
        if x.dim() != 3 or x.shape[1] < width:
            return [halo_exchange(x, width, group, strategy) for x in xs]  # its own error
    if len({x.dtype for x in xs}) != 1:
        return [halo_exchange(x, width, group, strategy) for x in xs]
    tails = torch.cat([x[:, x.shape[1] - width:] for x in xs], dim=-1)
    return list(halo_exchange(tails, width, group, strategy).split([x.shape[-1] for x in xs],
                                                                   dim=-1))
