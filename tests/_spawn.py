"""Start the processes of the tests' local worlds from a fork server that imported PyTorch,
Triton and the library once, instead of a fresh interpreter per rank (``spawn``), which
imports them again: ~3.5 s of a 2-core machine per rank, ~1.6 s of wall time per 2-rank
world and more for 3 to 16 ranks, over the few hundred worlds of the suite.

A rank starts as ``spawn``'s would:

* The server is a clean process: it ran nothing but the imports of ``_PRELOAD``, which every
  rank makes anyway (``tests.sp.distributed``: the library through ``forge_dist.selftest``,
  Triton and the tests' interpreter through the ``tests`` package).
* Those imports read two environment variables (``_IMPORT_ENV``: whether Triton's kernels
  are interpreted, decided when they are decorated; and ``comm/device.py``'s credit mode).
  A world whose environment differs from the server's in either is started by ``spawn``.
* A rank first takes the parent's environment as it is at the start (``os.environ`` of the
  caller, with any per-world additions), then installs the tests' interpreter where that
  environment asks for it, and only then unpickles its function and arguments: every module
  it imports beyond the server's sees the environment it would have seen under ``spawn``.
  (Under ``forkserver`` the server's environment, fixed when it started, would otherwise be
  the ranks'.)  ``sys.path`` and the working directory are the parent's, as ``spawn``'s
  (multiprocessing sends them with every process); Python's ``random`` is reseeded in every
  forked process.
* ``mp.spawn``'s error reporting (``ProcessRaisedException`` with the rank's traceback,
  ``ProcessExitedException``) is unchanged: it comes from
  ``torch.multiprocessing.start_processes``, which both use.

Where CUDA is available (the GPU runs) every world is started by ``spawn``, as before: a
server that imported the library must not be what NCCL ranks fork from.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle

_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "numpy", "tests",
            "tests.sp.distributed"]
_IMPORT_ENV = ("TRITON_INTERPRET", "FORGE_DIST_CREDIT")  # what the preloaded imports read

_server_env = None  # _IMPORT_ENV's values where the server started (None: not started)
_use_server = None


def _imports_env(env) -> dict:
    return {k: env.get(k) for k in _IMPORT_ENV}


def _server_context():
    """The ``forkserver`` context where this world may use it, else ``None`` (``spawn``)."""
    global _server_env, _use_server
    if _use_server is None:
        import torch

        _use_server = not torch.cuda.is_available()
    if not _use_server:
        return None
    ctx = multiprocessing.get_context("forkserver")
    if _server_env is None:  # the server starts with the next process, in this environment
        ctx.set_forkserver_preload(list(_PRELOAD))
        _server_env = _imports_env(os.environ)
    return ctx if _imports_env(os.environ) == _server_env else None


def _prepare(env: dict):
    """In a new process: the caller's environment, then the tests' interpreter (as importing
    the ``tests`` package does when the environment asks for it)."""
    os.environ.clear()
    os.environ.update(env)
    from ._interpreter import install_if_interpreting

    install_if_interpreting()


def _rank_entry(rank, env, payload):
    _prepare(env)
    fn, args = pickle.loads(payload)
    return fn(rank, *args)


def start_processes(fn, args=(), nprocs=1, join=True):
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)``, the processes started by the
    fork server where it may be used (see the module)."""
    import torch.multiprocessing as mp

    if _server_context() is None:
        return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="spawn")
    payload = pickle.dumps((fn, tuple(args)))
    return mp.start_processes(_rank_entry, args=(dict(os.environ), payload), nprocs=nprocs,
                              join=join, start_method="forkserver")


def _process_entry(env, payload):
    _prepare(env)
    target, args = pickle.loads(payload)
    target(*args)


def process(target, args=()):
    """An unstarted ``multiprocessing.Process`` running ``target(*args)``, started by the fork
    server where it may be used, else by ``spawn`` (see the module)."""
    ctx = _server_context()
    if ctx is None:
        return multiprocessing.get_context("spawn").Process(target=target, args=tuple(args))
    payload = pickle.dumps((target, tuple(args)))
    return ctx.Process(target=_process_entry, args=(dict(os.environ), payload))


SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def subprocess_env(env: dict) -> dict:
    """``env`` for a Python subprocess (a benchmark script, its spawned ranks) that should run
    the tests' faster interpreter too: ``tests/_site`` first on its ``PYTHONPATH``, whose
    ``sitecustomize`` installs it where ``TRITON_INTERPRET=1`` (see that module)."""
    path = env.get("PYTHONPATH")
    return dict(env, PYTHONPATH=SITE + (os.pathsep + path if path else ""))
