"""The README's tour runs as written (its first Python block)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tour_runs():
    block = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert isinstance(scope["loss"], float)
    assert scope["full"].keys() == scope["model"].state_dict().keys()
    assert scope["full"]["fc1.weight"].shape == (256, 64)
