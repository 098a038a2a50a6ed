"""The import contract of pyproject.toml ([tool.importlinter]): the package's folders are
layered, so no import circle runs between them.  Runs ``lint-imports`` on this checkout."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not os.access(exe, os.X_OK):
        pytest.skip("the lint-imports executable (pip install import-linter, the test "
                    "extra) is not installed")
    return exe


def _run(config: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([_lint_imports(), "--no-cache", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_folders_keep_their_layers():
    res = _run(ROOT / "pyproject.toml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_contract_catches_an_upward_import(tmp_path):
    """The same tool on a contract the package breaks (variants above ops: ops imports
    variants) reports it, so the check above is not vacuous."""
    cfg = tmp_path / "inverted.toml"
    cfg.write_text('[tool.importlinter]\nroot_package = "forge_dist"\n\n'
                   '[[tool.importlinter.contracts]]\nname = "inverted"\ntype = "layers"\n'
                   'layers = ["forge_dist.variants", "forge_dist.ops"]\n')
    res = _run(cfg)
    assert res.returncode != 0 and "BROKEN" in res.stdout.upper(), res.stdout + res.stderr
    assert "forge_dist.ops" in res.stdout
