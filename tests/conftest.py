"""Test selection shared by every test folder.

Tests marked ``nightly`` (the larger cases of a test matrix) are deselected from ``make test``
to keep it near 15 minutes on a 2-core machine; ``make test-nightly`` (``PLAIT_NIGHTLY=1``)
runs them. They are listed as deselected in every run, never silently skipped.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PLAIT_NIGHTLY") == "1":
        return
    nightly = [item for item in items if item.get_closest_marker("nightly") is not None]
    if nightly:
        config.hook.pytest_deselected(items=nightly)
        items[:] = [item for item in items if item.get_closest_marker("nightly") is None]
