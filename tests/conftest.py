"""Markers: ``gpu`` needs CUDA, ``multigpu`` two or more GPUs; both skip cleanly without.

Without a GPU, Triton kernels run in its interpreter: the variable must be set before
Triton is first imported, which conftest.py is early enough for.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ._interpreter import install_if_interpreting  # noqa: E402

install_if_interpreting()  # a faster interpreter for the tests (see the module)


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


def pytest_runtest_logreport(report):
    """``FORGE_DIST_TEST_INSTAFAIL=1`` (the device batches set it): a failure's traceback is
    printed when it happens, not in the summary, which a step killed at its time limit never
    reaches (2026-11-27: a GPU test's failure was lost twice that way)."""
    if report.failed and os.environ.get("FORGE_DIST_TEST_INSTAFAIL") == "1":
        print(f"\n==== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n",
              flush=True)
