"""The spawned-world helper (tests/sp/distributed.py): a rendezvous port taken between
``free_port`` and rank 0's bind (another process may take it in that window) starts the world
again on a new port instead of failing the test."""
import socket

from . import distributed


def _rank_and_size(group):
    import torch.distributed as dist

    return [dist.get_rank(group), dist.get_world_size(group)]


def test_a_taken_rendezvous_port_is_retried(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = []
        real = distributed.free_port

        def first_a_taken_one():
            ports.append(taken if not ports else real())
            return ports[-1]
        monkeypatch.setattr(distributed, "free_port", first_a_taken_one)
        assert distributed.run_world(2, _rank_and_size) == [0, 2]
    assert len(ports) == 2 and ports[0] == taken


# set by each rank (the rendezvous) / by readline in the pytest process outside os.environ,
# which a spawned rank inherits with the process's C environment
_NOT_COMPARED = ("MASTER_ADDR", "MASTER_PORT", "COLUMNS", "LINES")


def _environment(group):
    import os

    import torch.distributed as dist

    return [dist.get_rank(group), {k: v for k, v in os.environ.items()
                                   if k not in _NOT_COMPARED}]


def test_ranks_get_the_environment_of_the_call(monkeypatch):
    """The ranks (started from the fork server, which imported torch and the library once:
    tests/_spawn.py) see the parent's environment as it is at the call, with the world's
    additions, not the one the server started with; a world whose Triton mode differs from
    the server's starts its ranks by spawn, with the same result."""
    import os

    # the server starts with the first world (if no earlier test started it), holding a
    # variable that is then unset and without one that is then set
    monkeypatch.setenv("FORGE_DIST_TEST_UNSET", "at the start")
    assert distributed.run_world(2, _environment)[1]["FORGE_DIST_TEST_UNSET"] == "at the start"
    monkeypatch.setenv("FORGE_DIST_TEST_SET_LATER", "yes")  # after the server started
    monkeypatch.delenv("FORGE_DIST_TEST_UNSET")
    here = {k: v for k, v in os.environ.items() if k not in _NOT_COMPARED}
    assert distributed.run_world(2, _environment, env={"FORGE_DIST_TEST_WORLD": "1"}) == \
        [0, dict(here, FORGE_DIST_TEST_WORLD="1")]
    assert "FORGE_DIST_TEST_WORLD" not in os.environ  # the parent's is restored
    other = "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"
    assert distributed.run_world(2, _environment, env={"TRITON_INTERPRET": other}) == \
        [0, dict(here, TRITON_INTERPRET=other)]
