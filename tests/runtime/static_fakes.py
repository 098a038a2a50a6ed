"""Shared pieces of the static-dispatcher tests on the CPU machine: the small kernel config
the session compiles for sm_90, a recording fake driver, and a cache whose verification ran
with the interpreter off (see runtime/aot.py)."""
import ctypes

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


def verified_cache(d):
    """A CubinCache whose source-hash check ran in a child (interpreter on here)."""
    cache = aot.CubinCache(d, TARGET)
    v = aot.verify(d, TARGET)
    cache._checked = {k: None for k in v["valid"]}
    cache._checked.update(v["stale"])
    return cache
