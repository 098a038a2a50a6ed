"""Integration with the PyTorch stack (issue 6), CPU only: ``torch.compile`` through the
custom ops of :mod:`forge_dist.ops.custom_ops` (world 1 and a 2-rank gloo world), DDP over the
data-parallel dimension of a 2 x 2 mesh with sequence parallelism on the other, and
:func:`forge_dist.nn.patch` on stand-ins of FLA's layer classes."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from forge_dist import nn as fnn
from forge_dist import ops
from forge_dist.nn import patch
from forge_dist.ops import custom_ops as C
from forge_dist.variants import registry
from tests.sp.distributed import run_world

from .helpers import make_layer, rel_err, stand_in, sum_ranks

F64 = torch.float64


def _op_inputs(name, B=2, T=8, H=2, K=4, V=3):
    gen = torch.Generator().manual_seed(3)

    def r(*s, neg=False):
        x = torch.randn(*s, generator=gen, dtype=F64)
        return (-x.abs() * 0.3 if neg else x).requires_grad_()
    if name == "hgrn":
        return (r(B, T, K), r(B, T, K, neg=True)), {}, r(B, K)
    qkv = (r(B, T, H, K), r(B, T, H, K), r(B, T, H, V))
    extra = {"linear_attn": (), "simple_gla": (r(B, T, H, neg=True),),
             "gla": (r(B, T, H, K, neg=True),),
             "gated_delta_rule": (r(B, T, H, neg=True), torch.rand(B, T, H, generator=gen,
                                                                   dtype=F64).requires_grad_())}
    kw = {"use_qk_l2norm_in_kernel": True} if name == "gated_delta_rule" else {}
    return qkv + extra[name], kw, r(B, H, K, V)


@pytest.mark.parametrize("name", registry.names())
def test_custom_op_matches_eager_and_compiles_fullgraph(name):
    args, kw, init = _op_inputs(name)
    kw.update(initial_state=init, output_final_state=True)
    leaves = list(args) + [init]

    def loss_grads(fn):
        o, f = fn(*args, **kw)
        return [o, f] + list(torch.autograd.grad(o.pow(2).sum() + f.pow(2).sum(), leaves))
    ref = loss_grads(getattr(ops, name))
    torch._dynamo.reset()
    for fn in (getattr(C, name), torch.compile(getattr(C, name), fullgraph=True,
                                               backend="aot_eager")):
        got = loss_grads(fn)
        for a, b in zip(got, ref):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel_err(a, b) < 1e-13


def test_custom_op_wrappers_take_the_public_signature():
    """The wrappers are built from the public ops' signatures: same parameters, and a
    wrong call is refused naming what is wrong (not passed on to the schema)."""
    import inspect
    for name in registry.names():
        assert inspect.signature(getattr(C, name)) == inspect.signature(getattr(ops, name))
    q, k, v = (torch.randn(1, 4, 1, 2, dtype=F64) for _ in range(3))
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['sacle'\\]"):
        C.linear_attn(q, k, v, sacle=0.5)
    with pytest.raises(TypeError, match=r"multiple values for arguments \['q'\]"):
        C.linear_attn(q, k, v, q=k)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        C.linear_attn(q, k, v, q)
    with pytest.raises(TypeError, match=r"missing required arguments \['v'\]"):
        C.linear_attn(q, k)
    o, final = C.linear_attn(q, k, v=v, scale=0.5)
    assert final is None and rel_err(o, ops.linear_attn(q, k, v, scale=0.5)[0]) < 1e-14


def test_custom_op_fake_shapes_with_cu_seqlens():
    """The shape functions agree with the real op for packed input (final rows = N)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (torch.randn(1, 10, 2, 4, dtype=F64) for _ in range(3))
    cu = torch.tensor([0, 3, 7, 10])
    real = torch.ops.forge_dist.linear_attn(q, k, v, None, cu, None, True, None, "auto")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.forge_dist.linear_attn(*(mode.from_tensor(t) for t in (q, k, v)),
                                                None, mode.from_tensor(cu), None, True, None,
                                                "auto")
    for a, b in zip(real, fake):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    assert real[1].shape == (3, 2, 4, 4)


def _compile_layer(layer, x, backend, **kw):
    """(graph breaks, output, [dx] + parameter grads) of ``layer`` compiled with the custom
    ops."""
    torch._dynamo.reset()
    layer.use_custom_ops = True
    try:
        breaks = torch._dynamo.explain(layer)(x, **kw).graph_break_count
        torch._dynamo.reset()
        out = torch.compile(layer, backend=backend)(x, **kw)[0]
        out.pow(2).sum().backward()
    finally:
        layer.use_custom_ops = None
    return breaks, out


