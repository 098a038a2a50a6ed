"""The tests' faster Triton interpreter (tests/_interpreter.py) in a subprocess that a test
starts, and in the ranks that it spawns (they inherit the environment): a test puts this
folder on the subprocess's ``PYTHONPATH`` (``tests/_spawn.py``'s :func:`subprocess_env`),
and Python's ``site`` imports this module at startup.  It installs the interpreter only
under ``TRITON_INTERPRET=1`` (as the ``tests`` package does) and loads the module by its
path, so the subprocess's ``sys.path`` and imports are otherwise untouched.  The values are
Triton's own, bitwise (tests/kernels/test_interpreter.py); only the time differs."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    import importlib.util

    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "_interpreter.py")
    _spec = importlib.util.spec_from_file_location("_forge_dist_tests_interpreter", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install()
