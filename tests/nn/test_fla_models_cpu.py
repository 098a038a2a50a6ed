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

from .helpers import fla_cache_states, fla_model_configs, rel_err

HIDDEN, VOCAB, T, B = 128, 100, 48, 2


def _configs():
    return fla_model_configs(HIDDEN, VOCAB, small=True)


@pytest.fixture
def first_config(monkeypatch):
    """FLA's autotuned kernels take their first configuration (no timing on a CPU)."""
    if torch.cuda.is_available():
        pytest.skip("the GPU runs test_fla_models_gpu.py")
    autotuner = pytest.importorskip("triton.runtime.autotuner")

    def run(self, *args, **kwargs):
        self.best_config = self.configs[0]
        bound = dict(zip(self.arg_names, args))
        extra = {k: v for k, v in {**kwargs, **self.best_config.all_kwargs()}.items()
                 if k not in bound}
        return self.fn.run(*args, **extra)

    monkeypatch.setattr(autotuner.Autotuner, "run", run)


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