def _grads(layer, x):
    g = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("name,backend", [("gdn", "inductor"), ("linear_attn", "aot_eager"),
                                          ("retnet", "aot_eager"), ("simple_gla", "aot_eager"),
                                          ("gla", "aot_eager"), ("hgrn", "aot_eager")])
def test_layer_compiles_without_graph_breaks_world1(name, backend):
    layer = make_layer(name, F64)
    x = torch.randn(2, 12, 16, dtype=F64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    ref = layer(x)[0]
    ref.pow(2).sum().backward()
    g_ref = _grads(layer, x)
    breaks, out = _compile_layer(layer, x, backend)
    assert breaks == 0
    assert rel_err(out, ref) < 1e-12
    for a, b in zip(_grads(layer, x), g_ref):
        assert rel_err(a, b) < 1e-12


def test_enable_flag_routes_layers_to_custom_ops():
    layer = make_layer("gla", F64)
    x = torch.randn(1, 6, 16, dtype=F64)
    with C.use(True):
        gm, _ = torch._dynamo.export(layer)(x)  # the recurrence is one node of the graph
    assert any("forge_dist.gla" in str(n.target) for n in gm.graph.nodes)
    torch._dynamo.reset()
    gm, _ = torch._dynamo.export(layer)(x)  # eager op: traced through, no custom-op node
    assert not any("forge_dist" in str(n.target) for n in gm.graph.nodes)


def _compile_sp2(group):
    """No-conv layers (the halo exchange is a Python autograd.Function with p2p, which dynamo
    does not trace) at SP = 2 with packed documents straddling the boundary."""
    rank = dist.get_rank(group)
    cu = torch.tensor([0, 5, 11, 16])
    builders = {
        "gdn": lambda: fnn.GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2,
                                         use_short_conv=False, group=group),
        "hgrn": lambda: fnn.HGRNAttention(hidden_size=16, group=group),
        "gla": lambda: fnn.GatedLinearAttention(hidden_size=16, num_heads=2,
                                                gate_low_rank_dim=4, group=group),
        "simple_gla": lambda: fnn.SimpleGatedLinearAttention(
            hidden_size=16, num_heads=2, use_short_conv=False, group=group),
        "linear_attn": lambda: fnn.LinearAttention(hidden_size=16, num_heads=2, group=group),
    }
    out = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        layer = build().double()
        xg = torch.randn(1, 16, 16, dtype=F64, generator=torch.Generator().manual_seed(2))
        x = xg[:, 8 * rank:8 * rank + 8].clone().requires_grad_()
        ref = layer(x, cu_seqlens=cu)[0]
        ref.pow(2).sum().backward()
        g_ref = _grads(layer, x)
        breaks, o = _compile_layer(layer, x, "aot_eager", cu_seqlens=cu)
        errs = [rel_err(o, ref)] + [rel_err(a, b) for a, b in zip(_grads(layer, x), g_ref)]
        worst = sum_ranks(torch.tensor([max(errs), float(breaks)]), group)
        out[name] = worst.tolist()
    return out


def test_layers_compile_at_sp2_match_eager():
    res = run_world(2, _compile_sp2)
    for name, (err, breaks) in res.items():
        assert breaks == 0, name
        assert err < 1e-12, (name, err)


# ------------------------------------------------------------------------------- patch
class _Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn_norm = nn.LayerNorm(16)
        self.attn = attn


def _fla_model(seed=0):
    names = {"gdn": "GatedDeltaNet", "gla": "GatedLinearAttention", "hgrn": "HGRNAttention",
             "retnet": "MultiScaleRetention", "linear_attn": "LinearAttention"}
    blocks = []
    for i, (key, cls_name) in enumerate(names.items()):
        ours = make_layer(key, torch.float32, seed=seed + i)
        blocks.append(_Block(stand_in(cls_name, ours)))
    model = nn.Module()
    model.layers = nn.ModuleList(blocks)
    return model, list(names.values())


def test_patch_replaces_fla_layers_and_keeps_outputs():
    model, cls_names = _fla_model()
    x = torch.randn(2, 12, 16)
    before = [blk.attn(x)[0] for blk in model.layers]
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for blk, cls_name in zip(model.layers, cls_names):
        assert type(blk.attn).__name__ == cls_name
        assert not isinstance(blk.attn, fnn.layers.SPMixin)
    replaced = patch(model, strategy="serial")
    assert replaced == [f"layers.{i}.attn" for i in range(len(cls_names))]
    for blk, cls_name, ref in zip(model.layers, cls_names, before):
        assert isinstance(blk.attn, getattr(fnn, cls_name))
        assert blk.attn.strategy == "serial" and blk.attn.group is None
        assert rel_err(blk.attn(x)[0], ref) < 1e-6
    after = model.state_dict()
    assert after.keys() == sd.keys() and all(torch.equal(after[k], sd[k]) for k in sd)
    assert patch(model) == []  # already ours


