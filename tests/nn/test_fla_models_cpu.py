"""FLA's own models, patched, against the unpatched model on the CPU, in fp32.

FLA's layers run their Triton kernels here through Triton's interpreter (conftest.py sets
``TRITON_INTERPRET=1`` without a GPU).  Its autotuner cannot time configurations on a CPU,
so these tests make it take each kernel's first one; its chunked kernels do not run in the
interpreter, so the prompts stay at 64 tokens or fewer, where FLA's layers take their
recurrent kernels.  fp32 leaves no bf16 noise to hide a difference of form: the GPU test
(``test_fla_models_gpu.py``, bf16, 1024 tokens, 2e-2) would pass a layer that differs
systematically by 1e-3, as GatedDeltaNet's key normalisation did until 64e2bd0.

Needs FLA's model package (``flash-linear-attention``, with ``transformers``); skipped
without it, as in CI, which installs neither.
"""
import copy

import pytest
import torch

from forge_dist import nn as fnn

from .helpers import (fla_cache_states, fla_model_configs, first_config_run, rel_err,
                      sp_prefill_then_decode)

HIDDEN, VOCAB, T, B = 128, 100, 48, 2


def _configs():
    return fla_model_configs(HIDDEN, VOCAB, small=True)


@pytest.fixture
def first_config(monkeypatch):
    """FLA's autotuned kernels take their first configuration."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs test_fla_models_gpu.py")
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(autotuner.Autotuner, "run", first_config_run)


@pytest.mark.parametrize("name", ["gdn", "gla", "gla_conv_gqa", "hgrn_conv", "retnet",
                                  "mamba2", "linear_attn"])
@torch.no_grad()
def test_patched_fla_model_equals_fla_in_fp32(first_config, name):
    """Logits, the returned cache, three teacher-forced decoding steps and greedy tokens."""
    cls, cfg = _configs()[name]
    torch.manual_seed(0)
    ref = cls(cfg).float().eval()
    patched = copy.deepcopy(ref)
    assert len(fnn.patch(patched)) == cfg.num_hidden_layers
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    a, b = ref(input_ids=ids), patched(input_ids=ids)
    assert rel_err(b.logits, a.logits) <= 1e-5, rel_err(b.logits, a.logits)
    sa, sb = fla_cache_states(a.past_key_values), fla_cache_states(b.past_key_values)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].shape == sb[key].shape, key
        assert rel_err(sb[key], sa[key]) <= 1e-5, (key, rel_err(sb[key], sa[key]))
    ca, cb, tok = a.past_key_values, b.past_key_values, a.logits[:, -1:].argmax(-1)
    for _ in range(3):
        la = ref(input_ids=tok, past_key_values=ca).logits
        lb = patched(input_ids=tok, past_key_values=cb).logits
        assert rel_err(lb, la) <= 1e-5, rel_err(lb, la)
        tok = la[:, -1:].argmax(-1)
    kw = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids),
              pad_token_id=0)
    assert torch.equal(ref.generate(ids, **kw), patched.generate(ids, **kw))


def _sp_prefill_then_decode(group, name, steps):
    """On each of 2 gloo ranks: the patched model prefills its half of the prompt with
    sequence parallelism, against FLA's model on the whole prompt; then greedy decoding
    from the gathered cache on every rank, against FLA's model decoding from its own cache
    the same way.  (Not against ``generate``: with transformers 5.24 on the CPU, the logits
    of FLA's GatedDeltaNet ``generate`` differed from its own prefill-then-decode loop by
    0.4-0.5 relative from the second token on, and the patched model matched the loop.)"""
    import torch.distributed as dist
    from triton.runtime import autotuner

    autotuner.Autotuner.run = first_config_run  # this worker's own Triton
    cls, cfg = _configs()[name]
    torch.manual_seed(0)
    ref = cls(cfg).float().eval()
    patched = copy.deepcopy(ref)
    fnn.patch(patched, group=group)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        errs = sp_prefill_then_decode(ref, patched, ids, group, steps)
    errs = torch.tensor(errs, dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    return errs.tolist()


@pytest.mark.parametrize("name", ["gdn", "gla_conv_gqa", "retnet", "mamba2"])
def test_sequence_parallel_prefill_then_decoding_equals_fla(first_config, name):
    """The GPU test's two-rank prefill and decoding, on 2 gloo ranks in fp32."""
    _configs()  # skips here, not in the workers, without FLA's model package
    from tests.sp.distributed import run_world

    logit_err, cache_err, mismatch = run_world(2, _sp_prefill_then_decode, name, 4,
                                               env={"TRITON_INTERPRET": "1"})
    assert logit_err <= 1e-5 and cache_err <= 1e-5, (logit_err, cache_err)
    assert mismatch == 0.0, "greedy tokens after the SP prefill differ from FLA's"
