"""Matrix state with vector (diagonal) decay: gla (``g [B, T, H, K]``), HGRN2.

Two steps.  :func:`gate_chunks` (``_gate_kernel``, one program per chunk and head) reads
q, k, g once and writes everything that depends on the per-channel gates::

    qg = q * exp(G)            kd = k * exp(G_C - G)       gc = G_C   [B, NT, H, K] fp32
    A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)   (j <= i, [B, T, H, BT])

with ``G`` the in-chunk cumulative log decay and ``G_C`` the chunk's total; both factors of
``qg`` and ``kd`` are decays ``<= 1``.  Then the shared walker (``GATE=2``, FUSED or
DECOUPLED over segments, see :mod:`.scheduler`) runs on ``qg, kd, v, A, gc`` exactly as for
a scalar decay: ``o = qg S + A v``, ``S = diag(exp(G_C)) S + kd^T v``, with no exponentials
per element left in the sequential walk.

``A`` cannot use one reference point per chunk in general: ``q_i exp(G_i)`` and
``k_j exp(-G_j)`` overflow once the chunk's total decay passes ~88 in some channel.  The
kernel measures that span per chunk; below ``SPAN_MAX`` (60, fp16 operands 8) ``A`` is one
tensor-core product of those two factors (the ``i < j`` entries, the only large ones, are
masked after it); above, it cuts the chunk into sub-blocks of ``BC = 16`` rows:

* a block below the diagonal (rows in block I, columns in an earlier block J) takes as
  reference the row just before block I: ``q_i exp(G_i - G_ref)`` and ``k_j exp(G_ref - G_j)``
  are both decays ``<= 1``, so one ``tl.dot`` forms the block and nothing can overflow;
* a diagonal block goes column by column, the decay ``G_i - G_j`` masked to ``i >= j``
  before the exponential.

Realistic gates (GLA's ``logsigmoid(x) / 16``, the benchmark's ``logsigmoid(x + 4)``) never
leave the fast path; gates of -20 per token take the sub-block path and stay finite.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from typing import Any, Dict, Optional

from . import scheduler
from .compat import HAVE_TRITON, cdiv, dot_precision, ensure, sized_config, tl, triton
from .ir import Buffer, Launch, Program, cdiv, pow2, run_launch
from .tiles import mapped_tile, reset_floor
from .walker import outputs_from_summary, summarize, walk
from .walker_launches import NO_SUMMARY, map_consts, matrix_buffers, walk_launches
from .work import DecayAttentionWork

# Measured on H200 at T=64K, B=1, H=32, K=V=128 (results/kernel_profile_sweeps_*_2026-11-24):
# walker BV=64, 4 warps, 2 stages 2.61 ms for the whole forward (3 stages 2.73, BV=32 3.07,
# 8 warps 3.21); gate kernel slices of 32 channels 2.65 vs 2.74 for 64 (8 warps 3.60).
FUSED_CONFIG = {"BT": 64, "BV": 64, "num_warps": 4, "num_stages": 2}
GATE_CONFIG = {"BC": 16, "BKS": 32, "num_warps": 4, "num_stages": 2}


def fused_config(K: int, V: int) -> dict:
    """The fused walker's tiles for this pattern and head dims (two pipeline stages also at
    K = 256: three would need 244 KB of shared memory, over sm_90's 227 KB per block)."""
    return sized_config(FUSED_CONFIG, K)


def span_max(dtype: torch.dtype) -> float:
    """Largest chunk decay span (``-G_C`` in one channel) for the one-product attention:
    ``k exp(-G)`` must stay finite in the operand dtype and ``q k`` sums over masked
    entries in fp32 (``e^60 * K * |q k|`` is far below fp32's 3.4e38)."""
    return 8.0 if dtype == torch.float16 else 60.0


