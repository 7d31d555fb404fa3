"""Test-suite configuration: the ``cuda`` and ``triton`` markers skip cleanly where the machine lacks them.

Mark a test (or a module, through ``pytestmark``) ``cuda`` when it needs a CUDA device and ``triton`` when it
needs Triton; nothing else in a test file checks the platform.
"""
from __future__ import annotations

import importlib.util

import pytest


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = {"cuda": None if _cuda() else "needs a CUDA device",
               "triton": None if importlib.util.find_spec("triton") else "needs Triton"}
    for item in items:
        for marker, reason in missing.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
