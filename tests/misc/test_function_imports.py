"""Imports inside functions stay only where there is a reason (issue "architecture", item 4).

Every ``import`` inside a function of ``forge_dist/`` carries a short reason comment on its
line or on the line before: ``# optional: ...`` (an optional dependency such as Triton,
mpi4py or cuda-python, or a private torch module that may be missing) or ``# lazy: ...``
(an import cycle, a file loaded by path, or an import cost kept out of ``import
forge_dist.ops``, see test_import_cost.py).  Anything else belongs at the top of its module."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "forge_dist"
REASON = re.compile(r"#.*\b(optional|lazy):")


def unexplained(source: str, filename: str = "<source>") -> list:
    """``(line, text)`` of every import inside a function with no reason comment."""
    lines = source.splitlines()
    bad = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                first, last = child.lineno, child.end_lineno or child.lineno
                near = lines[max(first - 2, 0):last]  # the line before and the statement's
                if not any(REASON.search(text) for text in near):
                    bad.append((first, lines[first - 1].strip()))
            visit(child, in_function or isinstance(child, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef)))

    visit(ast.parse(source, filename), False)
    return bad


def test_every_import_inside_a_function_says_why():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        found += [f"{rel}:{line}: {text}" for line, text in unexplained(path.read_text(),
                                                                         str(path))]
    assert not found, ("imports inside functions without a '# optional: ...' or "
                       "'# lazy: ...' reason (move them to the module top, or say why "
                       "they cannot move):\n" + "\n".join(found))


def test_the_check_finds_an_unexplained_import():
    """The check is not vacuous: it reports an uncommented import in a function (also a
    method's and a nested function's) and accepts one with a reason on either line."""
    source = ("import os\n"
              "def f():\n"
              "    import json\n"
              "    import tqdm  # optional: the progress bar\n"
              "    # lazy: a cycle\n"
              "    from . import sibling\n"
              "class C:\n"
              "    def m(self):\n"
              "        def inner():\n"
              "            from . import (a,\n"
              "                           b)\n")
    assert unexplained(source) == [(3, "import json"), (10, "from . import (a,")]
