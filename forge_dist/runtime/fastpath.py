"""A plan's ``run`` specialised into straight-line Python.

The general :meth:`forge_dist.runtime.plan.Plan.run` loops over input names, looks shapes
up in dicts, builds a pointer dict and walks each launch's slot list: on the H200 machine's
host that was ~22 us per call above the two driver launches themselves
(``results/launch_overhead_*_s24.json``: ``static`` against ``static_bound``).  Everything
but the tensors is known once the plan's kernels are, so :func:`specialise` writes one
function for the plan, with every shape, dtype, device, grid, workspace pointer and scalar a
constant, compiles it with ``exec`` (as Triton generates its launchers) and returns it:

* the general path's checks (type, shape, dtype, device, contiguity, 16-byte alignment,
  ``initial_state`` / ``out`` as planned, no input needing a gradient while grad mode is
  on), each tensor's just before the first launch that reads it: the decoupled program's
  first launch (the segment summaries) reads k, v and g, so q's checks run while the GPU
  already works.  Any miss calls the general path, which raises the error that names the
  argument (error messages live in one place) or runs the call; a launch issued before the
  miss has only written the plan's workspaces;
* each launch is one call: a cubin's parameters packed with one ``struct.pack_into`` and
  ``cuLaunchKernel`` (static backend), or the generated launcher of the kernel the JIT
  compiled on the plan's first call, with the pointers as integers (Triton backend on a GPU,
  ``jit_launch.py``; only while no launch hook is installed, as there);
* an output is allocated (or ``out=`` checked) just before the first launch that writes
  it, which for the decoupled program is after the first launch too.

Plans qualify when every launch has a cubin, or, on the Triton backend, once every launch has
a compiled kernel (after the first run).  A sequence-parallel plan's function calls its
strategy's state pass between the summaries and the output walks, as ``_run_sp`` does.  The generated source is kept as
``run.__source__`` for inspection.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..sp import phases
from ..variants.transitions import Kind
from ..kernels import jit_launch
from .dispatcher import current_stream_fn

ALIGN_MASK = jit_launch.ALIGN - 1  # kernels are specialised on 16-byte aligned pointers


def _launchers(plan):
    """``("cubin", bound launches)`` or ``("jit", compiled launches)``, or ``None``."""
    exe = plan.finish_exec
    if exe is None or not exe.bound:
        return None
    if plan.size != 1 and plan.rank > 0 and plan.initial_state:
        return None  # an initial state a rank past the first ignores: the general path
    if plan.train:  # runs go through run_train (runtime/sp_train.py), not run
        return None
    if plan.backend == "static" and all(b is not None for b in exe.bound):
        return "cubin", exe.bound
    # compiled launches exist only on a GPU (jit_launch.CompiledLaunch.make)
    if plan.backend == "triton" and all(c is not None for c in exe._compiled):
        return "jit", exe._compiled
    return None


def _slots_of(ln, kind: str) -> List[Tuple[bool, Any]]:
    """(is a buffer, buffer name or fixed value) per kernel parameter of a cubin launch
    (:class:`~.dispatcher.BoundLaunch`, workspaces baked in) or a compiled one
    (:class:`~.jit_launch.CompiledLaunch`), in order."""
    if kind == "cubin":
        per_call = dict(ln._slots)  # slot -> buffer name; workspaces are baked in
        return [(True, per_call[j]) if j in per_call else (False, v)
                for j, v in enumerate(ln.fixed)]
    return list(ln._slots)


def _emit_launch(i: int, ln, kind: str, slots, ptr_of: Dict[str, str], env: Dict[str, Any],
                 body: List[str], stream: str = "st") -> bool:
    """Append launch ``i`` as one line (a cubin: one ``pack_into`` first) to ``body``, with
    each buffer's pointer expression from ``ptr_of``, the fixed values as constants in
    ``env`` and the stream from the local variable ``stream``; ``False`` (nothing appended)
    when a buffer has no pointer expression."""
    values = []
    for j, (is_buf, v) in enumerate(slots):
        if is_buf:
            if v not in ptr_of:
                return False
            values.append(ptr_of[v])
        else:
            env[f"F{i}_{j}"] = v
            values.append(f"F{i}_{j}")
    if kind == "cubin":
        env[f"pack{i}"], env[f"buf{i}"] = ln.pack.struct.pack_into, ln.pack.buffer
        env[f"launch{i}"], env[f"fn{i}"] = ln.driver.launch, ln.fn
        env[f"grid{i}"], env[f"params{i}"] = ln.grid, ln.pack.params_address
        body.append(f"    pack{i}(buf{i}, 0, {', '.join(values)})")
        body.append(f"    launch{i}(fn{i}, grid{i}, {ln.block_x}, {ln.shared}, {stream}, "
                    f"params{i})")
    else:
        env[f"launch{i}"], env[f"fn{i}"], env[f"meta{i}"] = (
            ln._run, ln._function, ln._packed)
        gx, gy, gz = ln._grid
        body.append(f"    launch{i}({gx}, {gy}, {gz}, {stream}, fn{i}, meta{i}, None, None, "
                    f"None, {', '.join(values)})")
    return True


def specialise(plan) -> Optional[Callable]:
    """``run(*inputs, initial_state=None, out=None)`` for ``plan``, or ``None`` when the plan
    does not qualify (see the module docstring).

    The returned function has ``Plan.run``'s signature and results; on any input it does not
    take (wrong shape, an ``out`` of another dtype, ...) it calls ``plan``'s general run.
    """
    got = _launchers(plan)
    if got is None:
        return None
    kind, launches = got
    exe = plan.finish_exec
    names = list(plan.input_names)
    if plan.device.type == "cuda":
        def on_device(n: str) -> str:
            return f"{n}.is_cuda and {n}.get_device() == {plan.device.index}"
    else:  # CPU plans of the static backend exist only with an injected (fake) dispatcher
        def on_device(n: str) -> str:
            return f"{n}.device.type == 'cpu'"
    env: Dict[str, Any] = {"Tensor": Tensor, "grad_enabled": torch.is_grad_enabled,
                           "empty": torch.empty, "empty_like": torch.empty_like,
                           "CONTIGUOUS": torch.contiguous_format, "general": plan._run_general,
                           "DEVICE": plan.device, "OUT_SHAPE": tuple(plan.out_shape),
                           "OUT_DTYPE": plan.out_dtype, "HT_SHAPE": tuple(plan.ht_shape),
                           "F32": torch.float32, "ALIGN_MASK": ALIGN_MASK,
                           "S_OUT": torch.Size(plan.out_shape)}
    fallback = "return general(*inputs, initial_state=initial_state, out=out)"

    # the tensors the caller passes: (python name, the kernels' buffer name, shape, dtype)
    checked = [(n, n, tuple(plan.shapes[n]), plan.dtypes[n]) for n in names]
    if plan.initial_state:
        checked.append(("initial_state", "h0", tuple(plan.state_shape), torch.float32))
    for i, (n, _, shape, dtype) in enumerate(checked):
        env[f"S{i}"], env[f"D{i}"] = torch.Size(shape), dtype

    body: List[str] = []

    def check(group) -> None:
        """The general path's checks of ``group``, as one condition; then its pointers."""
        conds = [f"type({n}) is Tensor and {n}.shape == S{i} and {n}.dtype is D{i} and "
                 f"{on_device(n)} and {n}.is_contiguous()" for i, (n, *_) in group]
        grads = " or ".join(f"{n}.requires_grad" for _, (n, *_) in group)
        conds.append(f"not (grad_enabled() and ({grads}))")
        body.append(f"    if not ({' and '.join(f'({c})' for c in conds)}):")
        body.append(f"        {fallback}")
        body.extend(f"    p_{n} = {n}.data_ptr()" for _, (n, *_) in group)
        body.append("    if (" + " | ".join(f"p_{n}" for _, (n, *_) in group) +
                    ") & ALIGN_MASK:")
        body.append(f"        {fallback}")

    # the dispatcher's stream function (cubins) or one a test injects, else the current
    # stream as Triton's launcher reads it
    env["stream"] = exe.stream or current_stream_fn(plan.device.index)
    if kind == "jit":
        env["relaunch_usable"] = jit_launch.usable
        body.append("    if not relaunch_usable():  # a launch hook: the JIT path sees it")
        body.append(f"        {fallback}")

    # pointer expressions: inputs once checked, outputs when first written, workspaces
    # constant
    ptr_of = {n: f"W_{n}" for n in exe.workspaces}
    env.update({f"W_{n}": t.data_ptr() for n, t in exe.workspaces.items()})
    returns_ht = plan.output_final_state
    if not returns_ht:  # the kernels write a final state nobody returns: the plan's scratch
        env["HT_SCRATCH"] = plan._ht_scratch.data_ptr()
        ptr_of["ht"] = "HT_SCRATCH"

    def allocate(needed) -> None:
        if "o" in needed and "o" not in ptr_of:
            # the output is allocated between the first two launches, where host time can
            # leave the GPU idle when the first kernel is short (T = 1K: a 3.7 us gap after a
            # 10 us summary).  empty_like of a checked input of the output's shape and dtype
            # costs 1.7 us on an H200 host, torch.empty with a shape tuple 3.1, with the
            # sizes as separate arguments 2.1 (results/logs/alloc_probe_*_s27.json).  The
            # explicit format: empty_like would copy strides is_contiguous() ignores.
            like = next((n for n, buf, shape, dtype in checked
                         if ptr_of.get(buf) == f"p_{n}" and shape == tuple(plan.out_shape)
                         and dtype is plan.out_dtype), None)
            body.append("    if out is None:")
            if like is not None:
                body.append(f"        o = empty_like({like}, memory_format=CONTIGUOUS)")
            else:
                body.append("        o = empty(*OUT_SHAPE, dtype=OUT_DTYPE, device=DEVICE)")
            body.append("    elif (type(out) is Tensor and out.shape == S_OUT and "
                        f"out.dtype is OUT_DTYPE and {on_device('out')} and "
                        "out.is_contiguous() and not out.data_ptr() & ALIGN_MASK):")
            body.append("        o = out")
            body.append("    else:")
            body.append(f"        {fallback}")
            body.append("    p_o = o.data_ptr()")  # a fresh allocation: 512-byte aligned
            ptr_of["o"] = "p_o"
        if "ht" in needed and "ht" not in ptr_of:
            body.append("    ht = empty(*HT_SHAPE, dtype=F32, device=DEVICE)")
            body.append("    p_ht = ht.data_ptr()")
            ptr_of["ht"] = "p_ht"

    def state_pass() -> None:
        """A sequence-parallel plan's state pass, between its summaries and its output
        walks (:meth:`~.plan.Plan._run_sp`); on a rank past the first its result is the
        output walks' ``h0``."""
        env.update(PASS=plan.strategy_obj.plan_forward, KIND=Kind(plan.kind),
                   WS=exe.workspaces, S_IN=plan.s_in, GROUP=plan.group, WORD=plan.word,
                   KEEP=plan._pass_keep, ZEROS=plan.zeros, STATE_PASS=phases.STATE_PASS)
        start = "initial_state" if plan.rank == 0 and plan.initial_state else "ZEROS"
        if start != "ZEROS" and tuple(plan.state_shape) != tuple(plan.zeros.shape):
            start = "initial_state.view(S_SHAPE)"  # hgrn's [B, D] passes as [B, 1, D, 1]
            env["S_SHAPE"] = tuple(plan.zeros.shape)
        body.append("    with STATE_PASS:")
        body.append(f"        S_in = PASS(KIND, WS, {start}, S_IN, GROUP, WORD, KEEP, "
                    f"zero_start={plan.rank == 0 and start == 'ZEROS'})")
        if plan.rank > 0:
            body.append("    p_h0 = S_in.data_ptr()")
            ptr_of["h0"] = "p_h0"

    # side launches (ir.SIDE) on the executor's side stream, forked as Executor._launch does
    side_state = {"on": False, "forked": False}
    on_side = exe.on_side if exe._side_used else [False] * len(launches)
    if any(on_side):
        side, env["FORK"], env["JOIN"] = exe.side_stream()
        env.update(SIDE=side, SIDE_ST=side.cuda_stream, CURRENT_STREAM=torch.cuda.current_stream,
                   DEVICE_INDEX=plan.device.index)
        body.append("    main_stream = CURRENT_STREAM(DEVICE_INDEX)")  # once a call

    def side_switch(to_side: bool) -> None:
        if to_side and not side_state["on"]:
            body.extend(["    FORK.record(main_stream)", "    FORK.wait(SIDE)"])
            side_state["forked"] = True
        side_state["on"] = to_side

    def join() -> None:
        if side_state["forked"]:
            body.extend(["    JOIN.record(SIDE)", "    JOIN.wait(main_stream)"])
        side_state.update(on=False, forked=False)

    split = plan.sp_split if plan.size > 1 else None
    all_slots = [_slots_of(ln, kind) for ln in launches]
    read = [{v for is_buf, v in slots if is_buf} for slots in all_slots]
    pending = list(enumerate(checked))
    # a tensor no launch reads is still checked, before the first launch
    unread = [(i, c) for i, c in pending if not any(c[1] in r for r in read)]
    for i, ln in enumerate(launches):
        slots = all_slots[i]
        # check the inputs this launch is the first to read just before it: the decoupled
        # program's summaries read k, v, g, so q's checks run while the GPU works.  A miss
        # after a launch has run it on the plan's workspaces only; the general path then
        # raises or runs the whole program.
        group = [(j, c) for j, c in pending if c[1] in read[i]] + (unread if i == 0 else [])
        pending = [(j, c) for j, c in pending if (j, c) not in group]
        if i == split or group or any(b in read[i] and b not in ptr_of for b in ("o", "ht")):
            # a check or an out= that can send the call to the general path, or the state
            # pass: never with side launches still forked (the general path would run the
            # program again beside them)
            join()
        if group:
            check(group)
            for _, (n, buffer, *_) in group:
                ptr_of[buffer] = f"p_{n}"
        if i == 0:
            body.append("    st = stream()")
        # every check that can send the call to the general path comes before the state
        # pass (o's included): a rank that passed its state must not run the program again
        allocate(read[i])
        if i == split:
            state_pass()
        side_switch(on_side[i])
        if not _emit_launch(i, ln, kind, slots, ptr_of, env, body,
                            "SIDE_ST" if on_side[i] else "st"):
            return None  # a buffer this path does not know: keep the general path
    join()
    if "o" not in ptr_of:
        return None  # a program that never writes o is not a run() program
    body.append(f"    return o, {'ht' if returns_ht else 'None'}")
    args = ", ".join(names)
    state = "initial_state is None" if not plan.initial_state else "initial_state is not None"
    src = (f"def run(*inputs, initial_state=None, out=None):\n"
           f"    if len(inputs) != {len(names)} or not ({state}):\n"
           f"        {fallback}\n"
           f"    {args}, = inputs\n" + "\n".join(body) + "\n")
    exec(compile(src, f"<forge_dist plan run: {plan.op}, {kind}>", "exec"), env)
    run = env["run"]
    run.__source__ = src
    run.__doc__ = plan._run_general.__doc__
    return run


