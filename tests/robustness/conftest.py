"""``slow`` tests in this folder run only when asked for: ``pytest -m slow tests/robustness``
(or ``FORGE_DIST_SLOW=1``).  pyproject declares the marker but does not deselect it, so
without this hook ``pytest -q`` would run them."""
import os
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    asked = "slow" in (config.getoption("-m") or "") or os.environ.get("FORGE_DIST_SLOW") == "1"
    if asked:
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow tests/robustness` "
                                   "or FORGE_DIST_SLOW=1")
    for item in items:
        if "slow" in item.keywords and _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
