"""The specialised run of static plans (runtime/fastpath.py), on the CPU with a recording
driver: the same launches, parameters and results as the general path; every input the
plan does not take goes to the general path's error before anything is launched."""
import pytest
import torch

from forge_dist.runtime import aot, dispatcher, fastpath
from forge_dist.runtime import PlanError, plan

from .static_fakes import TARGET, FakeDriver, verified_cache

pytestmark = pytest.mark.skipif(aot.ptxas_version(TARGET) is None,
                                reason="Triton's bundled ptxas is not available here")

B, T, H, K, V = 1, 96, 2, 32, 48


def _static_plan(built, op="simple_gla", **kw):
    drv = FakeDriver()
    disp = dispatcher.Dispatcher(verified_cache(built[0]), drv)
    disp.stream_fn = lambda device_index: (lambda: 77)
    dims = dict(D=40) if op == "hgrn" else dict(H=H, K=K, V=V)
    p = plan(op, B=B, T=T, dtype=torch.float32, device="cpu", backend="static",
             dispatcher=disp, **dims, **kw)
    drv.packs = {b.fn: b.pack for b in p.finish_exec.bound}
    return p, drv


def _inputs(op="simple_gla"):
    if op == "hgrn":
        return torch.randn(B, T, 40), -torch.rand(B, T, 40)
    q, k, v = (torch.randn(B, T, H, n) for n in (K, K, V))
    return q, k, v, -torch.rand(B, T, H)


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("output_final_state", [False, True])
def test_fast_run_launches_what_the_general_run_does(built, execution, initial_state,
                                                     output_final_state):
    p, drv = _static_plan(built, execution=execution, initial_state=initial_state,
                          output_final_state=output_final_state)
    assert "run" in vars(p) and "def run(" in p.run.__source__
    inputs = _inputs()
    h0 = torch.randn(B, H, K, V) if initial_state else None
    out = torch.empty(B, T, H, V)
    o_fast, ht_fast = p.run(*inputs, initial_state=h0, out=out)
    fast = list(drv.values)
    drv.values.clear()
    o_gen, ht_gen = p._run_general(*inputs, initial_state=h0, out=out)
    general = list(drv.values)
    assert o_fast is out and o_gen is out
    assert (ht_fast is None) == (ht_gen is None) == (not output_final_state)
    assert len(fast) == len(p.describe()["launches"]) >= 1
    # the same functions with the same parameters, the final state's pointer apart
    # (each call allocates its own)
    if output_final_state:
        fast = [(fn, tuple(ht_gen.data_ptr() if x == ht_fast.data_ptr() else x for x in vals))
                for fn, vals in fast]
        assert any(ht_gen.data_ptr() in vals for _, vals in fast)
    assert fast == general
    # without out=: the output is allocated, and its pointer is what the launch wrote
    drv.values.clear()
    o, _ = p.run(*inputs, initial_state=h0)
    assert o.shape == (B, T, H, V) and o.dtype == torch.float32
    assert any(o.data_ptr() in vals for _, vals in drv.values)
    assert all(launch[4] == 77 for launch in drv.launches)  # the stream of the plan


def test_decoupled_run_allocates_the_output_after_the_first_launch(built):
    p, _ = _static_plan(built, execution="decoupled")
    src = p.run.__source__
    assert len(p.finish_exec.bound) >= 2
    # the summaries' launch reads inputs only: o's allocation follows it, as an empty_like
    # of v (checked by then, the output's shape and dtype: the cheaper allocation)
    assert (src.index("launch0(") < src.index("o = empty_like(v, memory_format=CONTIGUOUS)")
            < src.index("launch1("))


def test_allocated_output_is_contiguous_and_new_whatever_the_template_strides(built):
    """``empty_like`` copies strides that ``is_contiguous`` ignores (a size-1 batch dim's):
    the output must still get the plain contiguous strides, and never share memory."""
    p, _ = _static_plan(built, execution="decoupled")
    q, k, v, g = _inputs()
    odd = torch.empty(B * T * H * V + 7).as_strided((B, T, H, V), (12345, H * V, V, 1))
    odd.copy_(v)
    assert odd.is_contiguous() and odd.stride()[0] == 12345
    assert torch.empty_like(odd).stride()[0] == 12345  # what a bare empty_like would give
    o, _ = p.run(q, k, odd, g)
    assert o.stride() == torch.empty(B, T, H, V).stride()
    assert o.data_ptr() not in {t.data_ptr() for t in (q, k, odd, g)}


