"""plait.graph (capture): models become OpGraphs with shapes, FLOPs, parameters and layer groups."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from plait.cost.flops import op_flops
from plait.errors import CaptureError
from plait.graph import LayerGroup, OpGraph, Ref, TensorMeta, capture, find_repeated_layers
from plait.models import GPTConfig, ModelSpec, TinyGPT, build, gpt_loss

B, T, D, H, V = 2, 8, 16, 4, 32
CFG = GPTConfig(vocab=V, seq=T, width=D, heads=H, layers=2)


def meta_gpt(layers=2):
    with torch.device("meta"):
        model = TinyGPT(GPTConfig(vocab=V, seq=T, width=D, heads=H, layers=layers))
        batch = (torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long))
    return model, batch


@pytest.fixture(scope="module")
def gpt():
    model, batch = meta_gpt()
    return model, capture(model, batch, gpt_loss)


def op_at(graph, module_path, target="aten.linear.default"):
    return next(op for op in graph.ops if op.module_path == module_path and op.target == target)


def test_gpt_targets_are_training_ir(gpt):
    _, graph = gpt
    targets = {op.target for op in graph.ops}
    for t in (
        "aten.embedding.default",
        "aten.arange.default",
        "aten.layer_norm.default",
        "aten.linear.default",
        "aten.view.default",
        "aten.transpose.int",
        "aten.matmul.default",
        "aten.softmax.int",
        "aten.gelu.default",
        "aten.add.Tensor",
        "aten.cross_entropy_loss.default",
    ):
        assert t in targets
    assert "aten.alias.default" not in targets  # folded into its readers
    assert not any(t.startswith(("aten.addmm", "aten.native_layer_norm")) for t in targets)


def test_parameters_buffers_and_batch_inputs(gpt):
    model, graph = gpt
    params = [g.target for g in graph.inputs if g.kind == "parameter"]
    assert params == [n for n, _ in model.named_parameters()]
    assert list(graph.parameters()) == params
    meta = graph.parameters()["blocks.1.fc1.weight"].meta
    assert meta == TensorMeta((4 * D, D), "float32")
    buffers = {g.target: g.name for g in graph.inputs if g.kind == "buffer"}
    assert buffers == {f"blocks.{i}.attn.mask": f"b_blocks_{i}_attn_mask" for i in range(2)}
    inputs = [(g.name, g.target, g.meta) for g in graph.inputs if g.kind == "input"]
    ids = TensorMeta((B, T), "int64")
    assert inputs == [("batch_0", "batch[0]", ids), ("batch_1", "batch[1]", ids)]


def test_module_paths_and_op_params(gpt):
    model, graph = gpt
    names = {n for n, _ in model.named_modules()}
    assert {op.module_path for op in graph.ops} <= names
    q = op_at(graph, "blocks.0.attn.q")
    assert q.params == ("blocks.0.attn.q.weight", "blocks.0.attn.q.bias")
    assert q.inputs[1:] == ("p_blocks_0_attn_q_weight", "p_blocks_0_attn_q_bias")
    # every parameter of the model is read by some op, under its own module
    read = {p: op.module_path for op in graph.ops for p in op.params}
    assert set(read) == set(graph.parameters())
    assert all(p.rsplit(".", 1)[0] == path for p, path in read.items())


def test_linear_and_matmul_flops_and_bytes(gpt):
    _, graph = gpt
    fc1 = op_at(graph, "blocks.0.fc1")
    m, n, k = B * T, 4 * D, D
    assert fc1.flops == 2 * m * n * k
    assert fc1.bytes == 4 * (m * k + n * k + n + m * n)
    scores = next(op for op in graph.ops if op.target == "aten.matmul.default")
    assert scores.outputs == (TensorMeta((B, H, T, T)),)
    assert scores.flops == 2 * B * H * T * T * (D // H)
    view = next(op for op in graph.ops if op.target == "aten.view.default")
    assert view.flops == 0 and view.bytes == 0
    softmax = next(op for op in graph.ops if op.target == "aten.softmax.int")
    assert softmax.flops == 5 * B * H * T * T
    assert graph.flops == sum(op.flops for op in graph.ops) > 2 * 2 * B * T * 12 * D * D


def test_args_hold_refs_and_plain_values(gpt):
    _, graph = gpt
    ln = op_at(graph, "blocks.0.ln1", "aten.layer_norm.default")
    assert ln.args == (Ref(0), (D,), Ref(1), Ref(2), 1e-05, False)
    assert ln.input_metas == (TensorMeta((B, T, D)), TensorMeta((D,)), TensorMeta((D,)))
    arange = next(op for op in graph.ops if op.target == "aten.arange.default")
    assert arange.inputs == () and arange.args == (T,)
    assert all(isinstance(v, str | bool) for _, v in arange.kwargs)
    masked = next(op for op in graph.ops if "b_blocks_0_attn_mask" in op.inputs)
    assert masked.target == "aten.add.Tensor"  # the alias of the mask was folded away


def test_loss_is_the_first_output(gpt):
    _, graph = gpt
    loss, index = graph.producer(graph.outputs[0])
    assert loss.target == "aten.cross_entropy_loss.default" and index == 0
    assert graph.meta(graph.outputs[0]) == TensorMeta((), "float32")
    assert loss.flops == 5 * B * T * V


def test_layer_groups_and_representatives(gpt):
    _, graph = gpt
    assert graph.layers == (LayerGroup("blocks", ("blocks.0", "blocks.1")),)
    first, second = graph.layer_ops("blocks.0"), graph.layer_ops("blocks.1")
    assert len(first) == len(second) > 20
    for a, b in zip(first, second, strict=True):
        assert graph.representative(b.name) == a.name
        assert graph.representative(a.name) == a.name
        assert graph.group_of(b.name) is graph.layers[0]
        assert b.module_path.startswith("blocks.1") and b.layer == "blocks.1"
    head = op_at(graph, "head")
    assert head.layer is None and graph.group_of(head.name) is None
    assert graph.representative(head.name) == head.name
    graph.validate()


def test_fast_path_equals_full_capture_and_traces_two_members(monkeypatch):
    model, batch = meta_gpt(layers=4)
    traced_lengths = []
    real_export = torch.export.export

    def spy(module, *args, **kwargs):
        traced_lengths.append(len(module.model.blocks))
        return real_export(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spy)
    fast = capture(model, batch, gpt_loss)
    full = capture(model, batch, gpt_loss, repeat=False)
    assert traced_lengths == [2, 4]
    assert fast == full  # inputs, ops (names included), outputs and layer groups
    assert [op.name for op in fast.ops] == [op.name for op in full.ops]
    assert fast.layers[0].members == tuple(f"blocks.{i}" for i in range(4))
    assert len(model.blocks) == 4  # the user's model is untouched


def test_fast_path_with_shared_tables_and_tied_head():
    # llama reads rotary tables computed before its blocks and ties its head to tok.
    with torch.device("meta"):
        model, batch, loss_fn = build(ModelSpec(kind="llama", layers=3, kv_heads=2, tied=True))
    fast = capture(model, batch, loss_fn)
    assert fast == capture(model, batch, loss_fn, repeat=False)
    assert "head.weight" not in fast.parameters()
    head = op_at(fast, "head")
    assert head.params == ("tok.weight",)
    last = fast.layer_ops("blocks.2")
    assert {r for op in last for r in op.inputs if r.startswith("b_")} == set()
    assert any(op.inputs[1] == "slice" for op in last if op.target == "aten.mul.Tensor")


def test_meta_capture_allocates_nothing():
    model, batch = meta_gpt(layers=3)
    blocks = list(model.blocks)
    capture(model, batch, gpt_loss)
    assert all(p.is_meta for p in model.parameters())
    assert list(model.blocks) == blocks


def test_real_weights_capture_equals_meta_capture(gpt):
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = (torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)))
    _, meta_batch = meta_gpt()
    _, expected = gpt  # the same config, built and captured on meta
    assert capture(model, batch, gpt_loss) == expected
    assert capture(model, meta_batch, gpt_loss) == expected  # a meta batch is fine too
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class Indexed(nn.Module):
    """Calls its layers by index, so a shortened copy cannot trace."""

    def __init__(self, n=3, width=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.n = n

    def forward(self, x):
        for i in range(self.n):
            x = torch.relu(self.layers[i](x))
        return x


def test_fallback_to_full_capture_when_the_shortened_model_fails():
    model, x = Indexed(), torch.randn(4, 8)
    graph = capture(model, (x,), lambda m, b: m(*b).sum())
    assert graph == capture(model, (x,), lambda m, b: m(*b).sum(), repeat=False)
    assert graph.layers == (LayerGroup("layers", ("layers.0", "layers.1", "layers.2")),)
    assert [op.target for op in graph.layer_ops("layers.2")] == ["aten.linear.default"]


class Uneven(nn.Module):
    """Identical layers, but the first one runs twice: no op-for-op correspondence."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = self.layers[0](self.layers[0](x))
        return self.layers[2](self.layers[1](x))


