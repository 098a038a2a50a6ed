"""AOT compilation for sm_90 on the CPU machine, the cubin cache and its invalidation, the
compile CLI, and the static dispatcher's packing and lookup (with a recording fake driver).

Compiling needs Triton's bundled ptxas, not a GPU; under ``TRITON_INTERPRET=1`` the compile
and verify steps run in a child process with the interpreter off (see runtime/aot.py).
"""
import ctypes
import json
import shutil
import struct
from pathlib import Path


import pytest
import torch

from forge_dist import kernels
from forge_dist.kernels import ir
from forge_dist.runtime import aot, compile_cli, dispatcher, plan

from .static_fakes import SMALL, TARGET, FakeDriver, verified_cache

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(aot.ptxas_version(TARGET) is None,
                                reason="Triton's bundled ptxas is not available here")


def test_compile_all_for_sm90_on_cpu(built):
    d, rep = built
    specs = aot.enumerate_specs(dict(aot.DEFAULTS, **SMALL))
    assert rep["specs"] == len(specs) and len(rep["compiled"]) == len(specs) > 8
    man = json.loads((d / "manifest.json").read_text())
    import triton
    assert man["header"]["triton"] == triton.__version__
    assert man["header"]["torch"] == torch.__version__
    assert man["header"]["target"] == "cuda:90:32" and man["header"]["ptxas"]
    kinds = {e["kernel"] for e in man["kernels"].values()}
    assert kinds == {"walk", "segment_scan", "gate_cumsum", "hgrn", "hgrn_scan", "hgrn_bwd",
                     "chunk_states", "chunk_states_bwd", "scalar_dqkg"}  # + simple_gla's backward
    for key, e in man["kernels"].items():
        blob = (d / e["cubin"]).read_bytes()
        assert blob[:4] == b"\x7fELF", key
        # an sm_90 cubin: the ELF header's e_flags carry the SM version (low byte = 90)
        e_flags = struct.unpack_from("<I", blob, 48)[0]
        assert e_flags & 0xFF == 90, hex(e_flags)
        assert e["name"] == ir.KERNELS[e["kernel"]][1]
        assert e["num_warps"] in (1, 2, 4, 8) and e["shared"] >= 0
        assert e["global_scratch_size"] == 0 and e["profile_scratch_size"] == 0
        assert len(e["source_hash"]) == 64 and e["cubin_sha256"]


def test_cache_reused_and_portable(built, tmp_path):
    d, _ = built
    again = aot.compile_all(SMALL, target=TARGET, cache_dir=d)
    assert again["compiled"] == [] and len(again["reused"]) == again["specs"]
    # "another machine": the cache moves as a directory (paths in the manifest are relative)
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)
    v = aot.verify(moved, TARGET)
    assert v["stale"] == {} and len(v["valid"]) == again["specs"]