def test_hgrn_plan_is_specialised(built):
    p, drv = _static_plan(built, op="hgrn", output_final_state=True)
    assert "    x, g, = inputs" in p.run.__source__
    x, g = _inputs("hgrn")
    o, ht_fast = p.run(x, g)
    fast = [(fn, tuple(-1 if v == ht_fast.data_ptr() else v for v in vals))
            for fn, vals in drv.values]
    drv.values.clear()
    _, ht_gen = p._run_general(x, g, out=o)
    general = [(fn, tuple(-1 if v == ht_gen.data_ptr() else v for v in vals))
               for fn, vals in drv.values]
    assert fast == general and len(fast) == len(p.describe()["launches"])


def _bad_calls():
    """``(label, bad tensor, args, kwargs, message)`` of calls a plan must refuse."""
    q, k, v, g = _inputs()
    misaligned = torch.randn(B * T * H * K + 1)[1:].view(B, T, H, K)
    needs_grad = q.clone().requires_grad_()
    return [
        ("shape", "q", (q[:, :64], k, v, g), {}, "shape"),
        ("dtype", "k", (q, k.double(), v, g), {}, "dtype"),
        ("not a tensor", "q", (q.numpy(), k, v, g), {}, "expected a torch.Tensor"),
        ("non-contiguous", "k", (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, g),
         {}, "contiguous"),
        ("misaligned", "q", (misaligned, k, v, g), {}, "not 16-byte aligned"),
        ("misaligned k", "k", (q, misaligned, v, g), {}, "not 16-byte aligned"),
        ("needs grad", "q", (needs_grad, k, v, g), {}, "forward-only"),
        ("gate shape", "g", (q, k, v, g[:, :64]), {}, "shape"),
        ("initial_state", None, (q, k, v, g), {"initial_state": torch.zeros(B, H, K, V)},
         "initial_state=False"),
        ("out dtype", "o", (q, k, v, g), {"out": torch.empty(B, T, H, V, dtype=torch.float64)},
         "dtype"),
        ("out misaligned", "o", (q, k, v, g),
         {"out": torch.randn(B * T * H * V + 1)[1:].view(B, T, H, V)}, "aligned"),
        ("count", None, (q, k, v), {}, "expected 4 inputs"),
    ]


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
def test_refused_inputs_get_the_general_errors(built, execution):
    """Every refusal raises the general path's error.  Nothing that reads or writes a
    refused tensor is launched: the decoupled program's summaries (which write only the
    plan's workspaces) may have run for a refused q or out, nothing else."""
    p, drv = _static_plan(built, execution=execution)
    launches = p.finish_exec.program.launches
    for label, bad, args, kw, message in _bad_calls():
        before = len(drv.launches)
        with pytest.raises((PlanError, TypeError), match=message):
            p.run(*args, **kw)
        issued = [fn for fn, *_ in drv.launches[before:]]
        readers = [i for i, ln in enumerate(launches)
                   if bad in {v for _, kind, v in ln.args if kind == "buf"}]
        allowed = readers[0] if readers else 0  # launches before the first reader
        assert len(issued) <= allowed, (label, issued)
        if issued:
            assert execution == "decoupled" and bad in ("q", "o")
            assert issued == [p.finish_exec.bound[0].fn]
    # under no_grad an input that requires grad is fine
    q, k, v, g = _inputs()
    before = len(drv.launches)
    with torch.no_grad():
        p.run(q.requires_grad_(), k, v, g)
    assert len(drv.launches) - before == len(launches)


def test_plans_that_do_not_qualify_keep_the_general_run(built, tmp_path):
    import json
    import shutil

    from forge_dist import kernels

    # a launch without a cubin (JIT fallback): not specialised
    d = tmp_path / "partial"
    shutil.copytree(built[0], d)
    man = json.loads((d / "manifest.json").read_text())
    prog = kernels.forward_program("simple_gla", B=B, T=T, H=H, K=K, V=V,
                                   dtype=torch.float32, gated=True, has_h0=False,
                                   execution="decoupled")
    del man["kernels"][prog.specs()[-1].key]
    (d / "manifest.json").write_text(json.dumps(man))
    disp = dispatcher.Dispatcher(verified_cache(d), FakeDriver())
    disp.stream_fn = lambda device_index: (lambda: 0)
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             backend="static", dispatcher=disp, execution="decoupled")
    assert "run" not in vars(p)
    # the torch backend: not specialised either
    p2 = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
              backend="torch")
    assert "run" not in vars(p2)