def test_groups_whose_members_do_not_correspond_are_dropped():
    graph = capture(Uneven(), torch.randn(4, 8))
    assert graph.layers == ()
    assert all(op.layer is None for op in graph.ops)
    assert len(graph) == 4


class Scaled(nn.Module):
    def __init__(self, scale, layer_idx):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale, self.layer_idx = scale, layer_idx


def test_repeated_layers_need_equal_hyperparameters_but_not_positions():
    same = nn.ModuleList(Scaled(0.5, i) for i in range(3))
    assert [r.members for r in find_repeated_layers(same)] == [("0", "1", "2")]
    different = nn.ModuleList(Scaled(0.5 * (i + 1), 0) for i in range(3))
    assert find_repeated_layers(different) == []
    mixed = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU())
    assert [r.members for r in find_repeated_layers(mixed)] == [("1", "2")]


def test_zoo_models_capture_with_their_own_ops():
    with torch.device("meta"):
        specs = {
            k: ModelSpec(kind=k, kv_heads=2 if k == "llama" else None)
            for k in ("llama", "bert", "cnn")
        }
        built = {k: build(s) for k, s in specs.items()}
    graphs = {k: capture(*built[k]) for k in built}
    llama_attn = next(op for op in graphs["llama"] if "attention" in op.target)
    assert llama_attn.kwarg("enable_gqa") is True and llama_attn.args[5] is True  # is_causal
    q, k, _v = llama_attn.input_metas
    assert k.shape[1] == 2 and q.shape[1] == 4
    assert llama_attn.flops == 2 * B * 4 * 16 * 16 * (8 + 8)  # QK^T and PV, seq 16, K 8
    assert "aten.rms_norm.default" in {op.target for op in graphs["llama"]}
    assert "aten.scaled_dot_product_attention.default" in {op.target for op in graphs["bert"]}
    conv = next(op for op in graphs["cnn"] if op.target == "aten.conv2d.default")
    out = conv.outputs[0]
    assert conv.flops == 2 * out.numel * 3 * 3 * 3  # Cin=3, 3x3 kernel
    cnn_targets = {op.target for op in graphs["cnn"]}
    assert {"aten.batch_norm.default", "aten.max_pool2d.default", "aten.add_.Tensor"} <= cnn_targets
    assert graphs["cnn"].layers == ()  # blocks 1.. match in weights, not in shapes


