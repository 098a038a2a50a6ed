"""``forge-dist compile``: build the AOT cubin cache for the static dims of a config.

Usage::

    forge-dist compile --config configs/aot_example.toml [--cache-dir DIR] [--target cuda:90]
                       [--set key=value ...] [--force] [--list]

Runs on any machine with the triton wheel (its bundled ptxas); no GPU needed.  Prints one
line per compiled kernel and a summary; exits 1 if a kernel fails to compile.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .. import config as cfgmod
from . import aot


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code."""
    p = argparse.ArgumentParser(
        prog="forge-dist compile",
        description="Build the AOT cubin cache for the static dims of a config (no GPU needed: "
                    "the triton wheel's bundled ptxas compiles for the target).")
    cfgmod.add_arguments(p)
    p.add_argument("--cache-dir", default=None,
                   help="cache directory (default: $FORGE_DIST_AOT_CACHE or "
                        "~/.cache/forge_dist/aot)")
    p.add_argument("--target", default=None, help="e.g. cuda:90 (default: the config's)")
    p.add_argument("--force", action="store_true", help="recompile valid entries too")
    p.add_argument("--list", action="store_true", help="list the kernel specs, compile nothing")
    args = p.parse_args(argv)
    try:
        cfg = cfgmod.load(aot.DEFAULTS, args.config, args.overrides)
        target = args.target or cfg["target"]
        aot.parse_target(target)
    except (cfgmod.ConfigError, ValueError) as err:
        p.error(str(err))
    specs = aot.enumerate_specs(cfg)
    if args.list:
        for s in specs:
            print(s.key, json.dumps(s.to_json(), sort_keys=True))
        print(f"{len(specs)} kernel specs")
        return 0
    if aot.ptxas_version(target) is None:
        print(f"forge-dist compile: no ptxas for {target} in this Triton install",
              file=sys.stderr)
        return 1
    cache_dir = args.cache_dir or aot.default_cache_dir()
    try:
        rep = aot.compile_all(cfg, target=target, cache_dir=cache_dir, progress=True,
                              force=args.force)
    except Exception as err:  # noqa: BLE001 - report any compiler failure as exit 1
        print(f"forge-dist compile: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"{rep['specs']} kernels for {aot.target_name(target)} in {rep['cache_dir']}: "
          f"{len(rep['compiled'])} compiled, {len(rep['reused'])} reused, "
          f"{len(rep['stale'])} stale rebuilt ({rep['seconds']}s)")
    for key, why in rep["stale"].items():
        print(f"  rebuilt {key}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
