"""Shared pieces of the static-dispatcher tests on the CPU machine: the small kernel config
the session compiles for sm_90, a recording fake driver, and a cache whose verification ran
with the interpreter off (see runtime/aot.py)."""
import ctypes
import os
import sys
from pathlib import Path

from forge_dist.runtime import aot

TARGET = "cuda:90"

# a small but real config: scalar decay fused + decoupled, gla, delta, hgrn, SP summaries
SMALL = dict(variants=["simple_gla", "hgrn"], heads=[2], head_dims=[[32, 48]],
             hgrn_dims=[40], dtypes=["float32"], execution=["fused", "decoupled"],
             initial_state=[False, True], sequence_parallel=True)


class FakeDriver:
    """Records loads and launches; reads the packed parameters at launch time.

    ``launches`` holds ``(fn, grid, block_x, shared, stream, params array)``; with
    ``packs`` (fn -> ArgPack) set, ``values`` holds each launch's unpacked parameters as
    they were when it was issued.
    """

    name = "fake"

    def __init__(self):
        self.loads, self.launches, self.values = [], [], []
        self.packs = {}

    def load(self, image, name, shared, device):
        assert image[:4] == b"\x7fELF"
        self.loads.append((name, shared, device))
        return object(), f"fn:{name}:{len(self.loads)}"

    def launch(self, fn, grid, block_x, shared, stream, params):
        arr = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        self.launches.append((fn, grid, block_x, shared, stream, arr))
        if fn in self.packs:
            self.values.append((fn, self.packs[fn].unpack()))


_VERIFIED = {}  # what verified_cache's check found, by what it depends on (_verify_key)


def _verify_key(d):
    """What ``aot.verify(d, TARGET)`` depends on: the directory's files (each one's path,
    size and modification time; the manifest's text), and the child's environment and
    ``sys.path`` (which sources it hashes); the kernels' sources do not change in a run."""
    d = Path(d)
    files = tuple(sorted((str(f.relative_to(d)), f.stat().st_size, f.stat().st_mtime_ns)
                         for f in d.rglob("*") if f.is_file()))
    manifest = d / "manifest.json"
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k != "PYTEST_CURRENT_TEST"))  # (pytest's, per test)
    return (str(d.resolve()), files, manifest.read_text() if manifest.exists() else None, env,
            tuple(sys.path))


def verified_cache(d):
    """A CubinCache whose source-hash check ran in a child (interpreter on here).  The
    child's check of a directory is done once per state of what it depends on
    (:func:`_verify_key`: the tests' dispatchers mostly share the session's one cache,
    which they do not change), not once per call: ~3 s of the child's imports each."""
    cache = aot.CubinCache(d, TARGET)
    key = _verify_key(d)
    if key not in _VERIFIED:
        _VERIFIED[key] = aot.verify(d, TARGET)
    v = _VERIFIED[key]
    cache._checked = {k: None for k in v["valid"]}
    cache._checked.update(v["stale"])
    return cache
