"""One results schema for every benchmark (docs/design.md section 10), shared by writers and plots.

A results file is ``scaling_benchmarks/results/<benchmark>_<device>_<date>.json``::

    {"benchmark", "device", "world_size", "torch", "triton", "commit", "date",
     "switches": {FORGE_DIST_*: value}, "config": {...},
     "rows": [{"op", "T", "pass", "impl", "ms", ...}, ...]}
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    env = os.environ.get("FORGE_DIST_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    """The CUDA device's name, or ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def switches() -> Dict[str, str]:
    """The ``FORGE_DIST_*`` environment switches set for this run (tile overrides, schedules,
    timeouts), as they were written; ``FORGE_DIST_COMMIT`` is the header's ``commit``."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("FORGE_DIST_") and k != "FORGE_DIST_COMMIT"}


def header(benchmark: str, config: Dict[str, Any], world_size: int = 1) -> Dict[str, Any]:
    """The common fields of a results file (versions, device, commit, date, the
    ``FORGE_DIST_*`` switches of the run)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"benchmark": benchmark, "device": device_name(), "world_size": world_size,
            "torch": torch.__version__, "triton": triton_version, "commit": _commit(),
            "date": datetime.date.today().isoformat(), "switches": switches(),
            "config": config, "rows": []}


def results_path(result: Dict[str, Any], out_dir: Optional[Path] = None) -> Path:
    """``<out_dir>/<benchmark>_<device>_<date>[_<tag>].json`` with a file-system-safe device
    name (``result["tag"]``, when set, keeps several runs of one day apart)."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", result["device"]).strip("-") or "unknown"
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    tag = re.sub(r"[^A-Za-z0-9._-]+", "-", str(result.get("tag") or "")).strip("-")
    return out_dir / f"{result['benchmark']}_{device}_{result['date']}{'_' + tag if tag else ''}.json"


def write(result: Dict[str, Any], out_dir: Optional[Path] = None) -> Path:
    """Write ``result`` as JSON; returns the path (the PNG goes beside it, same stem)."""
    path = results_path(result, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return path


def load(path) -> Dict[str, Any]:
    """Read a results file, checking the fields every reader relies on."""
    data = json.loads(Path(path).read_text())
    missing = [k for k in ("benchmark", "device", "rows", "config") if k not in data]
    if missing:
        raise ValueError(f"{path}: not a results file, missing {missing}")
    return data


def rows_where(result: Dict[str, Any], **match) -> List[Dict[str, Any]]:
    """Rows whose fields equal every ``match`` item."""
    return [r for r in result["rows"] if all(r.get(k) == v for k, v in match.items())]