def specialise_program(exe) -> Optional[Callable[[Dict[str, Tensor]], None]]:
    """``_Exec.__call__`` for ``exe`` (a :class:`~.plan._Exec`) as straight-line Python, or
    ``None`` unless every launch has a cubin or a compiled kernel.

    The plans' backward programs run through it: the general call builds a pointer dict per
    launch, goes through the compiled kernel's launcher with tensors (which reads each
    ``data_ptr`` again) and allocates through
    :meth:`~forge_dist.kernels.ir.Program.run_scoped`'s loops:
    93 us of host time for a linear_attn backward of three launches on an H100 machine
    (``results/logs/train_split_*_s29-before.log``); in one process, A against B, the
    straight-line run took 31-107 us off the matrix-state ops' ``o.backward`` at T = 1K
    (hgrn's general call was direct already: 4 us; ``results/logs/ab_backward_*_s29.json``).
    The function takes the same dict and does what the general call does, in the same
    order: the program's inputs (and, for a program without scratch buffers, its outputs)
    read from it; each output and scratch buffer of a scoped program allocated just before
    its first launch (outputs stored in the dict), each scratch buffer dropped after its
    last.  A dict of any other keys, a pointer off 16-byte alignment (the kernels were
    specialised on aligned pointers) or relaunches switched off (``jit_launch.usable``) go
    to the general call.
    """
    program = exe.program
    n = len(program.launches)
    if exe._side_used:
        return None  # the backward programs have no side launches; the general path has
    launches, kinds = [], []
    for i in range(n):
        if exe.bound[i] is not None:
            launches.append(exe.bound[i])
            kinds.append("cubin")
        elif exe._compiled[i] is not None:
            launches.append(exe._compiled[i])
            kinds.append("jit")
        else:
            return None
    buffers = program.buffers
    if not all(name.isidentifier() for name in buffers):
        return None  # the generated code names a local per buffer
    scoped = exe._scoped
    inputs = [b for b, buf in buffers.items() if buf.role == "input"]
    given = inputs if scoped else inputs + [b for b, buf in buffers.items()
                                            if buf.role == "output"]
    env: Dict[str, Any] = {"general": exe._call_general, "empty": torch.empty,
                           "empty_like": torch.empty_like, "CONTIGUOUS": torch.contiguous_format,
                           "DEVICE": exe.device, "ALIGN_MASK": ALIGN_MASK}
    fallback = "return general(t)"
    body: List[str] = [f"    if len(t) != {len(given)}:", f"        {fallback}"]
    if "jit" in kinds:
        env["relaunch_usable"] = jit_launch.usable
        body += ["    if not relaunch_usable():  # a launch hook: the JIT path sees it",
                 f"        {fallback}"]
    ptr_of = {b: f"W_{b}" for b in exe.workspaces}
    env.update({f"W_{b}": t.data_ptr() for b, t in exe.workspaces.items()})
    for b in given:
        body.append(f"    b_{b} = t[{b!r}]")
        body.append(f"    p_{b} = b_{b}.data_ptr()")
        ptr_of[b] = f"p_{b}"
    if given:
        body += ["    if (" + " | ".join(f"p_{b}" for b in given) + ") & ALIGN_MASK:",
                 f"        {fallback}"]
    if "cubin" in kinds:
        env["stream"] = exe.stream
    if "jit" in kinds:
        env["raw_stream"], env["INDEX"] = jit_launch.raw_stream, exe.device.index
    body.append("    st = stream()" if "jit" not in kinds else "    st = raw_stream(INDEX)")
    if "cubin" in kinds and "jit" in kinds:
        body.append("    st_cubin = stream()")
    allocate_at, free_at = program.lifetimes() if scoped else ([[]] * n, [[]] * n)
    for i, ln in enumerate(launches):
        for b in allocate_at[i]:
            buf = buffers[b]
            # empty_like of an input of the same shape and dtype is the cheaper allocation
            # (fastpath.specialise's note); the explicit format ignores its strides
            like = next((x for x in inputs if buffers[x].shape == buf.shape
                         and buffers[x].dtype == buf.dtype), None)
            # (fresh allocations are not checked for alignment: PyTorch's allocators return
            # blocks aligned far beyond 16 bytes, as fastpath.specialise assumes for o)
            if like is not None:
                body.append(f"    b_{b} = empty_like(b_{like}, memory_format=CONTIGUOUS)")
            else:  # the sizes as separate arguments: the cheaper call (0-d: the tuple)
                env[f"S_{b}"], env[f"D_{b}"] = tuple(buf.shape), buf.dtype
                star = "*" if buf.shape else ""
                body.append(f"    b_{b} = empty({star}S_{b}, dtype=D_{b}, device=DEVICE)")
            if buf.role == "output":
                body.append(f"    t[{b!r}] = b_{b}")
            body.append(f"    p_{b} = b_{b}.data_ptr()")
            ptr_of[b] = f"p_{b}"
        # a program of both kinds: the cubins on the dispatcher's stream, as _launch does
        stream = "st_cubin" if kinds[i] == "cubin" and "jit" in kinds else "st"
        if not _emit_launch(i, ln, kinds[i], _slots_of(ln, kinds[i]), ptr_of, env, body,
                            stream):
            return None
        for b in free_at[i]:  # dropped here, as run_scoped does
            body.append(f"    del b_{b}")
            ptr_of.pop(b)
    src = "def run(t):\n" + "\n".join(body) + "\n"
    kernels = ", ".join(ln.kernel for ln in program.launches)
    exec(compile(src, f"<forge_dist program run: {kernels}>", "exec"), env)
    run = env["run"]
    run.__source__ = src
    return run