def _copy(d, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(d, out)
    return out


def test_version_mismatch_detected_and_rebuilt(built, tmp_path):
    d = _copy(built[0], tmp_path, "old_triton")
    man = json.loads((d / "manifest.json").read_text())
    man["header"]["triton"] = "3.5.0"
    (d / "manifest.json").write_text(json.dumps(man))
    v = aot.verify(d, TARGET)
    assert v["valid"] == [] and all("triton '3.5.0'" in r for r in v["stale"].values())
    one = dict(SMALL, variants=["hgrn"], initial_state=[False], sequence_parallel=False,
               execution=["fused"], backward=False)
    rep = aot.compile_all(one, target=TARGET, cache_dir=d)
    assert len(rep["compiled"]) == 1 and "triton" in list(rep["stale"].values())[0]
    man = json.loads((d / "manifest.json").read_text())
    assert man["header"]["triton"] != "3.5.0" and len(man["kernels"]) == 1


def test_target_and_torch_mismatch(built, tmp_path):
    d = built[0]
    assert all("target" in r for r in aot.verify(d, "cuda:80")["stale"].values())
    d2 = _copy(d, tmp_path, "old_torch")
    man = json.loads((d2 / "manifest.json").read_text())
    man["header"]["torch"] = "2.11.0+cu130"
    (d2 / "manifest.json").write_text(json.dumps(man))
    assert aot.verify(d2, TARGET)["valid"] == []


def test_tampered_cubin_is_stale(built, tmp_path):
    d = _copy(built[0], tmp_path, "tampered")
    man = json.loads((d / "manifest.json").read_text())
    key, e = next(iter(man["kernels"].items()))
    p = d / e["cubin"]
    blob = p.read_bytes()
    p.write_bytes(blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    assert aot.verify(d, TARGET)["stale"] == {key: "cubin checksum mismatch"}


KERNEL_SRC = '''
import triton
import triton.language as tl

@triton.jit
def add_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) {op} 1.0, mask=i < n)
'''


def test_source_change_detected_and_rebuilt(tmp_path, monkeypatch):
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    src = mod_dir / "aot_probe_kernels.py"
    src.write_text(KERNEL_SRC.format(op="+"))
    monkeypatch.syspath_prepend(str(mod_dir))  # the child process inherits sys.path
    spec = ir.KernelSpec("aot_probe_kernels:add_kernel",
                               (("x", "*fp32"), ("y", "*fp32"), ("n", "i32")),
                               (("BLOCK", 128),), 4, 3)
    d = tmp_path / "cache"
    rep = aot.compile_specs([spec], d, TARGET)
    assert rep["compiled"] == [spec.key]
    assert aot.compile_specs([spec], d, TARGET)["reused"] == [spec.key]
    src.write_text(KERNEL_SRC.format(op="*"))
    assert aot.verify(d, TARGET)["stale"] == {spec.key: "source of aot_probe_kernels:add_kernel changed"}
    rep = aot.compile_specs([spec], d, TARGET)
    assert rep["compiled"] == [spec.key] and "changed" in rep["stale"][spec.key]
    assert aot.verify(d, TARGET)["stale"] == {}


def test_compile_cli(tmp_path, capsys):
    cfg = tmp_path / "aot.toml"
    cfg.write_text('variants = ["hgrn"]\nhgrn_dims = [64]\ndtypes = ["float16"]\n'
                   'initial_state = [false]\nsequence_parallel = false\nexecution = ["fused"]\n'
                   'backward = false\n')
    d = tmp_path / "cache"
    assert compile_cli.main(["--config", str(cfg), "--cache-dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert "1 kernels for cuda:90:32" in out and "1 compiled" in out
    assert compile_cli.main(["--config", str(cfg), "--cache-dir", str(d),
                             "--set", "hgrn_dims=[64, 128]"]) == 0
    assert "1 compiled, 1 reused" in capsys.readouterr().out
    # the backward of the fused hgrn plan: one reverse walk, with and without dht
    assert compile_cli.main(["--config", str(cfg), "--cache-dir", str(d),
                             "--set", "backward=true"]) == 0
    assert "3 kernels" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compile_cli.main(["--config", str(cfg), "--set", "heads_count=3"])
    with pytest.raises(SystemExit):
        compile_cli.main(["--config", str(cfg), "--target", "sm90"])
    assert compile_cli.main(["--config", str(ROOT / "configs" / "aot_example.toml"),
                             "--list"]) == 0
    assert "kernel specs" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# Dispatcher: argument packing and lookup (CPU; launching needs a GPU: test_gpu.py)
# ---------------------------------------------------------------------------------------

def test_argpack_layout():
    pack = dispatcher.ArgPack(["*bf16", "i32", "fp32", "*fp32", "i64", "i8", "fp16", "*i8"])
    assert pack.offsets == (0, 8, 12, 16, 24, 32, 34, 40) and pack.size == 48
    vals = [0x7F00_0000_1000, -5, 0.25, 0x7F00_0000_2000, 2 ** 40, -3, 1.5, 0]
    pack.pack(vals)
    assert pack.unpack() == tuple(vals)
    raw = ctypes.string_at(ctypes.addressof(pack.buffer), pack.size)
    assert struct.unpack_from("<i", raw, 8)[0] == -5
    assert struct.unpack_from("<f", raw, 12)[0] == 0.25
    base = ctypes.addressof(pack.buffer)
    assert [pack.params[i] for i in range(8)] == [base + o for o in pack.offsets]
    with pytest.raises(ValueError, match="unsupported kernel parameter type"):
        dispatcher.ArgPack(["tensordesc<fp16[64]>"])


@pytest.mark.parametrize("execution", ["fused", "decoupled"])
def test_static_plan_packs_pointers_and_scalars(built, execution):
    d, _ = built
    disp = dispatcher.Dispatcher(verified_cache(d), FakeDriver())
    disp.stream_fn = lambda device_index: (lambda: 1234)
    B, T, H, K, V = 1, 96, 2, 32, 48
    p = plan("simple_gla", B=B, T=T, H=H, K=K, V=V, dtype=torch.float32, device="cpu",
             backend="static", dispatcher=disp, execution=execution, output_final_state=True,
             scale=0.5)
    desc = p.describe()
    assert all(x["path"].startswith("cubin ") for x in desc["launches"]), desc["launches"]
    q, k, v = (torch.randn(B, T, H, n) for n in (K, K, V))
    g = -torch.rand(B, T, H)
    o, ht = p.run(q, k, v, g)
    man = json.loads((d / "manifest.json").read_text())["kernels"]
    drv = disp.driver
    assert len(drv.launches) == len(desc["launches"])
    ws = p.finish_exec.workspaces
    ptr = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "g": g.data_ptr(),
           "o": o.data_ptr(), "ht": ht.data_ptr(), **{n: t.data_ptr() for n, t in ws.items()}}
    assert [b.kernel for b in p.finish_exec.bound] == [
        ln.kernel for ln in p.finish_exec.program.launches]
    for ln, bound, (fn, grid, block_x, shared, stream, arr) in zip(
            p.finish_exec.program.launches, p.finish_exec.bound, drv.launches):
        e = man[ln.spec(p.finish_exec.program.buffers).key]
        assert fn.startswith(f"fn:{e['name']}") and stream == 1234
        assert grid == ln.grid and block_x == 32 * e["num_warps"] and shared == e["shared"]
        got = bound.pack.unpack()
        want = [ptr[val] if kind == "buf" else val for _, kind, val in ln.args] + [0, 0]
        assert got[:len(want)] == pytest.approx(tuple(want))
        assert arr[0] == ctypes.addressof(bound.pack.buffer)
    # the second call reuses the loaded functions and rewrites only the pointers
    n_loads = len(drv.loads)
    o2, _ = p.run(q, k, v, g)
    assert len(drv.loads) == n_loads and len(drv.launches) == 2 * len(desc["launches"])
    assert p.finish_exec.bound[-1].pack.unpack()[list(
        n for n, _, _ in p.finish_exec.program.launches[-1].args).index("o")] == o2.data_ptr()


def test_static_plan_falls_back_to_jit_for_missing_or_stale(built, tmp_path, monkeypatch):
    from forge_dist.kernels import walker

    # the three-launch program of long inputs (gate sum, summaries, outputs) at a small T
    monkeypatch.setattr(walker, "SUM_GATES_IN_WALK_MAX_TOKENS", 0)
    d = _copy(built[0], tmp_path, "partial")
    man = json.loads((d / "manifest.json").read_text())
    prog = kernels.forward_program("simple_gla", B=1, T=96, H=2, K=32, V=48,
                                   dtype=torch.float32, gated=True, has_h0=False,
                                   execution="decoupled")
    keys = [s.key for s in prog.specs()][1:]  # [0]: the gates' chunk sums, left valid
    del man["kernels"][keys[0]]                      # segment summaries (walk): missing
    man["kernels"][keys[1]]["source_hash"] = "0" * 64  # segment outputs (walk): stale source
    (d / "manifest.json").write_text(json.dumps(man))
    disp = dispatcher.Dispatcher(verified_cache(d), FakeDriver())
    disp.stream_fn = lambda device_index: (lambda: 0)
    p = plan("simple_gla", B=1, T=96, H=2, K=32, V=48, dtype=torch.float32, device="cpu",
             backend="static", dispatcher=disp, execution="decoupled")
    paths = [x["path"] for x in p.describe()["launches"]]
    assert keys[1] != keys[0]  # the outputs walk is another spec of the same kernel
    assert paths[0].startswith("cubin ")
    assert paths[1:] == ["jit (not in the cache)", "jit (source of walk changed)"]
    assert any("fall back to the JIT" in n for n in p.notes)
    # an untouched copy of the cache serves every launch from cubins
    p2 = plan("simple_gla", B=1, T=96, H=2, K=32, V=48, dtype=torch.float32, device="cpu",
              backend="static", execution="decoupled",
              dispatcher=dispatcher.Dispatcher(verified_cache(built[0]), FakeDriver()))
    assert all(x["path"].startswith("cubin ") for x in p2.describe()["launches"])


def test_static_alignment_check(built):
    disp = dispatcher.Dispatcher(verified_cache(built[0]), FakeDriver())
    disp.stream_fn = lambda device_index: (lambda: 0)
    p = plan("hgrn", B=1, T=64, D=40, dtype=torch.float32, device="cpu", backend="static",
             dispatcher=disp)
    x = torch.randn(1 * 64 * 40 + 1)[1:].view(1, 64, 40)  # 4-byte offset: misaligned
    with pytest.raises(Exception, match="not 16-byte aligned"):
        p.run(x, torch.randn(1, 64, 40))


def test_driver_selection(monkeypatch):
    monkeypatch.setattr(dispatcher, "_DRIVER", None)
    monkeypatch.setenv("FORGE_DIST_CUDA_DRIVER", "opencl")
    with pytest.raises(ValueError, match="FORGE_DIST_CUDA_DRIVER"):
        dispatcher.driver()


def test_dispatchers_of_one_driver_share_its_loaded_modules(built):
    """Each plan makes its own dispatcher; those of one driver load a cubin once (not once
    per plan, nor again when a CUDA graph capture makes a plan after a warm-up did), and
    another driver (another context) loads its own."""
    drv = FakeDriver()

    def static_plan(driver_):
        disp = dispatcher.Dispatcher(verified_cache(built[0]), driver_)
        disp.stream_fn = lambda device_index: (lambda: 0)
        return plan("simple_gla", B=1, T=96, H=2, K=32, V=48, dtype=torch.float32,
                    device="cpu", backend="static", dispatcher=disp, execution="decoupled")
    first = static_plan(drv)
    n_loads = len(drv.loads)
    assert n_loads >= 2
    second = static_plan(drv)
    assert len(drv.loads) == n_loads
    assert [b.fn for b in first.finish_exec.bound] == [b.fn for b in second.finish_exec.bound]
    other = FakeDriver()
    static_plan(other)
    assert len(other.loads) == n_loads
