"""Which node each rank runs on (:mod:`forge_dist.sp.layout`): the launchers' variables and
the runs of consecutive ranks.  (The layout read from a real two-node torchrun launch:
tests/sp/test_hier.py.)"""
import pytest

from forge_dist.sp import layout


def test_runs_group_consecutive_ranks_of_one_node():
    assert layout.runs([0, 0, 1, 1, 1, 2]) == [[0, 1], [2, 3, 4], [5]]
    # a node that comes back later is a run of its own (the layout never changes a result)
    assert layout.runs([0, 1, 0]) == [[0], [1], [2]]


def test_node_of_this_process_reads_the_launchers():
    assert layout.node_of_this_process({}) == 0
    assert layout.node_of_this_process({"RANK": "5", "LOCAL_WORLD_SIZE": "2"}) == 2
    assert layout.node_of_this_process({"GROUP_RANK": "3", "RANK": "5",
                                      "LOCAL_WORLD_SIZE": "2"}) == 3
    assert layout.node_of_this_process({"SLURM_NODEID": "1"}) == 1
    assert layout.node_of_this_process({"FORGE_DIST_NODE": "4", "GROUP_RANK": "3"}) == 4
    assert layout.node_of_this_process({"FORGE_DIST_RANKS_PER_NODE": "2", "RANK": "5",
                                      "GROUP_RANK": "0"}) == 2
    with pytest.raises(ValueError, match=r"FORGE_DIST_NODE: expected a whole number, got 'a'"):
        layout.node_of_this_process({"FORGE_DIST_NODE": "a"})
    with pytest.raises(ValueError, match=r"FORGE_DIST_RANKS_PER_NODE: expected a count >= 1 "
                                         r"with RANK set, got '0'"):
        layout.node_of_this_process({"FORGE_DIST_RANKS_PER_NODE": "0", "RANK": "1"})
