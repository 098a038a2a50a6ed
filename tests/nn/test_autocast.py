"""bf16 autocast on the CPU runs the model and stays within bf16 noise of fp32."""
import torch

from forge_dist.nn import ForgeLM, LMConfig


def test_bf16_autocast_matches_fp32_within_bf16_noise():
    torch.manual_seed(0)
    model = ForgeLM(LMConfig(vocab_size=64, hidden_size=32, num_layers=4,
                             mixer="gdn,gla,mamba2,hgrn", num_heads=2))
    ids = torch.randint(0, 64, (2, 40))
    ref = model(ids, ids).loss
    ref.backward()
    g_ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids)
    out.loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert out.logits.dtype == torch.bfloat16
    assert abs(out.loss.item() - ref.item()) / ref.item() <= 5e-3
    assert ((g - g_ref).norm() / g_ref.norm()).item() <= 3e-2