class _FakeCompiledKernel:
    """What the JIT returns for a compiled kernel; its launcher records each call."""

    def __init__(self, name, calls):
        self.function, self.packed_metadata = f"fn:{name}", ("meta", name)
        self._calls = calls

    def run(self, *args):
        self._calls.append(args)


def _params_of(interpreted):
    """A JITFunction's ``params`` (name, has_default, default) for the interpreter's
    function, which has none."""
    import inspect
    from types import SimpleNamespace

    sig = inspect.signature(interpreted.fn)
    return SimpleNamespace(params=[
        SimpleNamespace(name=n, has_default=q.default is not q.empty, default=q.default)
        for n, q in sig.parameters.items()])


def test_triton_plan_specialised_to_the_kernels_its_first_run_compiled(monkeypatch):
    """On a GPU the first run compiles the kernels and keeps their launchers
    (jit_launch.CompiledLaunch); here fakes stand in for them."""
    import importlib

    from forge_dist.kernels import interpreting
    from forge_dist.kernels import jit_launch

    if not interpreting():  # a Triton plan of CPU tensors runs only in the interpreter
        pytest.skip("needs TRITON_INTERPRET=1 (on a GPU, test_gpu.py covers this path)")

    launch_module = importlib.import_module("forge_dist.kernels.jit_launch")
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             backend="triton", execution="decoupled")
    assert "run" not in vars(p) and fastpath.specialise(p) is None  # nothing compiled yet
    exe = p.finish_exec
    q, k, v, g = _inputs()
    o = torch.empty(B, T, H, V)
    tensors = {"q": q, "k": k, "v": v, "g": g, "o": o, "ht": p._ht_scratch, **exe.workspaces}
    calls = []
    exe._compiled = [
        jit_launch.CompiledLaunch.make(_FakeCompiledKernel(ln.kernel, calls), _params_of(fn),
                                       ln.grid, ln.args, dict(ln.constexprs), tensors)
        for ln, fn in zip(exe.program.launches, exe.kernels)]
    assert all(c is not None for c in exe._compiled)
    exe.stream = lambda: 55
    monkeypatch.setattr(launch_module, "raw_stream", lambda index: 55)
    fast = fastpath.specialise(p)
    assert fast is not None and "relaunch_usable()" in fast.__source__
    fast(q, k, v, g, out=o)
    specialised = list(calls)
    calls.clear()
    p._run_general(q, k, v, g, out=o)  # CompiledLaunch.__call__, tensors as tensors
    general = [tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in c)
               for c in calls]
    assert len(specialised) == len(exe.program.launches) and specialised == general
    assert specialised[0][:5] == (*exe.program.launches[0].grid, 55, "fn:walk")
    # relaunches switched off (as a launch hook does): the specialised run launches nothing
    # itself and the general path runs the JIT (here the interpreter)
    calls.clear()
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "0")
    o2, _ = fast(q, k, v, g)
    assert calls == [] and torch.isfinite(o2).all()


def test_output_without_a_template_input_is_allocated_from_its_shape(built):
    """A program whose output matches no input's shape and dtype allocates with
    ``torch.empty``; here the plan's output dtype is changed before specialising."""
    p, _ = _static_plan(built, execution="decoupled")
    p.out_dtype = torch.float64
    run = fastpath.specialise(p)
    assert "o = empty(*OUT_SHAPE, dtype=OUT_DTYPE, device=DEVICE)" in run.__source__
    o, _ = run(*_inputs())
    assert o.dtype == torch.float64 and o.shape == (B, T, H, V) and o.is_contiguous()


