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
    """Rank ``me`` either puts ``epoch * (1..N)`` (and a trailer carrying the word
    ``1000 + epoch``) to ``peer`` with signal ``epoch``, or waits for it (bounded), checks the
    trailer's word and doubles what it received in place."""
    offs = tl.arange(0, N)
    if SEND:
        vals = (offs + 1).to(tl.float32) * epoch.to(tl.float32)
        dev.put_tile_signal(buf_ptr, buf_ptr, offs, vals, offs < N,
                            dev.trailer_values(1000 + epoch, tl.float32), (N + 4) * 4,
                            sig_ptr, epoch, peer, me, rank_stride, sig_stride, N, 0)
        dev.quiet_put(buf_ptr, buf_ptr, sig_ptr, epoch, peer, me, rank_stride, sig_stride,
                      True, N, 0)
    else:
        got = dev.wait_ge(sig_ptr, epoch, limit, False)
        if got < epoch:
            dev.record_error(err_ptr, dev.ERR_RECV_TIMEOUT, peer, tl.program_id(0), epoch)
        else:
            word = dev.trailer_word(tl.load(buf_ptr + N + tl.arange(0, dev.TRAILER)))
            if word != 1000 + epoch:
                dev.record_error(err_ptr, dev.ERR_SIGNATURE, peer, tl.program_id(0), epoch,
                                 word, 1000 + epoch)
            x = tl.load(buf_ptr + offs)
            tl.store(buf_ptr + offs, 2 * x)


def _launch(buf, sig, err, me, peer, epoch, send):
    N = buf.shape[1] - 4  # the data, then the trailer
    _ping[(1,)](buf[me], sig[me], err, me, peer, epoch, 1, N + 4, 1, N=N, SEND=send)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_put_signal_then_wait_sees_data_and_epochs_only_grow():
    P, N = 3, 16
    buf = torch.zeros(P, N + 4)
    sig = torch.zeros(P, 1, dtype=torch.int64)
    err = torch.zeros(chan.ERR_WORDS, dtype=torch.int64)
    for epoch in (1, 2, 3):
        _launch(buf, sig, err, 0, 2, epoch, True)   # rank 0 -> rank 2's copy
        _launch(buf, sig, err, 2, 0, epoch, False)
        assert int(err[0]) == 0, err  # the trailer's word arrived intact
        assert torch.equal(buf[2, :N], 2 * epoch * torch.arange(1, N + 1, dtype=torch.float32))
        assert int(sig[2, 0]) == epoch and int(sig[1, 0]) == 0 and int(sig[0, 0]) == 0
    # An epoch nobody sent: the bounded wait gives up and records who/where/which call.
    _launch(buf, sig, err, 2, 0, 4, False)
    assert err.tolist() == [dev.ERR_RECV_TIMEOUT.value, 0, 0, 4, 0, 0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_a_trailer_with_another_word_is_recorded():
    P, N = 2, 16
    buf = torch.zeros(P, N + 4)
    sig = torch.zeros(P, 1, dtype=torch.int64)
    err = torch.zeros(chan.ERR_WORDS, dtype=torch.int64)
    _launch(buf, sig, err, 0, 1, 1, True)
    buf[1, N] += 1  # the word's lowest chunk, as another call's signature would differ
    _launch(buf, sig, err, 1, 0, 1, False)
    assert err.tolist() == [dev.ERR_SIGNATURE.value, 0, 0, 1, 1002, 1001]


def test_trailer_chunks_are_exact_for_any_60_bit_word():
    from forge_dist.sp import agreement

    for word in (0, 1, (1 << 60) - 1, 0x0ABCDEF123456789 & ((1 << 60) - 1)):
        t = torch.tensor(agreement.chunks(word) + [0], dtype=torch.float32)
        assert agreement.unchunk(t[:3].to(torch.int64).tolist()) == word


def test_describe_error_names_rank_peer_tile():
    msg = chan.describe_error([1, 3, 17, 5, 0, 0], 4, "the incoming state", 2.0)
    assert "rank 4" in msg and "rank 3" in msg and "tile 17" in msg and "2s" in msg
    assert "free its receive slot" in chan.describe_error([2, 5, 1, 1, 0, 0], 4, "x", 1.0)
    assert "poisoned" in chan.describe_error([3, 3, 0, 9, 0, 0], 4, "x", 1.0)
    msg = chan.describe_error([5, 3, 0, 9, 11, 12], 4, "x", 1.0,
                              explain=lambda peer, theirs, mine: f"{peer}:{theirs}:{mine}")
    assert msg.startswith("rank 4: 3:11:12") and "NaN" in msg, msg


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
