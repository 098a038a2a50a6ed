"""The README's code blocks run, so that they cannot rot.

Every fenced block whose info string is exactly ``python`` is executed on the CPU, each in a
fresh namespace (a reader copies one block at a time); an exception fails the test, and so
does a floating-point tensor it leaves with a NaN or Inf.  A block
whose info string adds a word (```` ```python torchrun ````, ```` ```python gpu ````) needs
a launcher or GPUs: it is only compiled.  ``bash`` blocks are checked against ``.ci/run``:
the README's install-and-run commands are the ones CI runs.
"""
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.S | re.M)


def blocks(language):
    """``(line, extra words, source)`` of every fenced block of ``language``."""
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        words = m.group("info").split()
        if words and words[0] == language:
            out.append((text.count("\n", 0, m.start()) + 1, tuple(words[1:]), m.group("body")))
    return out


PYTHON = blocks("python")


def test_readme_has_runnable_python_blocks():
    assert sum(not extra for _, extra, _ in PYTHON) >= 3


@pytest.mark.parametrize("line,extra,source", PYTHON, ids=[f"line{b[0]}" for b in PYTHON])
def test_python_block(line, extra, source, capsys):
    code = compile(source, f"README.md:{line}", "exec")
    if extra:  # needs torchrun or GPUs: compiled above, not run
        assert set(extra) <= {"torchrun", "gpu"}, f"unknown fence words {extra} at line {line}"
        return
    namespace = {"__name__": f"readme_line{line}"}
    exec(code, namespace)
    # a block that runs but computes NaN or Inf (the delta rule with raw keys did) fails too
    bad = [name for name, value in namespace.items()
           if torch.is_tensor(value) and value.is_floating_point()
           and not torch.isfinite(value).all()]
    assert not bad, f"README.md:{line}: non-finite values in {bad}"


def test_install_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    commands = [b.strip() for _, _, b in blocks("bash")[:2]]
    assert len(commands) == 2
    for command in commands:
        assert command in ci, f"README command not in .ci/run: {command}"
    assert ci.index(commands[0]) < ci.index(commands[1])  # the order CI runs them in
