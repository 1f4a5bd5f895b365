"""The pipeline stage partitioner (plait.search.stages) and the layer split without marks
(plait.runtime.pipeline.stage_balance): min-max stages checked against every cut set of small cases."""

from __future__ import annotations

import itertools
import random

import pytest

from plait import ConfigError
from plait.graph import GraphInput, LayerGroup, OpGraph, OpNode, TensorMeta
from plait.models import GPTConfig, TinyGPT
from plait.runtime.pipeline.job import stage_starts
from plait.runtime.pipeline.stage_balance import module_cost
from plait.search.stages import StageMemory, assign_stages, balanced_cuts

META = TensorMeta((4, 4))


def _chain(layers: list[str | None]) -> OpGraph:
    """One op per entry, each in the named repeated layer (None: outside every layer)."""
    ops, prev = [], "x"
    for i, layer in enumerate(layers):
        ops.append(OpNode(f"op{i}", "aten.relu.default", (prev,), (META,), (META,), layer=layer))
        prev = f"op{i}"
    members = tuple(dict.fromkeys(x for x in layers if x))
    groups = (LayerGroup("blocks", members),) if members else ()
    return OpGraph((GraphInput("x", "input", META, "batch[0]"),), tuple(ops), (prev,), groups)


def _spans(stage_of: list[int], values: list[float], stages: int) -> list[float]:
    out = [0.0] * stages
    for s, v in zip(stage_of, values, strict=True):
        out[s] += v
    return out


def _brute(times: list[float], stages: int, fits=lambda cut: True) -> float:
    k, best = len(times), float("inf")
    for cut in itertools.combinations(range(1, k), stages - 1):
        at = [0, *cut, k]
        if fits(at):
            best = min(best, max(sum(times[a:b]) for a, b in itertools.pairwise(at)))
    return best


def _gpt_like(head: float) -> tuple[OpGraph, dict[str, float], list[float]]:
    """Embedding (op 0), 8 layers of 2 ops, a head of weight ``head`` (last op)."""
    layers: list[str | None] = [None] + [f"blocks.{i // 2}" for i in range(16)] + [None]
    graph = _chain(layers)
    times = [0.1] + [0.5] * 16 + [head]
    return graph, {op.name: t for op, t in zip(graph.ops, times, strict=True)}, times


def test_a_heavy_tail_no_longer_overloads_a_stage() -> None:
    """Three light layers, a heavy one and a heavy head in two ops: the old rule (each cut
    nearest s/stages of the total, 22 s) put the heavy layer and half the head together,
    3 + 14 + 5 s; the min-max partition is 3 + 9 + 10 s (brute force agrees)."""
    times = [1.0, 1.0, 1.0, 9.0, 5.0, 5.0]
    graph = _chain([None] * 6)
    op_time = {op.name: t for op, t in zip(graph.ops, times, strict=True)}
    spans = _spans(assign_stages(graph, op_time, 3), times, 3)
    assert max(spans) == _brute(times, 3) == 10.0
    assert spans == [3.0, 9.0, 10.0]


def test_the_heavy_head_stage_keeps_one_layer_and_the_rest_stay_even() -> None:
    graph, op_time, times = _gpt_like(head=6.0)
    spans = _spans(assign_stages(graph, op_time, 4), times, 4)
    assert spans == pytest.approx([2.1, 3.0, 2.0, 7.0])  # the old rule: 3.1, 3, 1, 7


def test_min_max_equals_brute_force_on_small_cases() -> None:
    rng = random.Random(7)
    for _ in range(150):
        k = rng.randint(1, 9)
        stages = rng.randint(1, k)
        times = [float(rng.choice((0, 1, 2, 3, 5, 8, 13))) for _ in range(k)]
        cuts = balanced_cuts(times, stages)
        at = [0, *cuts, k]
        assert all(a < b for a, b in itertools.pairwise(at))
        assert max(sum(times[a:b]) for a, b in itertools.pairwise(at)) == _brute(times, stages)


def test_cuts_only_at_layer_boundaries_when_there_are_layers() -> None:
    graph, op_time, _ = _gpt_like(head=1.0)
    stage_of = assign_stages(graph, op_time, 3)
    for i in range(1, len(stage_of)):
        if stage_of[i] != stage_of[i - 1]:
            op = graph.ops[i]
            assert op.layer is not None and op.layer != graph.ops[i - 1].layer


def test_a_partition_that_fits_memory_beats_a_faster_one_that_does_not() -> None:
    times = [1.0, 1.0, 1.0, 1.0]
    acts = [10.0, 10.0, 10.0, 10.0]
    # 1F1B on 2 stages, 2 micro-batches: stage 0 holds both, stage 1 one (as fractions)
    in_flight = [1.0, 0.5]
    fast = balanced_cuts(times, 2, StageMemory([0.0] * 4, acts, in_flight, None))
    assert fast == [2]  # 2 + 2 layers: 20 and 10 bytes; peak 20
    tight = StageMemory([0.0] * 4, acts, in_flight, limit=15.0)
    cuts = balanced_cuts(times, 2, tight)
    assert cuts == [1]  # 1 + 3 layers: 10 and 15 bytes fit; 3 s instead of 2

    def fits(at: list[int]) -> bool:
        return all(
            sum(acts[a:b]) * in_flight[s] <= 15.0 for s, (a, b) in enumerate(itertools.pairwise(at))
        )

    assert _brute(times, 2, fits) == 3.0
    # nothing fits: the fastest partition all the same
    assert balanced_cuts(times, 2, StageMemory([0.0] * 4, acts, in_flight, 1.0)) == [2]


def test_ties_go_to_the_lower_peak_memory() -> None:
    """Both cuts of 3 equal blocks into 2 stages take 2 s; by default the later stage takes
    more (1F1B keeps fewer micro-batches there), but where the figures say the other cut
    peaks lower, the figures win."""
    acts = [4.0, 4.0, 4.0]
    assert balanced_cuts([1.0] * 3, 2) == [1]
    assert balanced_cuts([1.0] * 3, 2, StageMemory([0.0] * 3, acts, [1.0, 0.5])) == [1]
    assert balanced_cuts([1.0] * 3, 2, StageMemory([0.0] * 3, acts, [0.5, 1.0])) == [2]


def test_deterministic_and_independent_of_mapping_order() -> None:
    graph, op_time, _ = _gpt_like(head=3.0)
    reverse = dict(reversed(list(op_time.items())))
    first = assign_stages(graph, op_time, 4)
    assert all(assign_stages(graph, op_time, 4) == first for _ in range(3))
    assert assign_stages(graph, reverse, 4) == first


def test_too_few_cuts_are_refused() -> None:
    graph, op_time, _ = _gpt_like(head=1.0)
    with pytest.raises(ConfigError, match="offers only 9 places to cut"):
        assign_stages(graph, op_time, 10)


def test_no_marks_balances_the_layers_with_the_head() -> None:
    """A big vocabulary: the head (width x vocab per token, about 10 blocks here) outweighs
    the layers, so the last stage keeps one (the old even split gave it 4); a small one keeps
    the even split."""
    big = GPTConfig(vocab=4096, seq=8, width=32, heads=4, layers=8)
    model = TinyGPT(big)
    assert module_cost(model.head) == 32 * 4096
    assert module_cost(model.tok) == 32  # a lookup: one row per token
    assert stage_starts(model, 2) == ["blocks.7"]
    assert stage_starts(TinyGPT(GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=8)), 2) == [
        "blocks.4"
    ]
