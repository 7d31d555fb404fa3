"""Failures around rank processes: a rank that cannot start is one error (the first cause, no second traceback
from the clean-up), a rank killed by a signal is named with the signal, a /dev/shm segment never outlives a
failed allocation."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from cpkv.compose import peer
from cpkv.compose.peer import PeerMemory
from cpkv.dist import RankContext, launch
from cpkv.dist.launch import death
from cpkv.errors import PoolExhausted, RankFailure


def _never_called(ctx):
    return ctx.rank


def test_a_rank_that_cannot_start_is_one_failure_with_its_first_cause():
    """An unpicklable argument fails ``Process.start`` of rank 0: one RankFailure naming it, whose context is
    the pickling error itself (not an AssertionError from joining a process that never ran)."""
    with pytest.raises(RankFailure, match=r"^rank 0 could not start: (PicklingError|AttributeError)") as info:
        launch(_never_called, 2, args=(lambda: 0,), timeout_s=120)
    cause = info.value.__cause__
    assert cause is not None and "pickle" in f"{type(cause).__name__} {cause}".lower()
    assert not isinstance(info.value.__context__, AssertionError)


@pytest.mark.parametrize("code,words", [(-signal.SIGSEGV, "was killed by SIGSEGV"),
                                        (-signal.SIGKILL, "was killed by SIGKILL"), (3, "died with exit code 3"),
                                        (-200, "was killed by signal 200")])
def test_a_death_is_named_with_its_signal(code, words):
    assert death(code) == words


def _memory() -> PeerMemory:
    ctx = RankContext(0, 1, torch.device("cpu"), "gloo")
    return PeerMemory(ctx, "shm", f"test{os.getpid()}")


def _segments(mem: PeerMemory) -> list[str]:
    return [f for f in os.listdir(peer.SHM_DIR) if f.startswith(f"cpkv-{mem.token}-")]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_huge_shared_buffer_is_refused_before_any_file_exists():
    mem = _memory()
    with pytest.raises(PoolExhausted, match=r"peer buffer 'pool.token': needs \d+ bytes of /dev/shm"):
        mem.alloc_host((1 << 50,), "pool.token", torch.uint8)
    assert _segments(mem) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_failed_mapping_removes_its_segment(monkeypatch):
    """``torch.from_file`` creates and sizes the file, then fails (as mmap of a huge size does): the file goes."""
    mem = _memory()
    real = torch.from_file

    def fails(path, shared, size, dtype):
        real(path, shared=shared, size=size, dtype=dtype)  # the file now exists, sized
        raise RuntimeError("unable to mmap")

    monkeypatch.setattr(torch, "from_file", fails)
    with pytest.raises(RuntimeError, match="unable to mmap"):
        mem.alloc_host((4096,), "pads", torch.int64)
    assert _segments(mem) == []
    monkeypatch.setattr(torch, "from_file", real)
    t = mem.alloc_host((16,), "pads", torch.int64)  # the name is free again
    assert t.shape == (16,) and len(_segments(mem)) == 1
    mem.close()
    assert _segments(mem) == []


def _die_holding_a_segment(ctx):
    mem = PeerMemory.create(ctx)
    mem.alloc_host((16,), "pads", torch.int64)
    path = os.path.join(peer.SHM_DIR, f"cpkv-{mem.token}-r{ctx.rank}-pads")
    assert os.path.exists(path) and mem.token.startswith(f"{os.getppid()}x")  # else this rank raises instead
    ctx.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit handler runs: the segment stays, until the parent goes
    ctx.barrier()
    return ctx.rank


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_segments_of_a_killed_rank_are_removed_by_the_launcher():
    with pytest.raises(RankFailure, match=r"^rank 1 was killed by SIGKILL"):
        launch(_die_holding_a_segment, 2, timeout_s=300, grace_s=0.5)
    assert [f for f in os.listdir(peer.SHM_DIR) if f.startswith(f"cpkv-{os.getpid()}x")] == []


def test_a_stop_during_a_rank_start_is_delivered_after_it():
    """SIGTERM while a rank process is being started (its bootstrap data half written) would leave the child an
    EOFError traceback on the shared stderr; the launcher defers stops over each start and delivers them after."""
    import signal

    from cpkv.dist.launch import stops_deferred

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda s, _f: got.append(s))
    try:
        with stops_deferred():
            signal.raise_signal(signal.SIGTERM)
            assert got == []  # recorded, not handled, inside
        assert got == [signal.SIGTERM]  # the handler that was there gets it on the way out
        assert signal.getsignal(signal.SIGTERM) is not None and got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
