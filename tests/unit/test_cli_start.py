"""Start-up and the CLI's small commands: ``import plait`` loads no room it does not need,
``plait --version`` and ``plait completion`` (issue 35, item 6)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from plait.cli import build_parser, main
from plait.cli.completion import completion_script

PYTHON = sys.executable


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_plait_loads_neither_torch_nor_a_room() -> None:
    """The public names load on first use: ``import plait`` holds the errors alone, and a
    name pulls in its own room (the config, not the runtime or the planner)."""
    bare = _loaded_after("import plait")
    assert "torch" not in bare
    assert {m for m in bare if m.startswith("plait")} == {"plait", "plait.errors"}
    config = _loaded_after("from plait import ParallelConfig")
    assert "plait.config" in config
    assert not {"plait.runtime.engine.job", "plait.planning.planner", "torch._dynamo"} & config


def test_the_command_line_parser_loads_no_torch() -> None:
    """``plait --help``, ``--version`` and ``completion`` build the parser alone: every
    subcommand imports its heavy rooms when it runs."""
    loaded = _loaded_after("from plait.cli import build_parser\nbuild_parser()")
    assert "torch" not in loaded


def test_lazy_names_are_the_rooms_objects_and_unknown_ones_are_attribute_errors() -> None:
    import plait
    from plait.runtime.parallelize import parallelize

    assert plait.parallelize is parallelize
    assert plait.testing.simulate is not None  # a room reached as an attribute
    assert "parallelize" in dir(plait)
    with pytest.raises(AttributeError, match="no attribute 'paralellize'"):
        _ = plait.paralellize  # type: ignore[attr-defined]


def test_version_names_plait_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"plait {version('plait')} (torch {version('torch')})"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["plait", "pl"], {"plan"}),
        (["plait", "plan", "--mic"], {"--micro-batches"}),
        (["plait", "checkpoint", ""], {"inspect", "merge"}),
        (["plait", "run", "--max-r"], {"--max-restarts"}),
    ],
)
def test_bash_completion_completes_commands_and_flags(
    tmp_path, words: list[str], expected: set[str]
) -> None:
    """The script, sourced in bash, completes what the parser has (run as bash runs it)."""
    script = tmp_path / "plait.bash"
    script.write_text(completion_script("bash", build_parser()))
    quoted = " ".join(f"'{w}'" for w in words)
    probe = (
        f"source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _plait; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) == expected


def test_completion_refuses_an_unknown_shell() -> None:
    with pytest.raises(ValueError, match="shell 'fish' is not one of"):
        completion_script("fish", build_parser())
    zsh = completion_script("zsh", build_parser())
    assert "bashcompinit" in zsh and "complete -o filenames -F _plait plait" in zsh