if HAVE_TRITON:

    @triton.jit
    def _attention_subblocks(q, k, g, a, bos, t0, T, i_h, H: tl.constexpr, K: tl.constexpr,
                             BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                             PREC: tl.constexpr, Q_MAP: tl.constexpr = None,
                             K_MAP: tl.constexpr = None, G_MAP: tl.constexpr = None):
        """``A`` of one chunk in ``BC``-row sub-blocks (module docstring), for steep gates;
        stores every ``[BC, BC]`` block of the chunk's ``[BT, BT]`` rows (zeros above the
        diagonal).  Q_MAP, K_MAP, G_MAP: fused prologues, as in ``_gate_kernel``."""
        DT = a.dtype.element_ty
        rows = tl.arange(0, BC)
        cols_k = tl.arange(0, BK)
        base_qk = (bos * H + i_h) * K
        base_a = a + (bos * H + i_h) * BT
        for i_i in range(BT // BC):  # dynamic loops: a rare path, kept small in registers
            r0 = t0 + i_i * BC
            p_q = tl.make_block_ptr(q + base_qk, (T, K), (H * K, 1), (r0, 0), (BC, BK), (1, 0))
            p_g = tl.make_block_ptr(g + base_qk, (T, K), (H * K, 1), (r0, 0), (BC, BK), (1, 0))
            b_q = tl.load(p_q, boundary_check=(0, 1))
            if Q_MAP is not None:
                b_q = mapped_tile(b_q, Q_MAP, r0, T, 0, K, BC, BK)
            b_q = b_q.to(tl.float32)
            b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)  # padding: 0
            if G_MAP is not None:
                b_g = mapped_tile(b_g, G_MAP, r0, T, 0, K, BC, BK)
            b_g = reset_floor(b_g)
            b_G = tl.cumsum(b_g, axis=0)  # from the row before the block
            # diagonal block, column by column: exp(G_r - G_c) masked to r >= c
            b_A = tl.zeros([BC, BC], dtype=tl.float32)
            b_Gc = tl.zeros([BK], dtype=tl.float32)
            for c in range(BC):
                m_c = (cols_k < K) & (r0 + c < T)
                off_c = base_qk + (r0 + c).to(tl.int64) * (H * K) + cols_k
                k_c = tl.load(k + off_c, mask=m_c, other=0.0)
                if K_MAP is not None:
                    k_c = tl.where(m_c, K_MAP(k_c.to(tl.float32)), 0.0).to(k_c.dtype)
                k_c = k_c.to(tl.float32)
                g_c = tl.load(g + off_c, mask=m_c, other=0.0).to(tl.float32)
                if G_MAP is not None:
                    g_c = tl.where(m_c, G_MAP(g_c), 0.0)
                g_c = reset_floor(g_c)
                b_Gc += g_c
                b_e = tl.exp(tl.where(rows[:, None] >= c, b_G - b_Gc[None, :], float("-inf")))
                a_c = tl.sum(b_q * k_c[None, :] * b_e, axis=1)
                b_A = tl.where(rows[None, :] == c, a_c[:, None], b_A)
            p_a = tl.make_block_ptr(base_a, (T, BT), (H * BT, 1), (r0, i_i * BC), (BC, BC), (1, 0))
            tl.store(p_a, b_A.to(DT), boundary_check=(0, 1))
            # blocks left of the diagonal, nearest first: the reference is the row before
            # r0, so q carries exp(G_r - G_ref) and k exp(G_ref - G_c), both <= 1
            b_qe = (b_q * tl.exp(b_G)).to(DT)
            b_between = tl.zeros([BK], dtype=tl.float32)  # g summed over blocks in between
            for j in range(i_i):
                c0 = r0 - (j + 1) * BC
                p_k = tl.make_block_ptr(k + base_qk, (T, K), (H * K, 1), (c0, 0), (BC, BK), (1, 0))
                p_gj = tl.make_block_ptr(g + base_qk, (T, K), (H * K, 1), (c0, 0), (BC, BK), (1, 0))
                b_gj = tl.load(p_gj, boundary_check=(0, 1)).to(tl.float32)
                if G_MAP is not None:
                    b_gj = mapped_tile(b_gj, G_MAP, c0, T, 0, K, BC, BK)
                b_gj = reset_floor(b_gj)
                b_after = tl.cumsum(b_gj, axis=0, reverse=True) - b_gj  # sum_{s > c} in block
                b_kj = tl.load(p_k, boundary_check=(0, 1))
                if K_MAP is not None:
                    b_kj = mapped_tile(b_kj, K_MAP, c0, T, 0, K, BC, BK)
                b_ke = (b_kj.to(tl.float32) * tl.exp(b_after + b_between[None, :])).to(DT)
                b_Aj = tl.dot(b_qe, tl.trans(b_ke), input_precision=PREC)
                p_a = tl.make_block_ptr(base_a, (T, BT), (H * BT, 1), (r0, i_i * BC - (j + 1) * BC),
                                        (BC, BC), (1, 0))
                tl.store(p_a, b_Aj.to(DT), boundary_check=(0, 1))
                b_between += tl.sum(b_gj, axis=0)
            for j in range(i_i + 1, BT // BC):  # above the diagonal
                p_a = tl.make_block_ptr(base_a, (T, BT), (H * BT, 1), (r0, j * BC), (BC, BC), (1, 0))
                tl.store(p_a, tl.zeros([BC, BC], dtype=DT), boundary_check=(0, 1))

    @triton.jit
    def _gate_kernel(q, k, g, qg, kd, a, gc, T, span_limit, H: tl.constexpr, K: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr,
                     PREC: tl.constexpr, STORE_KD: tl.constexpr, STORE_QA: tl.constexpr,
                     Q_MAP: tl.constexpr = None, K_MAP: tl.constexpr = None,
                     G_MAP: tl.constexpr = None):
        """grid ``(NT, B * H)``: one chunk of one head, its K channels in slices of ``BKS``
        (the gates are per channel, so a slice is self-contained; only ``A`` sums over
        slices, and small tiles keep several programs resident per SM).
        q, k, g [B, T, H, K]; STORE_KD: ``kd [B, T, H, K]`` and ``gc [B, NT, H, K]`` fp32 (what
        a summary needs); STORE_QA: ``qg [B, T, H, K]`` and ``a [B, T, H, BT]`` (what the
        outputs need).  qg, kd and a in the operand dtype (the walker's dots take that dtype).
        Q_MAP, K_MAP, G_MAP: fused elementwise prologues applied to the loaded q, k, g tiles
        (``tiles.mapped_tile``; the gates kept in fp32).
        """
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets pass 2**31 at long T
        bos = i_b * T
        t0 = i_t * BT
        NT = tl.cdiv(T, BT)
        DT = kd.dtype.element_ty
        base = (bos * H + i_h) * K
        rows = tl.arange(0, BT)
        last = (rows == BT - 1)[:, None]
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        span = tl.full((), 0.0, tl.float32)  # the chunk's largest decay over one channel
        for i_k in range(BK // BKS):
            k0 = i_k * BKS
            p_g = tl.make_block_ptr(g + base, (T, K), (H * K, 1), (t0, k0), (BT, BKS), (1, 0))
            b_g = tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
            if G_MAP is not None:
                b_g = mapped_tile(b_g, G_MAP, t0, T, k0, K, BT, BKS)
            b_g = reset_floor(b_g)
            b_G = tl.cumsum(b_g, axis=0)
            b_GC = tl.sum(tl.where(last, b_G, 0.0), axis=0)  # padding rows: g = 0
            p_k = tl.make_block_ptr(k + base, (T, K), (H * K, 1), (t0, k0), (BT, BKS), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            if K_MAP is not None:
                b_k = mapped_tile(b_k, K_MAP, t0, T, k0, K, BT, BKS)
            b_k = b_k.to(tl.float32)
            if STORE_KD:
                p_kd = tl.make_block_ptr(kd + base, (T, K), (H * K, 1), (t0, k0), (BT, BKS),
                                         (1, 0))
                tl.store(p_kd, (b_k * tl.exp(b_GC[None, :] - b_G)).to(DT),
                         boundary_check=(0, 1))
                o_k = k0 + tl.arange(0, BKS)
                tl.store(gc + ((i_b * NT + i_t) * H + i_h) * K + o_k, b_GC, mask=o_k < K)
            if STORE_QA:
                p_q = tl.make_block_ptr(q + base, (T, K), (H * K, 1), (t0, k0), (BT, BKS), (1, 0))
                b_q = tl.load(p_q, boundary_check=(0, 1))
                if Q_MAP is not None:
                    b_q = mapped_tile(b_q, Q_MAP, t0, T, k0, K, BT, BKS)
                b_qg = (b_q.to(tl.float32) * tl.exp(b_G)).to(DT)
                p_qg = tl.make_block_ptr(qg + base, (T, K), (H * K, 1), (t0, k0), (BT, BKS),
                                         (1, 0))
                tl.store(p_qg, b_qg, boundary_check=(0, 1))
                span = tl.maximum(span, tl.max(-b_GC, axis=0))
                # k exp(-G) <= exp(span), used only if the span stays under the limit (the
                # clamp, inactive then, keeps the discarded product finite otherwise)
                b_ki = (b_k * tl.exp(tl.minimum(-b_G, span_limit))).to(DT)
                b_A += tl.dot(b_qg, tl.trans(b_ki), input_precision=PREC)
        if STORE_QA:
            if span <= span_limit:
                # one product; the entries above the diagonal (the only ones that can be
                # large) are dropped after it
                b_A = tl.where(rows[:, None] >= rows[None, :], b_A, 0.0)
                p_a = tl.make_block_ptr(a + (bos * H + i_h) * BT, (T, BT), (H * BT, 1), (t0, 0),
                                        (BT, BT), (1, 0))
                tl.store(p_a, b_A.to(DT), boundary_check=(0, 1))
            else:
                _attention_subblocks(q, k, g, a, bos, t0, T, i_h, H, K, BT, BK, BC, PREC,
                                     Q_MAP, K_MAP, G_MAP)


@dataclass
class GatedChunks:
    """The gate-dependent tensors of one segment (see the module docstring): ``kd``, ``gc``
    (always) and ``qg``, ``a`` (``None`` until outputs were asked for)."""

    kd: torch.Tensor
    gc: torch.Tensor
    qg: torch.Tensor = None
    a: torch.Tensor = None


def gate_chunks(q, k, g, BT: int, *, outputs: bool = True, summary: bool = True,
                into: GatedChunks = None, maps: dict = None) -> GatedChunks:
    """Run ``_gate_kernel`` over ``q, k [B, T, H, K]``, ``g [B, T, H, K]`` (log decays) in
    chunks of ``BT``: ``summary`` fills ``kd``, ``gc``; ``outputs`` fills ``qg``, ``a``
    (into ``into`` when given, which must hold ``kd`` and ``gc`` already).  ``maps``: fused
    prologues of q, k, g (input name -> jitted map)."""
    B, T, H, K = k.shape
    dev, dt = k.device, k.dtype
    NT = cdiv(T, BT)
    res = into
    if summary:
        res = GatedChunks(torch.empty(B, T, H, K, dtype=dt, device=dev),
                          torch.empty(B, NT, H, K, dtype=torch.float32, device=dev))
    if outputs:
        res.qg = torch.empty(B, T, H, K, dtype=dt, device=dev)
        res.a = torch.empty(B, T, H, BT, dtype=dt, device=dev)
    ln = gate_launch(qg="qg" if outputs else None, a="a" if outputs else None,
                     store_kd=summary, B=B, T=T, H=H, K=K, BT=BT, dtype=dt,
                     prec=dot_precision(dt), maps=maps)
    tensors = {"q": q, "k": k, "g": g, "kd": res.kd, "gc": res.gc}
    if outputs:
        tensors.update(qg=res.qg, a=res.a)
    run_launch(ln, tensors, _gate_kernel)
    return res


def gate_launch(*, qg: Optional[str], a: Optional[str], store_kd: bool, B: int, T: int,
                H: int, K: int, BT: int, dtype: torch.dtype, prec: str,
                maps: Optional[Dict[str, Any]] = None) -> Launch:
    """The launch of ``_gate_kernel`` on buffers ``q, k, g`` (``[B, T, H, K]``, inputs of
    ``dtype``): ``kd`` and ``gc`` (written where ``store_kd``), and the outputs' ``qg`` and
    ``a`` where named (``None``: the summary's launch).  ``maps``: fused prologues of q, k,
    g."""
    BC = min(GATE_CONFIG["BC"], BT)
    if BT % BC:
        raise ValueError(f"gate_chunks: the chunk ({BT}) must be a multiple of {BC}")
    store_qa = qg is not None
    return Launch(
        "gla_gate", (cdiv(T, BT), B * H, 1),
        (("q", "buf", "q"), ("k", "buf", "k"), ("g", "buf", "g"), ("qg", "buf", qg or "kd"),
         ("kd", "buf", "kd"), ("a", "buf", a or "kd"), ("gc", "buf", "gc"), ("T", "i32", T),
         ("span_limit", "fp32", span_max(dtype))),
        (("H", H), ("K", K), ("BT", BT), ("BK", pow2(K)),
         ("BKS", min(GATE_CONFIG["BKS"], pow2(K))), ("BC", BC), ("PREC", prec),
         ("STORE_KD", store_kd), ("STORE_QA", store_qa)) + map_consts(maps, "qkg"),
        GATE_CONFIG["num_warps"], GATE_CONFIG["num_stages"])


def forward_program(*, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
                    gated: bool = True, has_h0: bool, store_o: bool = True, scale: float,
                    prec: str, execution: Optional[str] = None, tiles: Optional[dict] = None,
                    gate_dtype: torch.dtype = torch.float32,
                    maps: Optional[Dict[str, Any]] = None,
                    summary: str = NO_SUMMARY) -> Program:
    """The launches of one segment forward (or, ``store_o=False``, its summary) as a
    :class:`~.ir.Program`: :func:`.walker_launches.matrix_buffers` and the gates ``g [B, T,
    H, K]`` (``gate_dtype``); the gated chunk tensors (:func:`gate_launch`: workspaces
    ``kd``, ``gc`` and, with outputs, ``qg``, ``a``), then the walker's schedule.  ``tiles``
    overrides entries of :func:`fused_config`; ``maps``: fused prologues of q, k, v, g (the
    gate kernel maps q, k, g; the walker v).  ``summary``: what a sequence-parallel rank also
    keeps for its state pass (:func:`.walker_launches.walk_launches`)."""
    if not gated:
        raise ValueError("gla needs its gate g [B, T, H, K]")
    cfg = dict(fused_config(K, V), **(tiles or {}))
    BT = cfg["BT"]
    sched = scheduler.schedule(B, T, H, K, V, BT, min(cfg["BV"], pow2(V)),
                               elem_size=torch.empty((), dtype=dtype).element_size(),
                               gate_elems=K, request=execution,
                               with_summary=summary != NO_SUMMARY)
    bufs = matrix_buffers(B=B, T=T, H=H, K=K, V=V, dtype=dtype, store_o=store_o,
                          has_h0=has_h0)
    bufs["g"] = Buffer((B, T, H, K), gate_dtype, "input")
    bufs["kd"] = Buffer((B, T, H, K), dtype, "workspace")
    bufs["gc"] = Buffer((B, cdiv(T, BT), H, K), torch.float32, "workspace")
    if store_o:
        bufs["qg"] = Buffer((B, T, H, K), dtype, "workspace")
        bufs["a"] = Buffer((B, T, H, BT), dtype, "workspace")
    launches = [gate_launch(qg="qg" if store_o else None, a="a" if store_o else None,
                            store_kd=True, B=B, T=T, H=H, K=K, BT=BT, dtype=dtype, prec=prec,
                            maps=maps)]
    walk_maps = {"v": maps["v"]} if maps and maps.get("v") else None
    launches += walk_launches(bufs, q="qg" if store_o else None, k="kd", v="v", g="gc",
                              w=None, h0="h0" if has_h0 else None,
                              o="o" if store_o else None, ht="ht", B=B, T=T, H=H, K=K, V=V,
                              gate=2, scale=scale, cfg=cfg, prec=prec,
                              a="a" if store_o else None, n_seg=sched.n_seg, maps=walk_maps,
                              summary=summary)
    notes = [f"execution {sched.strategy} ({sched.n_seg} segments): {sched.reason}"]
    return Program(launches, bufs, sched.strategy, notes)


class VectorDecayWork(DecayAttentionWork):
    """gla segment: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``.

    The gated tensors (:func:`gate_chunks`) depend only on the segment's inputs: the summary
    computes ``kd, gc`` and the finish adds ``qg, a``, sharing what the other computed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gated = None

    def release(self) -> None:
        super().release()
        self._gated = None

    @property
    def _value_map(self) -> dict:
        """The walker maps only v: it reads q, k, g as the gate kernel wrote them (mapped)."""
        return {"v": self.maps["v"]} if "v" in self.maps else {}

    def _gates(self, q, k, g, BT: int, outputs: bool) -> GatedChunks:
        if self._gated is None:
            self._gated = gate_chunks(q, k, g, BT, outputs=outputs, maps=self.maps)
        elif outputs and self._gated.qg is None:
            gate_chunks(q, k, g, BT, summary=False, into=self._gated, maps=self.maps)
        return self._gated

    def _finish_fwd(self, S_in, tensors):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        gated = self._gates(q, k, g, cfg["BT"], outputs=True)
        common = dict(q=gated.qg, g=gated.gc, gate=2, scale=self.scale,
                      out_dtype=self.out_dtype, cfg=cfg, prec=dot_precision(self.in_dtype),
                      a=gated.a, maps=self._value_map)
        if self.segments is not None:  # the summary ran: only the output walks remain
            return outputs_from_summary(self.segments, gated.kd, v, S_in=S_in, **common)
        n_seg = self._schedule(k, v, cfg, gate_elems=k.shape[-1])
        return walk(gated.kd, v, h0=S_in, n_seg=n_seg, **common)

    def _summary_segments(self) -> int:
        k, v = self.tensors[1], self.tensors[2]
        return self._schedule(k, v, fused_config(k.shape[-1], v.shape[-1]),
                              gate_elems=k.shape[-1], with_summary=True)

    def _summary_fwd(self, tensors, need_M):
        q, k, v, g = (ensure(t) for t in tensors)
        cfg = fused_config(k.shape[-1], v.shape[-1])
        n_seg = self._summary_segments()
        gated = self._gates(q, k, g, cfg["BT"], outputs=False)
        self.segments = summarize(gated.kd, v, g=gated.gc, gate=2, cfg=cfg,
                                  prec=dot_precision(self.in_dtype), n_seg=n_seg,
                                  maps=self._value_map)
        M = self.segments.total_log_decay().exp() if need_M else None  # [B, H, K]
        return self.segments.delta, M

    @staticmethod
    def chunk_backward(*args):
        """The Triton chunk backward (:func:`.vector_backward.vector_decay_backward`)."""
        from .vector_backward import vector_decay_backward  # lazy: it imports this module

        return vector_decay_backward(*args)
