"""A rank of a two-"node" CPU launch (tests/sp/test_hier.py): ``launch/torchrun.sh --nnodes 2``
started twice on one machine with a local c10d rendezvous.  Checks that the layout read from
torchrun's environment is two nodes of ``LOCAL_WORLD_SIZE`` ranks, and that ``hier`` and
``scan`` match the fp64 recurrence there; writes ``<out>/rank<r>.json``."""
import json
import os
import sys

import torch
import torch.distributed as dist

from forge_dist.selftest import run_case, tolerance
from forge_dist.sp import layout


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"env": {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK",
                                                     "LOCAL_WORLD_SIZE", "WORLD_SIZE")},
              "nodes": layout.nodes(dist.group.WORLD), "cases": []}
    for strategy in ("hier", "scan"):
        for op in ("simple_gla", "gated_delta_rule"):
            res = run_case(op, strategy, torch.float64, True, group=dist.group.WORLD,
                           T_local=12).as_dict()
            worst = max(res["errors"].values())
            report["cases"].append({"strategy": strategy, "op": op, "worst": worst,
                                    "ok": worst <= tolerance(torch.float64)})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
