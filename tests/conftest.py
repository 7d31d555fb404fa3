"""Test-suite configuration: the ``cuda`` and ``triton`` markers skip cleanly where the machine lacks them.

Mark a test (or a module, through ``pytestmark``) ``cuda`` when it needs a CUDA device and ``triton`` when it
needs Triton; nothing else in a test file checks the platform. The sparse attention is pinned to cpkv's own
kernel (``CPKV_SPARSE_MLA=cpkv``, inherited by the rank processes) so that its tests test it on a machine where
FlashMLA is installed too; the FlashMLA backend's tests ask for it explicitly.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("CPKV_SPARSE_MLA", "cpkv")


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
