"""The sync check's collector (``cpkv.engine.instruments.sync_debug_error``): every synchronisation site of a batch is
named in one error, other warnings pass through. On CPU torch's sync debug mode is absent, so the warnings
torch would emit are raised here by hand with its message."""
from __future__ import annotations

import warnings

import pytest
import torch

from cpkv.engine import instruments
from cpkv.engine.instruments import SYNC_WARNING, sync_debug_error


def _synchronises():
    warnings.warn(SYNC_WARNING)


def _elsewhere():
    warnings.warn(SYNC_WARNING)


@pytest.fixture
def modes(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", seen.append)
    monkeypatch.setattr(instruments, "_canary", _synchronises)  # the stream sync's warning, as torch would emit it
    return seen


def test_every_site_is_counted_and_named_in_one_error(modes):
    with pytest.raises(RuntimeError) as info:
        with sync_debug_error():
            for _ in range(3):
                _synchronises()
            _elsewhere()
    msg = str(info.value)
    assert msg.startswith("4 device->host synchronisations in a batch's plan + forward: ")
    assert "3x test_sync_sites.py:" in msg and "_synchronises" in msg and "1x test_sync_sites.py:" in msg
    assert "_elsewhere" in msg and "\n" not in msg
    assert modes == ["warn", 0]  # the mode is reset


def test_no_sync_no_error_and_other_warnings_pass(modes):
    with pytest.warns(DeprecationWarning, match="old"):
        with sync_debug_error():
            warnings.warn("old", DeprecationWarning)
    assert modes == ["warn", 0]


def test_an_error_inside_propagates_and_resets_the_mode(modes):
    with pytest.raises(KeyError):
        with sync_debug_error():
            _synchronises()
            raise KeyError("x")
    assert modes == ["warn", 0]


def test_a_canary_that_is_not_seen_falls_back_to_error_mode(modes, monkeypatch):
    """If torch's warnings did not reach the collector, a sync must still fail the batch: torch's own
    "error" mode takes over."""
    monkeypatch.setattr(instruments, "_canary", lambda: None)
    with sync_debug_error():
        pass
    assert modes == ["warn", "error", 0]
