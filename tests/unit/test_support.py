"""plait.support: the one table of what runs where, which engine a config runs on, and the
page that prints the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait import ConfigError, NotBuiltError, ParallelConfig
from plait.support import RULES, Where, check, engine_of, markdown, refusal

DOC = Path(__file__).resolve().parents[2] / "docs" / "support.md"


def test_the_docs_page_is_the_table() -> None:
    text = DOC.read_text()
    assert text.endswith(markdown()), (
        "docs/support.md's table differs from plait.support.RULES: rewrite the table with "
        "python -c \"import plait.support as s; print(s.markdown(), end='')\""
    )


@pytest.mark.parametrize(
    ("config", "mesh", "engine"),
    [
        (ParallelConfig(), {"dp": 4}, "plain"),
        (ParallelConfig(dataset_strategy="full_batch"), {"dp": 4}, "plain"),
        (ParallelConfig(recompute="full"), {"dp": 4}, "program"),
        (ParallelConfig(optimizer_shard=1), {"dp": 4}, "program"),
        (ParallelConfig(mesh={"dp": 2, "tp": 2}), {"dp": 2, "tp": 2}, "program"),
        (ParallelConfig(mode="semi_auto"), {"dp": 4}, "program"),
        (ParallelConfig(mode="hybrid"), {"dp": 4}, "hybrid"),
        (ParallelConfig(mode="stand_alone"), {"dp": 1}, "stand_alone"),
        (ParallelConfig(mesh={"pp": 2, "dp": 2}, micro_batches=2), {"pp": 2, "dp": 2}, "pipeline"),
    ],
)
def test_engine_of(config, mesh, engine) -> None:
    assert engine_of(config, mesh) == engine


def test_a_plan_is_never_the_plain_path() -> None:
    assert engine_of(ParallelConfig(), {"dp": 4}, planned=True) == "program"


def test_rules_of_one_engine_hold_only_there() -> None:
    """Host modules run on the plain path alone; a zero-bubble schedule with tp runs only on
    compiled stages; gradient accumulation only outside pipelines."""
    host = ParallelConfig(host_modules=("tok",))
    assert refusal(host) is None  # the engine is not known yet
    assert refusal(host, Where("plain")) is None
    for engine in ("program", "pipeline", "hybrid", "stand_alone"):
        assert refusal(host, Where(engine)).key == "host_modules"
    zb = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=2,
                        schedule="zero_bubble")  # fmt: skip
    assert refusal(zb, Where("pipeline", ("tp",))) is None  # compiled stages
    eager = ParallelConfig(mode="semi_auto", mesh={"pp": 2, "tp": 2}, micro_batches=2,
                           schedule="zero_bubble", stage_programs=False)  # fmt: skip
    assert refusal(eager, Where("pipeline", ("tp",))).key == "zero_bubble_eager_tp"
    assert refusal(eager, Where("pipeline")) is None  # no tp in the stages
    accumulate = ParallelConfig(mesh={"pp": 2, "dp": 2}, micro_batches=2, grad_accumulation=2)
    assert refusal(accumulate, Where("pipeline")).key == "stages_grad_accumulation"
    assert refusal(ParallelConfig(grad_accumulation=2), Where("program")) is None


def test_errors_name_the_setting_the_rule_and_the_way_out() -> None:
    with pytest.raises(NotBuiltError) as e:
        check(ParallelConfig(offload="parameters"))
    assert str(e.value).startswith("ParallelConfig(offload='parameters'): offloading parameters")
    assert "offload='optimizer' and 'activations' are built" in str(e.value)
    with pytest.raises(ConfigError, match=r"schedule='gpipe'\): a schedule .* would do nothing"):
        check(ParallelConfig(mesh={"dp": 4}, schedule="gpipe"))


def test_every_rule_has_its_own_key_and_words() -> None:
    keys = [r.key for r in RULES]
    assert len(keys) == len(set(keys))
    assert all(r.what and r.fix and r.scope for r in RULES)


def test_plait_plan_applies_the_rules_marked_for_planning_only() -> None:
    """The planner weighs what-ifs (micro-batches before it picks stages), so it refuses only
    what would be refused whatever it picks: host modules off the plain path, a schedule
    on a fixed mesh without stages."""
    idle = ParallelConfig(mode="auto", mesh={"dp": 4}, schedule="gpipe")
    assert refusal(idle, Where("program"), planning=True).key == "schedule_one_stage"
    what_if = ParallelConfig(mode="auto", micro_batches=4)  # the planner may pick stages
    assert refusal(what_if, Where("program"), planning=True) is None
    assert refusal(what_if, Where("program")).key == "micro_batches"
