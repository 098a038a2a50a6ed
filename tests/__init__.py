# Spawned ranks import this package (their functions live in it): they run the interpreter's
# faster scan and helper calls too (tests/_interpreter.py; the pytest process: conftest.py).
from ._interpreter import install_if_interpreting

install_if_interpreting()
