"""A plan's ``run`` specialised into straight-line Python (the static dispatcher's call path).

The general :meth:`forge_dist.runtime.plan.Plan.run` loops over input names, looks shapes
up in dicts, builds a pointer dict and walks each bound launch's slot list: on the H200
machine's host that was ~22 us per call above the two driver launches themselves
(``results/launch_overhead_*_s24.json``: ``static`` against ``static_bound``).  At plan time
everything but the tensors is known, so :func:`specialise` writes one function for the plan,
with every shape, dtype, device, grid, workspace pointer and scalar a constant, compiles it
with ``exec`` (as Triton generates its launchers) and returns it:

* the same checks as the general path, as one condition (type, shape, dtype, device,
  contiguity, 16-byte alignment, ``initial_state`` / ``out`` as planned, no input needing a
  gradient while grad mode is on).  Any miss calls the general path, which raises the
  error that names the argument, so error messages stay in one place;
* each launch packs its parameters with one ``struct.pack_into`` and calls the driver;
* an output is allocated just before the first launch that writes it: the decoupled
  program's first launch (the segment summaries) reads only the inputs, so the output's
  ``torch.empty`` runs on the host while the GPU already works.

Only single-device plans whose every launch has a cubin qualify (the rest keep the general
path).  The generated source is kept as ``run.__source__`` for inspection.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

ALIGN_MASK = 15  # the cubins assume 16-byte aligned pointers (Triton's specialisation)


def specialise(plan) -> Optional[Callable]:
    """``run(*inputs, initial_state=None, out=None)`` for ``plan``, or ``None`` when the plan
    does not qualify (sequence parallel, torch backend, or any launch without a cubin).

    The returned function has ``Plan.run``'s signature and results; on any input it does not
    take (wrong shape, an ``out`` of another dtype, ...) it calls ``plan``'s general run.
    """
    exe = plan.finish_exec
    if plan.size != 1 or plan.backend != "static" or exe is None:
        return None
    if not exe.bound or any(b is None for b in exe.bound):
        return None
    names = list(plan.input_names)
    if plan.device.type == "cuda":
        def on_device(n: str) -> str:
            return f"{n}.is_cuda and {n}.get_device() == {plan.device.index}"
    else:  # CPU plans of the static backend exist only with an injected (fake) dispatcher
        def on_device(n: str) -> str:
            return f"{n}.device.type == 'cpu'"
    env: Dict[str, Any] = {"Tensor": Tensor, "grad_enabled": torch.is_grad_enabled,
                           "empty": torch.empty, "stream": exe.stream,
                           "general": plan._run_general, "DEVICE": plan.device,
                           "OUT_SHAPE": tuple(plan.out_shape), "OUT_DTYPE": plan.out_dtype,
                           "HT_SHAPE": tuple(plan.ht_shape), "F32": torch.float32}
    args = [f"{n}" for n in names]
    # tensors to check: (python name, shape, dtype)
    checked = [(n, tuple(plan.shapes[n]), plan.dtypes[n]) for n in names]
    if plan.initial_state:
        checked.append(("initial_state", tuple(plan.state_shape), torch.float32))
    cond: List[str] = ["initial_state is not None" if plan.initial_state
                       else "initial_state is None"]
    for i, (n, shape, dtype) in enumerate(checked):
        env[f"S{i}"], env[f"D{i}"] = torch.Size(shape), dtype
        cond.append(f"type({n}) is Tensor and {n}.shape == S{i} and {n}.dtype is D{i} "
                    f"and {on_device(n)} and {n}.is_contiguous()")
    env["S_OUT"] = torch.Size(plan.out_shape)
    cond.append(f"(out is None or (type(out) is Tensor and out.shape == S_OUT and "
                f"out.dtype is OUT_DTYPE and {on_device('out')} and "
                f"out.is_contiguous() and not out.data_ptr() & ALIGN_MASK))")
    grads = " or ".join(f"{n}.requires_grad" for n, _, _ in checked)
    cond.append(f"not (grad_enabled() and ({grads}))")

    # pointer variables: inputs now, outputs when first needed
    ptr_of = {n: f"p_{n}" for n in names}
    if plan.initial_state:
        ptr_of["h0"] = "p_initial_state"
    body: List[str] = []
    body += [f"    p_{n} = {n}.data_ptr()" for n, _, _ in checked]
    body.append("    if (" + " | ".join(f"p_{n}" for n, _, _ in checked) +
                ") & ALIGN_MASK:")
    body.append("        return general(*inputs, initial_state=initial_state, out=out)")
    env["ALIGN_MASK"] = ALIGN_MASK
    body.append("    st = stream()")
    returns_ht = plan.output_final_state
    if not returns_ht:
        env["HT_SCRATCH"] = plan._ht_scratch.data_ptr()
        ptr_of["ht"] = "HT_SCRATCH"
    allocated = set()
    for i, b in enumerate(exe.bound):
        needed = {n for _, n in b._slots}
        if "o" in needed and "o" not in allocated:
            body.append("    o = out if out is not None else "
                        "empty(OUT_SHAPE, dtype=OUT_DTYPE, device=DEVICE)")
            body.append("    p_o = o.data_ptr()")  # torch.empty: 512-byte aligned
            ptr_of["o"] = "p_o"
            allocated.add("o")
        if "ht" in needed and returns_ht and "ht" not in allocated:
            body.append("    ht = empty(HT_SHAPE, dtype=F32, device=DEVICE)")
            body.append("    p_ht = ht.data_ptr()")
            ptr_of["ht"] = "p_ht"
            allocated.add("ht")
        per_call = dict(b._slots)  # slot -> buffer name (workspaces are baked in b.fixed)
        values = []
        for slot, fixed in enumerate(b.fixed):
            if slot in per_call:
                if per_call[slot] not in ptr_of:
                    return None  # a buffer this path does not know: keep the general path
                values.append(ptr_of[per_call[slot]])
            else:
                env[f"F{i}_{slot}"] = fixed
                values.append(f"F{i}_{slot}")
        env[f"pack{i}"], env[f"buf{i}"] = b.pack.struct.pack_into, b.pack.buffer
        env[f"launch{i}"], env[f"fn{i}"] = b.driver.launch, b.fn
        env[f"grid{i}"], env[f"params{i}"] = b.grid, b.pack.params_address
        body.append(f"    pack{i}(buf{i}, 0, {', '.join(values)})")
        body.append(f"    launch{i}(fn{i}, grid{i}, {b.block_x}, {b.shared}, st, params{i})")
    if "o" not in allocated:
        return None  # a program that never writes o is not a run() program
    body.append(f"    return o, {'ht' if returns_ht else 'None'}")
    src = (f"def run(*inputs, initial_state=None, out=None):\n"
           f"    if len(inputs) != {len(args)}:\n"
           f"        return general(*inputs, initial_state=initial_state, out=out)\n"
           f"    {', '.join(args)}, = inputs\n"
           f"    if not ({' and '.join(f'({c})' for c in cond)}):\n"
           f"        return general(*inputs, initial_state=initial_state, out=out)\n"
           + "\n".join(body) + "\n")
    exec(compile(src, f"<forge_dist plan run: {plan.op}>", "exec"), env)
    run = env["run"]
    run.__source__ = src
    run.__doc__ = plan._run_general.__doc__
    return run
