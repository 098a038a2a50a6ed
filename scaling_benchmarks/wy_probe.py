"""The gated-delta-rule WY factors on one GPU: each design of :func:`forge_dist.kernels.delta.wy`
(the entries of ``delta.WY_CONFIG``) timed and checked, beside FLA's pieces.

Inputs as ``single_device.make_inputs("gated_delta_rule", T)``: B=1, H=32, K=V=128, bf16
q, k, v, beta (k L2-normalised, beta uniform), fp32 gates ``logsigmoid(randn + 4)``.  Rows:

* ``wy/<design>``: ``wy(...)`` with ``WY_CONFIG`` overridden (median of
  ``triton.testing.do_bench`` after a warm-up call; for two-launch designs also each launch
  alone, ``solve_ms`` and ``apply_ms``, so the best of each can be combined), the relative
  RMSE of W and U against an fp64 PyTorch computation on three slices of 4 chunks (start,
  middle, end of the sequence); ``wy/kernels``: registers and spills of every variant the
  sweep compiled;
* ``forward/<design>``: the whole ``forge_dist.kernels.forward("gated_delta_rule", ...)`` and
  the relative RMSE of its output against the same forward on fp32 copies of the inputs
  (3xTF32 dots), the criterion for 16-bit WY operands (<= 5e-3);
* ``fla/<piece>``: FLA's gate cumsum, WY factors (fused kk^T + solve, then W and U), the
  unfused kk^T, solve_tril and recompute_w_u, the state walk and the whole forward, each
  guarded (a missing or refusing FLA leaves an ``error`` row); FLA's W, U and output are
  checked the same way.

    python scaling_benchmarks/wy_probe.py --out DIR [--T 65536] [--budget 80]
    python scaling_benchmarks/wy_probe.py --smoke --out DIR   # CPU, TRITON_INTERPRET=1, tiny

Prints a table and writes ``DIR/wy_probe_<device>_<date>.json``.  The forward rows run
first; ``--budget`` (seconds from the start) stops the design sweep early, and FLA's pieces
are skipped after ``--budget + 50`` (FLA autotunes on first use), so a run stays under three
minutes.  Under ``--smoke`` the interpreter rounds to bf16 by truncation: errors about twice
the GPU's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# design name -> WY_CONFIG overrides; the first is the package default, the most telling
# comparisons come first (the time budget cuts from the end)
DESIGNS = [
    ("split", {}),
    ("split/x_fp32", {"x_dtype": "fp32"}),
    ("fused/w4", {"fused": True, "num_warps": 4}),
    ("split/solve_BK16", {"solve_BK": 16}),
    ("split/solve_BK64", {"solve_BK": 64}),
    ("split/solve_s2", {"solve_stages": 2}),
    ("split/apply_128", {"BK": 128, "BV": 128}),
    ("split/apply_s2", {"num_stages": 2}),
    ("split/apply_w8", {"num_warps": 8}),
    ("split/solve_w2", {"solve_warps": 2}),
    ("fused/w2", {"fused": True, "num_warps": 2}),
]
FORWARD_DESIGNS = ("split", "split/x_fp32", "fused/w4")  # also timed end to end
B, H, K, V, BT = 1, 32, 128, 128, 64


def _bf16_dot_shim():
    """Widen bf16 dot operands in the interpreter (smoke runs only: the GPU never takes this
    path; see ``kernels._common.interpreter_bf16_dot``)."""
    from triton.runtime import interpreter as it

    from forge_dist.kernels._common import interpreter_bf16_dot

    if not getattr(it.InterpreterBuilder.create_dot, "widens_bf16", False):
        it.InterpreterBuilder.create_dot = interpreter_bf16_dot(it.InterpreterBuilder.create_dot)


def make_inputs(T, device, h, dk, dv):
    """``single_device.make_inputs("gated_delta_rule", T, device)`` (that function at the
    benchmark's own dims; these same generator calls at other heads and head dims)."""
    import torch

    from scaling_benchmarks import single_device

    if (h, dk, dv) == (single_device.H, single_device.K, single_device.V):
        return single_device.make_inputs("gated_delta_rule", T, device)

    gen = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def r(*s, dtype=bf):
        return torch.randn(*s, device=device, generator=gen, dtype=torch.float32).to(dtype)

    inp = {"q": r(B, T, h, dk), "k": r(B, T, h, dk), "v": r(B, T, h, dv)}
    inp["k"] = torch.nn.functional.normalize(inp["k"].float(), dim=-1).to(bf)
    inp["g"] = torch.nn.functional.logsigmoid(r(B, T, h, dtype=torch.float32) + 4)
    inp["beta"] = torch.rand(B, T, h, device=device, generator=gen).to(bf)
    return inp


def reference_wy(k, v, g, beta, spans):
    """fp64 ``(W, U)`` on token ranges ``spans`` (each a whole number of chunks):
    ``X = (I + A)^{-1}``, ``A_ij = b_i (k_i . k_j) exp(G_i - G_j)`` (j < i),
    ``W = X diag(b exp(G)) K``, ``U = X diag(b) V``, per chunk of 64 tokens."""
    import torch

    out = []
    for t0, t1 in spans:
        kc, vc = k[:, t0:t1].double(), v[:, t0:t1].double()
        n = (t1 - t0) // BT
        # [B, n, H, BT, D] -> [B, n, H, BT, D] per chunk, heads kept
        kc = kc.reshape(B, n, BT, -1, kc.shape[-1]).transpose(2, 3)
        vc = vc.reshape(B, n, BT, -1, vc.shape[-1]).transpose(2, 3)
        bc = beta[:, t0:t1].double().reshape(B, n, BT, -1).transpose(2, 3)
        G = g[:, t0:t1].double().reshape(B, n, BT, -1).transpose(2, 3).cumsum(-1)
        diff = G[..., :, None] - G[..., None, :]
        strict = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
        A = (kc @ kc.transpose(-1, -2)) * torch.exp(diff.masked_fill(~strict, float("-inf")))
        A = A * bc[..., None]
        X = torch.linalg.inv(torch.eye(BT, dtype=torch.float64, device=k.device) + A)
        W = X @ (kc * (bc * G.exp())[..., None])
        U = X @ (vc * bc[..., None])
        out.append((W.transpose(2, 3).reshape(B, t1 - t0, -1, kc.shape[-1]),
                    U.transpose(2, 3).reshape(B, t1 - t0, -1, vc.shape[-1])))
    return out


def rel(a, b) -> float:
    """Relative RMSE ``||a - b|| / ||b||``."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def slice_errors(w, u, refs, spans):
    ew = max(rel(w[:, t0:t1], W) for (t0, t1), (W, _) in zip(spans, refs))
    eu = max(rel(u[:, t0:t1], U) for (t0, t1), (_, U) in zip(spans, refs))
    return ew, eu


def timer(smoke):
    """``ms(fn)``: the median of ``do_bench`` on a GPU; one timed call in a smoke run."""
    if smoke:
        def ms(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return ms
    import torch
    import triton.testing

    def ms(fn):
        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return ms


def kernel_resources(kernel):
    """``[{num_warps, SOLVE, APPLY, ..., n_regs, n_spills}]`` of every compiled variant of a
    JIT kernel (empty where this Triton keeps them elsewhere)."""
    rows = []
    try:
        names = kernel.arg_names
        for per_device in kernel.device_caches.values():
            for ck in per_device[0].values():
                const = {}
                for key, val in getattr(getattr(ck, "src", None), "constants", {}).items():
                    name = names[key[0]] if isinstance(key, tuple) and len(key) == 1 else key
                    if name in ("SOLVE", "APPLY", "SBK", "BK", "BV"):
                        const[name] = val
                rows.append({"num_warps": ck.metadata.num_warps,
                             "num_stages": getattr(ck.metadata, "num_stages", None),
                             "constexprs": const,
                             "xs": str(getattr(ck.src, "signature", {}).get("xs")),
                             "n_regs": getattr(ck, "n_regs", None),
                             "n_spills": getattr(ck, "n_spills", None)})
    except Exception as e:  # noqa: BLE001 - informational only
        rows.append({"error": f"{type(e).__name__}: {e}"})
    return rows


def run_designs(inp, refs, spans, ms, budget, t_start, smoke):
    import torch
    from forge_dist.kernels import delta

    k, v, g, beta = inp["k"], inp["v"], inp["g"], inp["beta"]
    prec = "ieee" if smoke else "tf32"  # what DeltaRuleWork passes for bf16 inputs
    base = dict(delta.WY_CONFIG)
    rows = []
    for name, over in DESIGNS:
        if time.perf_counter() - t_start > budget:
            rows.append({"name": f"wy/{name}", "skipped": "time budget"})
            continue
        delta.WY_CONFIG.clear()
        delta.WY_CONFIG.update(base, **over)
        row = {"name": f"wy/{name}", "config": dict(delta.WY_CONFIG)}
        try:
            def run():
                return delta.wy(k, v, g, beta, BT=BT, prec=prec, dtype=k.dtype)
            w, u = run()
            row["W_rel"], row["U_rel"] = slice_errors(w, u, refs, spans)
            row["ms"] = ms(run)
            if not delta.WY_CONFIG["fused"]:  # each launch alone: solve, then W and U
                B_, T_, H_, K_ = k.shape
                xs = torch.empty(B_, T_, H_, BT, dtype=delta.wy_x_dtype(k.dtype),
                                 device=k.device)
                launches = delta.wy_launches(B_, T_, H_, K_, v.shape[-1], dtype=k.dtype,
                                             gated=True, prec=prec)
                for key, (grid, const, nw, ns) in zip(("solve_ms", "apply_ms"), launches):
                    row[key] = ms(lambda: delta._wy_kernel[grid](
                        k, v, g, beta, w, u, xs, T_, **const, num_warps=nw, num_stages=ns))
                del xs
            del w, u
        except Exception as e:  # noqa: BLE001 - one design failing must not stop the sweep
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
        if not smoke:
            torch.cuda.empty_cache()
    delta.WY_CONFIG.clear()
    delta.WY_CONFIG.update(base)
    rows.append({"name": "wy/kernels", "kernels": kernel_resources(delta._wy_kernel)})
    return rows


def run_forward(inp, ms):
    """The whole forward for the designs in ``FORWARD_DESIGNS``, and its output error against
    the forward on fp32 copies of q, k, v (3xTF32 dots); run whatever the time budget."""
    import torch
    from forge_dist import kernels
    from forge_dist.kernels import delta

    rows = []
    ref_inp = {n: (t.float() if n in ("q", "k", "v") else t) for n, t in inp.items()}
    with torch.no_grad():
        ref = kernels.forward("gated_delta_rule", ref_inp, None, None)[0]
    del ref_inp
    base = dict(delta.WY_CONFIG)
    for name, over in DESIGNS:
        if name not in FORWARD_DESIGNS:
            continue
        delta.WY_CONFIG.clear()
        delta.WY_CONFIG.update(base, **over)
        row = {"name": f"forward/{name}"}
        try:
            def run():
                return kernels.forward("gated_delta_rule", inp, None, None)[0]
            row["o_rel"] = rel(run(), ref)
            row["ms"] = ms(run)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        rows.append(row)
    delta.WY_CONFIG.clear()
    delta.WY_CONFIG.update(base)
    return rows, ref


def run_fla(inp, refs, spans, ref_o, ms, deadline):
    """FLA 0.6's pieces of the same forward, each guarded; none starts after ``deadline``
    (a ``time.perf_counter()`` value)."""
    rows = []
    try:
        import torch
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception as e:  # noqa: BLE001
        return [{"name": "fla", "error": f"{type(e).__name__}: {e}"}]
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    state = {}

    def piece(name, fn, check=None):
        row = {"name": f"fla/{name}"}
        if time.perf_counter() > deadline:
            rows.append(dict(row, skipped="time budget"))
            return
        try:
            out = fn()
            if check is not None:
                row.update(check(out))
            del out
            row["ms"] = ms(fn)
        except Exception as e:  # noqa: BLE001 - FLA may refuse a path on this Triton
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)

    with torch.no_grad():
        # FLA works in log2: G' = cumsum(g) / ln 2, exp2(G') = exp(G)
        piece("cumsum", lambda: chunk_local_cumsum(g, chunk_size=BT, scale=RCP_LN2))
        try:
            state["gc"] = chunk_local_cumsum(g, chunk_size=BT, scale=RCP_LN2)
        except Exception:  # noqa: BLE001
            pass

        def wy_check(out):
            w, u, _ = out
            ew, eu = slice_errors(w, u, refs, spans)
            return {"W_rel": ew, "U_rel": eu}

        try:
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            piece("wy_fused(kkt_solve+w_u)", lambda: chunk_gated_delta_rule_fwd_intra(
                k=k, v=v, g=state["gc"], beta=beta, chunk_size=BT), wy_check)
        except Exception as e:  # noqa: BLE001
            rows.append({"name": "fla/wy_fused(kkt_solve+w_u)",
                         "error": f"{type(e).__name__}: {e}"})
        try:
            from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
            from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
            from fla.ops.utils import solve_tril

            kkt = lambda: chunk_scaled_dot_kkt_fwd(k=k, g=state["gc"], beta=beta,  # noqa: E731
                                                   chunk_size=BT, output_dtype=torch.float32)
            piece("kkt", kkt)
            state["A"] = kkt()
            solve = lambda: solve_tril(A=state["A"], output_dtype=k.dtype)  # noqa: E731
            piece("solve_tril", solve)
            state["Ai"] = solve()
            piece("recompute_w_u", lambda: recompute_w_u_fwd(k=k, v=v, beta=beta, A=state["Ai"],
                                                             g=state["gc"]))
            state["wu"] = recompute_w_u_fwd(k=k, v=v, beta=beta, A=state["Ai"], g=state["gc"])
            state.pop("A", None)
        except Exception as e:  # noqa: BLE001
            rows.append({"name": "fla/unfused", "error": f"{type(e).__name__}: {str(e)[:300]}"})
        try:
            from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

            w, u = state["wu"]
            piece("fwd_h(state walk)", lambda: chunk_gated_delta_rule_fwd_h(
                k=k, w=w, u=u, g=state["gc"], output_final_state=True, chunk_size=BT))
        except Exception as e:  # noqa: BLE001
            rows.append({"name": "fla/fwd_h(state walk)", "error": f"{type(e).__name__}: {e}"})
        state.clear()
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            piece("forward", lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta)[0],
                  lambda o: {"o_rel": rel(o, ref_o)})
        except Exception as e:  # noqa: BLE001
            rows.append({"name": "fla/forward", "error": f"{type(e).__name__}: {e}"})
    return rows


def print_table(rows):
    print(f"{'row':34s} {'ms':>8s} {'solve':>7s} {'apply':>7s} {'W_rel':>9s} {'U_rel':>9s} "
          f"{'o_rel':>9s}  note")
    for r in rows:
        if "kernels" in r:
            for kr in r["kernels"]:
                print(f"    kernel {kr}")
            continue

        def f(key, fmt):
            x = r.get(key)
            return format(x, fmt) if isinstance(x, (int, float)) else "-"
        note = r.get("error") or r.get("skipped") or ""
        print(f"{r['name']:34s} {f('ms', '8.3f'):>8s} {f('solve_ms', '7.3f'):>7s} "
              f"{f('apply_ms', '7.3f'):>7s} {f('W_rel', '9.2e'):>9s} "
              f"{f('U_rel', '9.2e'):>9s} {f('o_rel', '9.2e'):>9s}  {note[:80]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON results")
    ap.add_argument("--T", type=int, default=65536)
    ap.add_argument("--budget", type=float, default=80.0,
                    help="seconds after which the sweeps stop (FLA's pieces: 50 s later)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1 at a tiny shape (checks the script runs)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    t_start = time.perf_counter()

    import torch

    from scaling_benchmarks import results_io

    if args.smoke:
        from forge_dist.kernels import _common  # noqa: F401 - applies the interpreter shims
        _bf16_dot_shim()
        device, T, h, dk, dv = "cpu", 2 * BT + 36, 2, 32, 48  # a ragged last chunk
        spans = [(0, BT)]
    else:
        if not torch.cuda.is_available():
            print("wy_probe.py needs a GPU (or --smoke)", file=sys.stderr)
            return 2
        device, T, h, dk, dv = "cuda", args.T, H, K, V
        n = 4 * BT  # three slices of four chunks
        spans = [(0, n), (T // 2 // BT * BT, T // 2 // BT * BT + n), (T - n, T)]
    inp = make_inputs(T, device, h, dk, dv)
    refs = reference_wy(inp["k"], inp["v"], inp["g"], inp["beta"], spans)
    ms = timer(args.smoke)

    from forge_dist.kernels import delta

    result = results_io.header("wy_probe", {"B": B, "T": T, "H": h, "K": dk, "V": dv,
                                            "dtype": "bfloat16", "smoke": args.smoke,
                                            "wy_config_default": dict(delta.WY_CONFIG),
                                            "check_spans": spans})
    # the forward first: its output error decides whether 16-bit WY operands may stay
    fwd_rows, ref_o = run_forward(inp, ms)
    rows = run_designs(inp, refs, spans, ms, args.budget, t_start, args.smoke) + fwd_rows
    if not args.smoke:
        rows += run_fla(inp, refs, spans, ref_o, ms, t_start + args.budget + 50)
    result["rows"] = rows
    result["seconds"] = time.perf_counter() - t_start
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = results_io.write(result, out)
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