class _SideEvent:
    """A recording stand-in for the fork and join events of an executor's side stream."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, stream):
        self.log.append((f"{self.name}.record", stream.cuda_stream))

    def wait(self, stream):
        self.log.append((f"{self.name}.wait", stream.cuda_stream))


def test_side_launches_go_to_the_side_stream_forked_and_joined(built, monkeypatch):
    """A launch the program puts on the side stream (ir.SIDE; the delta rule's pieced
    summary walks on a GPU) is issued on the executor's side stream after a fork from the
    caller's, and the run joins the side stream back before anything that can send the
    call to the general path (here the output's allocation and out= check before the output
    walk; for a sequence-parallel plan also its state pass), as the general path joins at
    the end of its range (tests/runtime/test_executor.py)."""
    from types import SimpleNamespace

    p, drv = _static_plan(built, execution="decoupled")
    exe = p.finish_exec
    n = len(exe.program.launches)
    assert n >= 2
    exe.on_side, exe._side_used = [True] + [False] * (n - 1), True
    log = drv.launches  # launches and events in one order
    exe._side = (SimpleNamespace(cuda_stream=88), _SideEvent("fork", log),
                 _SideEvent("join", log))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream="main"))
    run = fastpath.specialise(p)
    assert "FORK.wait(SIDE)" in run.__source__ and "JOIN.wait(main_stream)" in run.__source__
    run(*_inputs())
    order = [x if len(x) == 2 else ("launch", x[4]) for x in log]
    assert order == ([("fork.record", "main"), ("fork.wait", 88), ("launch", 88),
                      ("join.record", 88), ("join.wait", "main")]
                     + [("launch", 77)] * (n - 1))
    src = run.__source__
    assert src.index("JOIN.wait") < src.index("if out is None")  # joined before the check


def _record_allocations(monkeypatch):
    """A list that gets every tensor ``torch.empty`` / ``empty_like`` make from now on (kept
    alive, so that their pointers stay distinct and can be numbered)."""
    allocated = []

    def recording(make):
        def alloc(*a, **k):
            t = make(*a, **k)
            allocated.append(t)
            return t
        return alloc
    monkeypatch.setattr(torch, "empty", recording(torch.empty))
    monkeypatch.setattr(torch, "empty_like", recording(torch.empty_like))
    return allocated


@pytest.mark.parametrize("op", ["simple_gla", "gated_delta_rule", "hgrn"])
def test_backward_program_specialised_launches_what_the_general_call_does(monkeypatch, op):
    """A plan's backward program after its first call (``_Exec`` with ``specialise``): the
    straight-line run (``fastpath.specialise_program``) makes the general call's launches
    with the same parameters, allocates the same buffers in the same order, leaves the same
    outputs in the dict and drops the scratch; a dict of other keys, an unaligned pointer
    or relaunches switched off go to the general call before anything is launched.  Fake
    compiled kernels stand in for the GPU's (as in the forward's test above)."""
    import importlib

    from forge_dist.kernels import interpreting
    from forge_dist.kernels import jit_launch

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (on a GPU, test_gpu.py covers this path)")
    launch_module = importlib.import_module("forge_dist.kernels.jit_launch")
    monkeypatch.setattr(launch_module, "raw_stream", lambda index: 55)
    if op == "hgrn":  # two launches at this T would be one: the decoupled schedule's three
        p = plan("hgrn", B=B, T=T, D=40, dtype=torch.float32, device="cpu",
                 execution="decoupled")
    else:
        p = plan(op, B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu")
    exe = p._backward_exec(False)
    buffers = exe.program.buffers
    assert exe._specialise_pending and exe._scoped == (op != "hgrn")
    gen = torch.Generator().manual_seed(3)
    given = {n: torch.randn(b.shape, generator=gen).to(b.dtype) for n, b in buffers.items()
             if b.role == "input" or (b.role == "output" and not exe._scoped)}
    calls = []
    every = {**given, **exe.workspaces, **{n: torch.empty(b.shape, dtype=b.dtype)
                                           for n, b in buffers.items() if n not in given}}
    exe._compiled = [
        jit_launch.CompiledLaunch.make(_FakeCompiledKernel(ln.kernel, calls), _params_of(fn),
                                       ln.grid, ln.args, dict(ln.constexprs), every)
        for ln, fn in zip(exe.program.launches, exe.kernels)]
    assert all(c is not None for c in exe._compiled)

    real_empty = torch.empty
    allocated = _record_allocations(monkeypatch)

    def run(call):
        """The launches of ``call`` on a copy of ``given``, pointers named, and the dict."""
        calls.clear()
        allocated.clear()
        t = dict(given)
        call(t)
        names = {x.data_ptr(): n for n, x in given.items()}
        names.update({w.data_ptr(): f"workspace {n}" for n, w in exe.workspaces.items()})
        names.update({a.data_ptr(): f"allocation {j} {tuple(a.shape)} {a.dtype}"
                      for j, a in enumerate(allocated)})
        named = [tuple(names.get(x.data_ptr() if isinstance(x, torch.Tensor) else x, x)
                       for x in c) for c in calls]
        return named, t

    general, t_general = run(exe)  # the first call: the general one, then specialised
    assert exe._fast is not None and not exe._specialise_pending
    assert "def run(t):" in exe._fast.__source__
    fast, t_fast = run(exe)
    assert len(fast) == len(exe.program.launches) and fast == general
    assert all(c[3] == 55 for c in calls)  # the current stream
    outputs = {n for n, b in buffers.items() if b.role == "output"}
    assert set(t_fast) == set(t_general) == set(given) | outputs  # no scratch left
    if exe._scoped:
        scratch = [n for n, b in buffers.items() if b.role == "scratch"]
        assert scratch and len(allocated) == len(outputs) + len(scratch)
        src = exe._fast.__source__
        assert all(f"    del b_{n}" in src for n in scratch)

    # what it does not take goes to the general call, before any launch
    fell = []
    monkeypatch.setattr(exe, "_call_general", lambda t: fell.append(set(t)))
    fast_run = fastpath.specialise_program(exe)
    first = next(iter(given))
    shifted = real_empty(given[first].numel() + 1, dtype=given[first].dtype)[1:]
    shifted = shifted.view(given[first].shape)  # 4 bytes past an aligned address
    for t in ({**given, first: shifted}, {**given, "extra": shifted}):
        calls.clear()
        fast_run(t)
        assert calls == [] and fell.pop() == set(t)
    monkeypatch.setenv("FORGE_DIST_JIT_RELAUNCH", "0")
    fast_run(dict(given))
    assert calls == [] and fell.pop() == set(given)


@pytest.mark.parametrize("op", ["simple_gla", "hgrn"])
@pytest.mark.parametrize("h0,dht", [(False, False), (True, True)])
def test_static_backward_program_specialised_packs_what_the_general_call_does(
        built, monkeypatch, op, h0, dht):
    """The cubin side of ``specialise_program``: a static plan's ``run_backward`` packs the
    same parameters for the same kernels from its second call (straight-line) as on its
    first (the general call), with fresh buffers in the same order and the workspaces'
    pointers baked in."""
    p, drv = _static_plan(built, op=op, initial_state=h0)
    exe = p._backward_exec(dht)
    assert all(b is not None for b in exe.bound), exe.paths
    drv.packs.update({b.fn: b.pack for b in exe.bound})
    gen = torch.Generator().manual_seed(4)
    if op == "hgrn":
        args = (-torch.rand(B, T, 40, generator=gen), torch.randn(B, T, 40, generator=gen),
                torch.randn(B, T, 40, generator=gen))
        state = (B, 40)
    else:
        q, k, v, g = _inputs()
        args = (q, k, v, g, torch.randn(B, T, H, V, generator=gen))
        state = (B, H, K, V)
    kw = {"initial_state": torch.randn(*state)} if h0 else {}
    if dht:
        kw["dht"] = torch.randn(*state)
    allocated = _record_allocations(monkeypatch)

    def run():
        drv.values.clear()
        allocated.clear()
        drv.launches.clear()
        p.run_backward(*args, need_initial_grad=h0, **kw)
        names = {t.data_ptr(): f"arg {j}" for j, t in enumerate(args)}
        names.update({t.data_ptr(): n for n, t in kw.items()})
        names.update({w.data_ptr(): f"workspace {n}" for n, w in exe.workspaces.items()})
        for j, a in enumerate(allocated):
            names.setdefault(a.data_ptr(), f"allocation {j} {tuple(a.shape)}")
        return [(fn, tuple(names.get(x, x) for x in vals)) for fn, vals in drv.values]
    general = run()
    assert exe._fast is not None and "pack0(" in exe._fast.__source__
    fast = run()
    assert len(fast) == len(exe.program.launches) and fast == general
    assert all(launch[4] == 77 for launch in drv.launches)  # the dispatcher's stream
