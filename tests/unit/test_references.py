"""Every module, class, function or attribute the code's docstrings and the docs name under
``plait.`` exists: a renamed or removed module leaves no reference behind.

Read from the source as text: Sphinx roles in docstrings and comments (``:mod:`plait.x```,
``:class:`~plait.x.Y```, ``:attr:`Y.z <plait.x.Y.z>```) and backticked dotted names in the
Markdown pages (```plait.x.y```). A name resolves when importing its longest module prefix
and reading the rest as attributes succeeds, or when the last part is an attribute a class
sets on its instances (``self.z = ...``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":(?:mod|func|class|attr|meth|data|exc|obj):`~?([^`<]+?)\s*(?:<([^>]+)>)?`")
BACKTICKED = re.compile(r"`(plait(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
# not Python names: custom ops in torch.library's namespace "plait" (torch.ops.plait.*), and
# the checkpoint's manifest file
NOT_NAMES = {"plait.ps_lookup", "plait.ps_grad", "plait.ps_lookup.default", "plait.json"}


def _references() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "plait").rglob("*.py")):
        for m in ROLE.finditer(path.read_text()):
            name = re.sub(r"\s+", "", m.group(2) or m.group(1)).rstrip(".()")
            if name.startswith("plait."):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in BACKTICKED.finditer(path.read_text()):
            found.setdefault(m.group(1), set()).add(str(path.relative_to(ROOT)))
    return found


def _instance_attribute(cls: type, name: str) -> bool:
    """``name`` is set on instances of ``cls`` or a base (``self.name = ...``/``self.name:``)."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*[:=]")
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for k, attr in enumerate(parts[i:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and k == len(parts[i:]) - 1:
                return _instance_attribute(obj, attr)
            else:
                return False
        return True
    return False


def test_every_reference_to_a_plait_name_resolves() -> None:
    references = _references()
    assert len(references) > 100  # the reading found the references at all
    missing = {
        name: sorted(where)
        for name, where in references.items()
        if name not in NOT_NAMES and not _resolves(name)
    }
    assert not missing, "names that no longer exist:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in sorted(missing.items())
    )


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("plait.runtime.engine.job.ProgramJob.program_for", True),  # an instance attribute
        ("plait.runtime.engine.job.Job.no_such_thing", False),
        ("plait.no_such_module.thing", False),
        ("plait.graph.capture_program", True),
    ],
)
def test_the_resolver_tells_names_that_exist(name: str, ok: bool) -> None:
    assert _resolves(name) is ok


def test_no_file_cites_a_document_outside_the_repository() -> None:
    """The code and the docs stand on their own: nothing points at the planning documents
    beside the repository (``../shared/``, its ``DESIGN.md``)."""
    outside = re.compile(r"\.\./shared/|\bDESIGN\.md\b")
    paths = [*(ROOT / "plait").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    citing = [str(p.relative_to(ROOT)) for p in paths if outside.search(p.read_text())]
    assert not citing, f"files citing documents outside the repository: {citing}"
