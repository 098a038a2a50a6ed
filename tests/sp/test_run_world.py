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