def test_multi_output_ops_fold_getitem_into_refs():
    with torch.device("meta"):
        model, batch, loss_fn = build(ModelSpec(kind="mlp", layers=2))
    graph = capture(model, batch, loss_fn)
    bcast = next(op for op in graph.ops if op.target == "aten.broadcast_tensors.default")
    assert len(bcast.outputs) == 2 and bcast.args == ((Ref(0), Ref(1)),)
    mse = next(op for op in graph.ops if op.target == "aten.mse_loss.default")
    assert mse.inputs == (bcast.name, f"{bcast.name}:1")
    assert graph.meta(f"{bcast.name}:1") == TensorMeta((B, 32))


def test_without_loss_fn_the_model_output_is_the_graph_output():
    model, (ids, _) = meta_gpt(layers=1)
    graph = capture(model, (ids,))
    assert graph.meta(graph.outputs[0]) == TensorMeta((B, T, V))


def test_dict_batches_name_their_keys():
    class Add(nn.Module):
        def forward(self, x, y):
            return x + y

    graph = capture(Add(), {"x": torch.ones(2), "y": torch.ones(2)})
    assert [(g.name, g.target) for g in graph.inputs] == [
        ("batch_0", "batch['x']"),
        ("batch_1", "batch['y']"),
    ]


class Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


class Masked(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()


def test_value_dependent_sizes_name_the_model_and_a_fix():
    with pytest.raises(CaptureError, match=r"Masked: a tensor's size depends on tensor values"):
        capture(Masked(), torch.randn(4, 3), lambda m, b: m(b))


def test_export_failures_name_the_model_and_a_fix():
    with pytest.raises(CaptureError, match="Branchy") as info:
        capture(Branchy(), torch.ones(3))
    assert "GuardOnDataDependentSymNode" in str(info.value) and "torch.cond" in str(info.value)
    with pytest.raises(CaptureError, match=r"not a torch\.nn\.Module"):
        capture(lambda x: x, torch.ones(3))
    with pytest.raises(CaptureError, match="not a scalar"):
        capture(nn.Linear(3, 3), torch.ones(2, 3), lambda m, b: m(b))


def test_op_flops_table():
    x, w = TensorMeta((4, 8, 16)), TensorMeta((32, 16))
    assert op_flops("aten.linear.default", [x, w], [TensorMeta((4, 8, 32))]) == 2 * 32 * 32 * 16
    q = TensorMeta((2, 4, 10, 8))
    kv = TensorMeta((2, 4, 12, 8))
    sdpa = op_flops("aten.scaled_dot_product_attention.default", [q, kv, kv], [q])
    assert sdpa == 2 * 2 * 4 * 10 * 12 * 16
    assert op_flops("aten.gelu.default", [x], [x]) == x.numel
    assert op_flops("aten.layer_norm.default", [x], [x]) == 5 * x.numel
    assert op_flops("aten.transpose.int", [x], [x]) == 0


def test_validate_rejects_dangling_refs(gpt):
    _, graph = gpt
    ops = list(graph.ops)
    ops[3] = replace(ops[3], inputs=("nowhere", *ops[3].inputs[1:]))
    broken = OpGraph(graph.inputs, tuple(ops), graph.outputs, graph.layers)
    with pytest.raises(CaptureError, match="nowhere"):
        broken.validate()