def test_patch_is_strict_and_atomic():
    model, _ = _fla_model()
    bad = model.layers[3].attn
    bad.extra = nn.Parameter(torch.zeros(3))  # a key our layer does not have
    first = model.layers[0].attn
    with pytest.raises(RuntimeError, match=r"(?s)layers\.3\.attn .*extra"):
        patch(model)
    assert model.layers[0].attn is first  # nothing replaced


# --------------------------------------------------------------- DDP / FSDP2 x SP (2 x 2 mesh)
def _sum_hook(group, bucket):
    """DDP comm hook: all-reduce SUM over the dp group (DDP's default divides by its size)."""
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def _dp_sp(world):
    """Gradients of ForgeLM on a ("dp", "sp") = 2 x 2 mesh against one process.

    ForgeLM's loss is the mean over every labelled token of the whole mesh
    (``loss_group=WORLD``), so its gradient is the *sum* of the ranks' gradients: DDP /
    FSDP2 must sum over dp (not average), and the sp ranks' gradients are summed too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp, sp = mesh.get_group("dp"), mesh.get_group("sp")
    b = slice(2 * mesh.get_local_rank("dp"), 2 * mesh.get_local_rank("dp") + 2)
    t = slice(8 * mesh.get_local_rank("sp"), 8 * mesh.get_local_rank("sp") + 8)
    cfg = fnn.LMConfig(vocab_size=32, hidden_size=16, num_layers=2, mixer="gdn,gla",
                       num_heads=2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (4, 16), generator=gen)  # global batch 2 (dp) x 2, T = 2 x 8
    labels = torch.randint(0, 32, (4, 16), generator=gen)

    def fresh():
        torch.manual_seed(0)
        return fnn.ForgeLM(cfg).double()
    model = fresh()
    ref_loss = model(ids, labels).loss
    ref_loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    res = {}

    model = fresh()
    ddp = DDP(model, process_group=dp)
    ddp.register_comm_hook(dp, _sum_hook)
    loss = ddp(ids[b, t], labels[b, t], group=sp, loss_group=dist.group.WORLD).loss
    loss.backward()
    fnn.sum_gradients(list(model.parameters()), sp)
    res["ddp"] = [abs(loss.item() - ref_loss.item()),
                  max(rel_err(p.grad, ref[n]) for n, p in model.named_parameters())]

    model = fresh()
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(1.0)
    loss = model(ids[b, t], labels[b, t], group=sp, loss_group=dist.group.WORLD).loss
    loss.backward()
    errs = []
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad.to_local(), group=sp)  # dp-sharded, sp-replicated
        errs.append(rel_err(p.grad.full_tensor(), ref[n]))
    res["fsdp2"] = [abs(loss.item() - ref_loss.item()), max(errs)]
    return {k: sum_ranks(torch.tensor(v, dtype=F64), world).tolist() for k, v in res.items()}


def test_ddp_and_fsdp2_on_dp_with_sp_match_single_process():
    res = run_world(4, _dp_sp)
    for key in ("ddp", "fsdp2"):
        loss_err, grad_err = res[key]
        assert loss_err < 1e-12 and grad_err < 1e-12, (key, res[key])


def _bf16_sum(group):
    rank = dist.get_rank(group)
    # partial gradients whose bf16 sums round differently from their exact sum
    w = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    w.grad = torch.tensor([1.0, 1.0 + 2 ** -7, 3.0], dtype=torch.bfloat16) * (1 + 2 ** -7 * rank)
    b = nn.Parameter(torch.zeros(2))  # an fp32 parameter beside it, with no gradient
    mine = [w.grad.double().tolist()]
    fnn.sum_gradients([w, b], group)
    parts = [None, None, None]
    dist.all_gather_object(parts, mine, group=group)
    exact = torch.tensor([p[0] for p in parts], dtype=torch.float64).sum(0)
    return {"got": w.grad.double().tolist(), "dtype": str(w.grad.dtype),
            "want": exact.to(torch.bfloat16).double().tolist(),
            "b": b.grad.tolist(), "b_dtype": str(b.grad.dtype)}


def test_sum_gradients_rounds_16_bit_gradients_once():
    """The sum over ranks runs in fp32: a bf16 gradient is the exact sum rounded once, and
    keeps its dtype; a parameter with no gradient gets zeros."""
    res = run_world(3, _bf16_sum)
    assert res["dtype"] == "torch.bfloat16" and res["got"] == res["want"], res
    assert res["b"] == [0.0, 0.0] and res["b_dtype"] == "torch.float32"
