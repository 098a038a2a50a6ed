"""Device primitives of forge_dist.comm over the simulated transport (Triton interpreter)."""
import os


import pytest
import torch
import triton
import triton.language as tl

from forge_dist import comm
from forge_dist.comm import channel as chan
from forge_dist.comm import device as dev


@triton.jit
def _ping(buf_ptr, sig_ptr, err_ptr, me, peer, epoch, limit, rank_stride, sig_stride,
          N: tl.constexpr, SEND: tl.constexpr):
    """Rank ``me`` either puts ``epoch * (1..N)`` to ``peer`` with signal ``epoch`` or waits
    for it (bounded) and doubles what it received in place."""
    offs = tl.arange(0, N)
    if SEND:
        vals = (offs + 1).to(tl.float32) * epoch.to(tl.float32)
        dev.put_tile_signal(buf_ptr, buf_ptr, offs, vals, offs < N, N * 4, sig_ptr, epoch,
                            peer, me, rank_stride, sig_stride, 0)
    else:
        got = dev.wait_ge(sig_ptr, epoch, limit, False)
        if got < epoch:
            dev.record_error(err_ptr, dev.ERR_RECV_TIMEOUT, peer, tl.program_id(0), epoch)
        else:
            x = tl.load(buf_ptr + offs)
            tl.store(buf_ptr + offs, 2 * x)


def _launch(buf, sig, err, me, peer, epoch, send):
    N = buf.shape[1]
    _ping[(1,)](buf[me], sig[me], err, me, peer, epoch, 1, N, 1, N=N, SEND=send)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_put_signal_then_wait_sees_data_and_epochs_only_grow():
    P, N = 3, 16
    buf = torch.zeros(P, N)
    sig = torch.zeros(P, 1, dtype=torch.int64)
    err = torch.zeros(4, dtype=torch.int64)
    for epoch in (1, 2, 3):
        _launch(buf, sig, err, 0, 2, epoch, True)   # rank 0 -> rank 2's copy
        _launch(buf, sig, err, 2, 0, epoch, False)
        assert int(err[0]) == 0
        assert torch.equal(buf[2], 2 * epoch * torch.arange(1, N + 1, dtype=torch.float32))
        assert int(sig[2, 0]) == epoch and int(sig[1, 0]) == 0 and int(sig[0, 0]) == 0
    # An epoch nobody sent: the bounded wait gives up and records who/where/which call.
    _launch(buf, sig, err, 2, 0, 4, False)
    assert err.tolist() == [dev.ERR_RECV_TIMEOUT.value, 0, 0, 4]


def test_describe_error_names_rank_peer_tile():
    msg = chan.describe_error([1, 3, 17, 5], 4, "the incoming state", 2.0)
    assert "rank 4" in msg and "rank 3" in msg and "tile 17" in msg and "2s" in msg
    assert "free its receive slot" in chan.describe_error([2, 5, 1, 1], 4, "x", 1.0)
    assert "poisoned" in chan.describe_error([3, 3, 0, 9], 4, "x", 1.0)


def test_environment_defaults_keep_multicast_off():
    for key in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        assert key in os.environ
    assert comm.SIM == 0 and comm.NVSHMEM == 1


def test_nvshmem_constants_are_the_3_4_header_values():
    assert (dev.SIGNAL_SET.value, dev.SIGNAL_ADD.value) == (9, 10)
    assert (dev.CMP_EQ.value, dev.CMP_NE.value, dev.CMP_GT.value, dev.CMP_LE.value,
            dev.CMP_LT.value, dev.CMP_GE.value) == (0, 1, 2, 3, 4, 5)


def test_check_mode_validates(monkeypatch):
    monkeypatch.setenv("FORGE_DIST_FORGE_CHECK", "sometimes")
    with pytest.raises(ValueError, match="FORGE_DIST_FORGE_CHECK"):
        chan.check_mode()
