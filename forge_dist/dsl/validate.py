"""Translation validation: the static analysis is double-checked numerically at compile time.

On small random fp64 probes (tiny shapes, the CPU), the traced graphs must satisfy what the
analysis concluded: ``decay_mode`` and ``merge_mode`` are affine in ``state`` (their linear
parts are linear and differ from them by a state-free offset), the extracted transition
of the classified kind reproduces the linear part of ``decay_mode``, and ``merge_mode``'s
offset graph (``merge_offset``) is its value at a zero state (else it is dropped).  A failure means the
program does something the analysis did not understand; it is reported, never ignored.
"""
from __future__ import annotations

import torch

from ..variants import transitions as tr
from . import executor
from .trace import DSLError

PROBE_MATRIX = {"B": 1, "H": 2, "NT": 3, "C": 4, "K": 5, "V": 6}
PROBE_VECTOR = {"B": 2, "NT": 3, "C": 4, "D": 5}
TOL = 1e-9


def _close(a, b) -> bool:
    scale = max(1.0, float(b.abs().max()))
    return float((a - b).abs().max()) <= TOL * scale


def check_numerically(v) -> None:
    """Raise :class:`DSLError` when the graphs disagree with the analysis; sets
    ``v.numeric_check`` to a short status."""
    gen = torch.Generator().manual_seed(1234)
    dims = PROBE_VECTOR if v.vector else PROBE_MATRIX

    def rnd(names):
        return 0.5 * torch.randn([dims[n] for n in names], generator=gen, dtype=torch.float64)

    args = {n: rnd(v.chunk_dims(n)) for n in v.input_names}
    args["scale"] = 0.5
    with torch.no_grad():
        out = executor.call(v.chunk.gm, v.chunk.params, args)
        out = out if isinstance(out, tuple) else (out,)
        args.update(zip(v.chunk.cached, out[1:]))
        args["chunk_state"] = out[0]
        S1, S2 = rnd(v.state_dims), rnd(v.state_dims)
        zero = torch.zeros_like(S1)
        checks = []
        for name, full, lin, params in (
                ("decay_mode", v.decay.gm, v.decay_linear, v.decay.params),
                ("merge_mode", v.merge.gm, v.merge_linear, v.merge.params)):
            f = lambda S, gm=full: executor.call(gm, params, {**args, "state": S})  # noqa: E731
            g = lambda S, gm=lin: executor.call(gm, params, {**args, "state": S})  # noqa: E731
            f0, f1, g1, g2, g12 = f(zero), f(S1), g(S1), g(S2), g(S1 + S2)
            if not all(torch.isfinite(t).all() for t in (f0, f1, g1, g2, g12)):
                v.numeric_check = "skipped (random probes gave non-finite values)"
                v.merge_offset = None  # (unchecked: not used)
                return
            if not _close(g12, g1 + g2):
                raise DSLError(f"{name}: numerical check failed: the state-dependent part is not "
                               f"linear in the state (an operation the analysis accepted "
                               f"behaves nonlinearly)")
            if not _close(f1, g1 + f0):
                raise DSLError(f"{name}: numerical check failed: the result is not its linear "
                               f"part plus a state-free offset")
            checks.append(name)
            if name == "merge_mode" and v.merge_offset is not None:
                try:
                    off = executor.call(v.merge_offset, params, {**args, "state": None})
                except Exception:  # noqa: BLE001 - an offset graph that cannot run: not used
                    off = None
                if off is None or off.shape != f0.shape or not _close(off, f0):
                    v.merge_offset = None  # the analysis got it wrong: not used
        M = executor.transitions(v, args, out[0])
        want = executor.to_internal(v, executor.call(v.decay_linear, v.decay.params,
                                                      {**args, "state": S1}))
        got = tr.apply(v.kind, M, executor.to_internal(v, S1))
        if not _close(got, want):
            raise DSLError(f"decay_mode: numerical check failed: the {v.kind.value} transition "
                           f"extracted from the graph does not reproduce decay_mode")
    v.numeric_check = "passed (affinity of decay_mode and merge_mode, transition kind)"
