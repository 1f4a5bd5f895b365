"""Activation recompute as a graph pass (plait/runtime/program/remat.py).

Toy training steps are traced by make_fx the way plait compiles a per-rank program: a forward
whose module code runs inside ``annotate({"plait_module": path})``, the loss, then
``torch.autograd.grad``; the seed of backward is tagged so tests find the boundary. The pass
must leave every output bit for bit the same, keep dropout's mask, and make the values kept
between forward and backward, and the peak memory of a real run, smaller.
"""

from __future__ import annotations

import copy
import functools
import operator

import pytest
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.fx.experimental.proxy_tensor import make_fx

from plait.runtime.program.remat import (
    TAG,
    module_of,
    recompute_policy,
    regions,
    rematerialize,
    saved_bytes,
)

D, T, B, LAYERS = 32, 64, 8, 4
BLOCKS = [f"blocks.{i}" for i in range(LAYERS)]
_PARAMS = ("ln1.w", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b")
_PARAMS += ("ln2.w", "ln2.b", "fc1.w", "fc1.b", "fc2.w", "fc2.b")
_SHAPES = {"qkv": (3 * D, D), "proj": (D, D), "fc1": (4 * D, D), "fc2": (D, 4 * D)}


def _param(name: str, generator: torch.Generator) -> torch.Tensor:
    module, kind = name.split(".")
    if module.startswith("ln"):
        return torch.ones(D) if kind == "w" else torch.zeros(D)
    shape = _SHAPES[module]
    return torch.randn(shape if kind == "w" else shape[:1], generator=generator) * 0.1


def _inputs(layers: int = LAYERS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [_param(n, generator) for _ in range(layers) for n in _PARAMS]
    return [torch.randn(B, T, D, generator=generator), *params]


def _step(dropout: float, layers: int = LAYERS):
    """A pre-norm transformer stack's training step: (loss, *gradients)."""

    def step(x: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = [p.detach().requires_grad_(True) for p in flat]
        h = x
        for i in range(layers):
            p = dict(zip(_PARAMS, params[i * len(_PARAMS) : (i + 1) * len(_PARAMS)], strict=True))
            with fx_traceback.annotate({TAG: f"blocks.{i}.attn"}):
                a = F.layer_norm(h, (D,), p["ln1.w"], p["ln1.b"])
                q, k, v = F.linear(a, p["qkv.w"], p["qkv.b"]).split(D, -1)
                probs = ((q @ k.transpose(-2, -1)) * D**-0.5).softmax(-1)
                if dropout:
                    probs = F.dropout(probs, dropout, training=True)
                h = h + F.linear(probs @ v, p["proj.w"], p["proj.b"])
            with fx_traceback.annotate({TAG: f"blocks.{i}.mlp"}):
                m = F.layer_norm(h, (D,), p["ln2.w"], p["ln2.b"])
                up = F.gelu(F.linear(m, p["fc1.w"], p["fc1.b"]))
                h = h + F.linear(up, p["fc2.w"], p["fc2.b"])
        loss = h.square().mean()
        with fx_traceback.annotate({"boundary": True}):
            seed = torch.ones_like(loss)
        grads = torch.autograd.grad(loss, params, grad_outputs=seed)
        return (loss, *grads)

    return step


@pytest.fixture(autouse=True)
def _one_thread():
    """The toy steps are tiny: intra-op threads only add overhead (seconds a run on a busy
    two-core machine, against milliseconds on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _traced(dropout: float, layers: int = LAYERS) -> torch.fx.GraphModule:
    with fx_traceback.preserve_node_meta():
        return make_fx(_step(dropout, layers), tracing_mode="fake")(*_inputs(layers))


def traced(dropout: float = 0.0, layers: int = LAYERS) -> torch.fx.GraphModule:
    """A fresh copy of the traced step (the pass works in place)."""
    return copy.deepcopy(_traced(dropout, layers))


def boundary(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get("boundary"))


def run(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    torch.manual_seed(1234)  # dropout's masks: the same draws for every graph
    return list(gm(*_inputs()))


def remat(gm: torch.fx.GraphModule, mode: str, paths=BLOCKS) -> int:
    start = boundary(gm)
    policy = recompute_policy(mode, regions(paths), backward_start=start)
    return rematerialize(gm, backward_start=start, recompute=policy)


def forward_reads(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Forward nodes that backward nodes (not the output) read."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = position[boundary(gm)]
    return {
        a
        for u in gm.graph.nodes
        if position[u] >= start and u.op != "output"
        for a in u.all_input_nodes
        if position[a] < start
    }


def clones(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if "recomputed_from" in n.meta]


def tags(node: torch.fx.Node) -> list[torch.Tag]:
    return list(getattr(node.target, "tags", ()))


def op(node: torch.fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name.removeprefix("aten::") if schema is not None else str(node.target)


# -- the tag -------------------------------------------------------------------------------------
def test_annotate_tags_forward_nodes_in_meta_custom_and_backward_nodes_not():
    gm = _traced(0.0)
    start = boundary(gm)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    forward = [n for n in gm.graph.nodes if position[n] < position[start]]
    gelu = next(n for n in forward if n.target is torch.ops.aten.gelu.default)
    assert gelu.meta["custom"][TAG] == "blocks.0.mlp"
    assert module_of(gelu) == "blocks.0.mlp"
    backward = [n for n in gm.graph.nodes if position[n] > position[start]]
    assert backward and all(module_of(n) is None for n in backward)


def test_regions_take_the_longest_enclosing_path():
    def node(tag: str | None) -> torch.fx.Node:
        graph = torch.fx.Graph()
        n = graph.placeholder("x")
        if tag is not None:
            n.meta["custom"] = {TAG: tag}
        return n

    region_of = regions(["blocks.1", "blocks.1.attn", "head"])
    assert region_of(node("blocks.1.attn.q")) == "blocks.1.attn"
    assert region_of(node("blocks.1.mlp")) == "blocks.1"
    assert region_of(node("blocks.1")) == "blocks.1"
    assert region_of(node("blocks.10.mlp")) is None  # not below blocks.1
    assert region_of(node("embed")) is None
    assert region_of(node(None)) is None
    assert regions([""])(node("anything.at.all")) == ""


# -- bit for bit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_outputs_are_bitwise_equal_after_the_pass(mode, dropout):
    gm = traced(dropout)
    expected = run(gm)
    count = remat(gm, mode)
    assert count > 0
    got = run(gm)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_dropout_masks_are_saved_not_drawn_again():
    gm = traced(0.25)
    random = [n for n in gm.graph.nodes if torch.Tag.nondeterministic_seeded in tags(n)]
    assert [n.target for n in random] == [torch.ops.aten.bernoulli_.float] * LAYERS
    masks = {next(iter(n.users)) for n in random}  # div_: the scaled mask
    remat(gm, "full")
    assert all(torch.Tag.nondeterministic_seeded not in tags(c) for c in clones(gm))
    assert masks <= forward_reads(gm)  # backward reads forward's masks
    torch.manual_seed(7)
    gm(*_inputs())
    after_remat = torch.get_rng_state()
    torch.manual_seed(7)
    _traced(0.25)(*_inputs())
    assert torch.equal(after_remat, torch.get_rng_state())  # no extra draws in backward


def test_native_dropout_and_its_outputs_are_never_cloned():
    def step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = w.detach().requires_grad_(True)
        with fx_traceback.annotate({TAG: "block"}):
            h, _mask = torch.ops.aten.native_dropout(torch.tanh(x @ w), 0.5, True)
            y = torch.sigmoid(h)
        loss = (y @ w).sum()
        with fx_traceback.annotate({"boundary": True}):
            seed = torch.ones_like(loss)
        return (loss, *torch.autograd.grad(loss, [w], grad_outputs=seed))

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    with fx_traceback.preserve_node_meta():
        gm = make_fx(step, tracing_mode="fake")(x, w)
    torch.manual_seed(0)
    expected = gm(x, w)
    dropout = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default)
    pieces = set(dropout.users)
    rematerialize(gm, backward_start=boundary(gm), recompute=lambda n: True)
    recomputed = {c.meta["recomputed_from"] for c in clones(gm)}
    assert {"sigmoid", "tanh"} <= recomputed  # tanh's clone feeds no dropout: only tanh_backward
    assert not recomputed & {dropout.name, *(p.name for p in pieces)}
    torch.manual_seed(0)
    for a, b in zip(gm(x, w), expected, strict=True):
        assert torch.equal(a, b)


# -- full recompute ------------------------------------------------------------------------------
def test_full_keeps_only_region_outputs_and_masks_for_backward():
    gm = traced(0.25)
    before = saved_bytes(gm, boundary(gm))
    remat(gm, "full")
    after = saved_bytes(gm, boundary(gm))
    region_of = regions(BLOCKS)
    inside = {n for n in forward_reads(gm) if region_of(n) is not None}
    # Each block's output (the residual sum the next block reads) and its dropout mask.
    assert sorted(op(n) for n in inside) == sorted(["add", "div_"] * LAYERS)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = position[boundary(gm)]
    for n in inside:
        if op(n) == "add":  # read by the next block's forward (the last: by the loss)
            assert any(position[u] < start and region_of(u) != region_of(n) for u in n.users)
    assert after < before / 4, (before, after)


def test_full_frees_recomputed_originals_before_backward_in_the_generated_code():
    gm = traced(0.0)
    remat(gm, "full")
    lines = gm.code.splitlines()
    start = boundary(gm).name
    start_line = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{start} = "))
    freed_at: dict[str, int] = {}
    for i, line in enumerate(lines):
        tail = line.split(";  ")[-1].replace(" ", "")
        if tail.endswith("=None"):
            for name in tail.split("=")[:-1]:
                freed_at[name] = i
    originals = {c.meta["recomputed_from"] for c in clones(gm)}
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    assert originals
    for name in originals - placeholders:
        assert freed_at[name] < start_line, name


# -- selective recompute -------------------------------------------------------------------------
def test_selective_keeps_matmuls_and_recomputes_softmax_and_gelu():
    gm = traced(0.0)
    none = saved_bytes(gm, boundary(gm))
    full = traced(0.0)
    remat(full, "full")
    remat(gm, "selective")
    kept = {op(n) for n in forward_reads(gm)}
    assert {"addmm", "bmm"} <= kept
    assert not {"_softmax", "gelu"} & kept
    assert "_softmax" in {op(c) for c in clones(gm)}
    assert saved_bytes(full, boundary(full)) < saved_bytes(gm, boundary(gm)) < none


def _attention_step(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    w = w.detach().requires_grad_(True)
    with fx_traceback.annotate({TAG: "attn"}):
        q = (x @ w).view(2, 4, 16, 32)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True).relu()
    loss = y.sum()
    with fx_traceback.annotate({"boundary": True}):
        seed = torch.ones_like(loss)
    return (loss, *torch.autograd.grad(loss, [w], grad_outputs=seed))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_an_attention_kernel_without_dropout_is_recomputed_by_full_kept_by_selective(mode):
    x, w = torch.randn(2, 64, 32), torch.randn(32, 32)
    with fx_traceback.preserve_node_meta():
        gm = make_fx(_attention_step, tracing_mode="fake")(x, w)
    expected = gm(x, w)
    remat(gm, mode, ["attn"])
    attention = {c for c in clones(gm) if op(c).startswith("_scaled_dot_product")}
    pieces = {c for c in clones(gm) if c.target is operator.getitem}
    assert (len(attention), len(pieces)) == ((1, 2) if mode == "full" else (0, 0))
    for a, b in zip(gm(x, w), expected, strict=True):
        assert torch.equal(a, b)


# -- memory of a real run ------------------------------------------------------------------------
def _peak(gm: torch.fx.GraphModule) -> int:
    inputs = _inputs(2)
    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        torch.manual_seed(0)
        gm(*inputs)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_of_a_run_drops():
    plain, full, selective = traced(0.0, 2), traced(0.0, 2), traced(0.0, 2)
    remat(full, "full", BLOCKS[:2])
    remat(selective, "selective", BLOCKS[:2])
    peaks = [_peak(g) for g in (plain, selective, full)]
    assert peaks[2] < peaks[1] < peaks[0], peaks
    assert peaks[2] < 0.7 * peaks[0], peaks


# -- what is cloned ------------------------------------------------------------------------------
def test_nodes_outside_every_region_are_never_cloned():
    gm = traced(0.0)
    count = remat(gm, "full", ["blocks.1", "blocks.3.mlp"])
    by_name = {n.name: n for n in gm.graph.nodes}
    region_of = regions(["blocks.1", "blocks.3.mlp"])
    assert count == len(clones(gm)) > 0
    assert {region_of(by_name[c.meta["recomputed_from"]]) for c in clones(gm)} == {
        "blocks.1",
        "blocks.3.mlp",
    }


def test_clones_are_made_once_and_shared_by_later_readers():
    gm = traced(0.0)
    count = remat(gm, "full")
    made = clones(gm)
    assert count == len(made)
    sources = [c.meta["recomputed_from"] for c in made]
    assert len(sources) == len(set(sources))
    assert any(len(c.users) > 1 for c in made)
    by_name = {n.name: n for n in gm.graph.nodes}
    for c in made:
        original = by_name[c.meta["recomputed_from"]]
        assert c.target is original.target and c.meta["val"] is original.meta["val"]
    # Clones come after the boundary, each before its first reader (the graph lints).
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert all(position[c] > position[boundary(gm)] for c in made)


def test_policy_never_says_yes_to_placeholders_or_writes():
    gm = traced(0.25)
    start = boundary(gm)
    policy = recompute_policy("full", regions([""]), backward_start=start)
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "_schema", None) is None:
            continue
        if n.target._schema.is_mutable:
            assert not policy(n)
    assert not any(policy(n) for n in gm.graph.nodes if n.op in ("placeholder", "output"))


# -- casts ---------------------------------------------------------------------------------------
def _cast_step(cast_to: torch.dtype):
    """Region a makes h (the dtype of x); region b casts h to ``cast_to`` and multiplies."""

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w1, w2 = (w.detach().requires_grad_(True) for w in (w1, w2))
        with fx_traceback.annotate({TAG: "a"}):
            h = x @ w1 + 1.0  # the add's backward reads nothing: h is kept only for b
        with fx_traceback.annotate({TAG: "b"}):
            c = h.to(cast_to)
            y = c @ w2.to(cast_to)
        loss = y.float().sum()
        with fx_traceback.annotate({"boundary": True}):
            seed = torch.ones_like(loss)
        return (loss, *torch.autograd.grad(loss, [w1, w2], grad_outputs=seed))

    return step


@pytest.mark.parametrize(
    ("dtype", "cast_to", "recomputed"),
    [(torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.float32, True)],
    ids=["high-to-low-cast-kept", "low-to-high-cast-recomputed"],
)
def test_a_cast_is_recomputed_only_when_that_keeps_less(dtype, cast_to, recomputed):
    x = torch.randn(16, 32, dtype=dtype)
    w1, w2 = torch.randn(32, 32, dtype=dtype), torch.randn(32, 32)
    with fx_traceback.preserve_node_meta():
        gm = make_fx(_cast_step(cast_to), tracing_mode="fake")(x, w1, w2)
    expected = gm(x, w1, w2)
    before = saved_bytes(gm, boundary(gm))
    remat(gm, "full", ["a", "b"])
    cast = next(
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten._to_copy.default
        and module_of(n) == "b"
        and n.all_input_nodes[0].op != "placeholder"
    )
    assert (cast.name in {c.meta["recomputed_from"] for c in clones(gm)}) == recomputed
    assert (cast in forward_reads(gm)) != recomputed
    assert saved_bytes(gm, boundary(gm)) <= before
    for a, b in zip(gm(x, w1, w2), expected, strict=True):
        assert torch.equal(a, b)


# -- collectives (structure only: no process group) ----------------------------------------------
def _call(graph: torch.fx.Graph, name: str, target, *args) -> torch.fx.Node:
    return graph.create_node("call_function", target, args, name=name)


def _collective_graph() -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    """x @ w -> all_reduce -> wait -> relu -> sum, all in region r; backward reads relu and the
    wait's result."""
    graph = torch.fx.Graph()
    functional = torch.ops._c10d_functional
    aten = torch.ops.aten
    n: dict[str, torch.fx.Node] = {"x": graph.placeholder("x"), "w": graph.placeholder("w")}
    n["mm"] = _call(graph, "mm", aten.mm.default, n["x"], n["w"])
    n["ar"] = _call(graph, "ar", functional.all_reduce.default, n["mm"], "sum", "tp")
    n["wait"] = _call(graph, "wait", functional.wait_tensor.default, n["ar"])
    n["relu"] = _call(graph, "relu", aten.relu.default, n["wait"])
    n["loss"] = _call(graph, "loss", aten.sum.default, n["relu"])
    n["seed"] = _call(graph, "seed", aten.ones_like.default, n["loss"])
    n["grad"] = _call(graph, "grad", aten.threshold_backward.default, n["seed"], n["relu"], 0)
    n["gw"] = _call(graph, "gw", aten.mul.Tensor, n["grad"], n["wait"])
    graph.output((n["loss"], n["gw"]))
    for name in ("mm", "ar", "wait", "relu", "loss"):
        n[name].meta["custom"] = {TAG: "r"}
    for name, node in n.items():
        shape = () if name in ("loss", "seed") else (4, 4)
        node.meta["val"] = torch.empty(shape, device="meta")
    return torch.fx.GraphModule(torch.nn.Module(), graph), n


def _recomputed(gm: torch.fx.GraphModule) -> set[str]:
    return {c.meta["recomputed_from"] for c in clones(gm)}


def test_a_collective_is_recomputed_with_its_wait():
    gm, n = _collective_graph()
    chosen = (n["ar"], n["wait"], n["relu"])
    count = rematerialize(gm, backward_start=n["seed"], recompute=lambda v: v in chosen)
    assert count == 3 and _recomputed(gm) == {"ar", "wait", "relu"}
    by_source = {c.meta["recomputed_from"]: c for c in clones(gm)}
    assert by_source["wait"].args == (by_source["ar"],)
    assert by_source["ar"].args == (n["mm"], "sum", "tp")  # mm read as a saved value
    assert n["gw"].args[1] is by_source["wait"]  # one clone, shared by relu's clone and gw
    assert by_source["relu"].args == (by_source["wait"],)
    assert set(n["wait"].users) == {n["relu"]}  # the original: only forward reads it


def test_a_wait_follows_its_collective_whatever_the_policy_says():
    gm, n = _collective_graph()
    rematerialize(gm, backward_start=n["seed"], recompute=lambda v: v in (n["wait"], n["relu"]))
    assert _recomputed(gm) == {"relu"}  # the wait stays saved: its collective is not cloned
    assert n["gw"].args[1] is n["wait"]
    gm, n = _collective_graph()
    rematerialize(gm, backward_start=n["seed"], recompute=lambda v: v is n["ar"])
    assert _recomputed(gm) == {"ar", "wait"}


@pytest.mark.parametrize(
    ("mode", "expected"), [("full", {"mm", "ar", "wait", "relu"}), ("selective", {"relu"})]
)
def test_full_recomputes_collectives_in_a_region_and_selective_keeps_them(mode, expected):
    gm, n = _collective_graph()
    before = saved_bytes(gm, n["seed"])
    policy = recompute_policy(mode, regions(["r"]), backward_start=n["seed"])
    rematerialize(gm, backward_start=n["seed"], recompute=policy)
    assert _recomputed(gm) == expected
    relu, loss = 4 * 4 * 4, 4  # the loss: read by the seed (ones_like), untouched
    assert before == 2 * relu + loss  # relu and the wait's result
    assert saved_bytes(gm, n["seed"]) == (loss if mode == "full" else relu + loss)


def test_values_written_after_use_are_not_recomputed():
    graph = torch.fx.Graph()
    aten = torch.ops.aten
    x = graph.placeholder("x")
    y = _call(graph, "y", aten.relu.default, x)
    z = _call(graph, "z", aten.mul.Tensor, y, 2.0)  # reads y before the write below
    e = _call(graph, "e", aten.exp.default, x)
    w = _call(graph, "w", aten.add_.Tensor, y, 1.0)
    seed = _call(graph, "seed", aten.ones_like.default, e)
    b = _call(graph, "b", aten.mul.Tensor, z, seed)
    c = _call(graph, "c", aten.mul.Tensor, e, w)
    graph.output((b, c))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = torch.randn(5)
    expected = gm(inputs.clone())
    count = rematerialize(gm, backward_start=seed, recompute=lambda n: True)
    assert _recomputed(gm) == {"e"} and count == 1  # not y, z (y written after), nor add_
    for a, b in zip(gm(inputs.clone()), expected, strict=True):
        assert torch.equal(a, b)
