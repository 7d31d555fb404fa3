"""The rank launcher: results in rank order, a failed or dead rank named instead of a hang."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cpkv.dist import launch, pick_backend
from cpkv.errors import ConfigError, RankFailure


def _sum_ranks(ctx, offset):
    t = torch.tensor([ctx.rank + 1], dtype=torch.int64)
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": int(t.item()) + offset, "backend": ctx.backend,
            "min": ctx.all_reduce_min(10 - ctx.rank), "objs": ctx.all_gather_object(ctx.rank * 2)}


def _raise_on_one(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    return ctx.rank


def _die_on_zero(ctx):
    if ctx.rank == 0:
        os._exit(7)
    return ctx.rank


def test_launch_returns_results_in_rank_order():
    out = launch(_sum_ranks, 3, args=(100,), timeout_s=120)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"] == 106 and o["world"] == 3 and o["backend"] == "gloo" for o in out)
    assert all(o["min"] == 8 and o["objs"] == [0, 2, 4] for o in out)


def test_a_raising_rank_is_named_with_its_error():
    with pytest.raises(RankFailure, match=r"rank 1 raised ValueError: rank one refuses") as info:
        launch(_raise_on_one, 2, timeout_s=120, grace_s=5)
    assert info.value.results[0] == 0 and info.value.results[1] is None
    assert isinstance(info.value.errors[1], ValueError)


def test_a_dead_rank_is_named_with_its_exit_code():
    with pytest.raises(RankFailure, match=r"rank 0 died with exit code 7") as info:
        launch(_die_on_zero, 2, timeout_s=120, grace_s=5)
    assert info.value.results == [None, 1]


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError, match="world_size"):
        launch(_sum_ranks, 0)
    with pytest.raises(ConfigError, match="'cpu' or 'cuda'"):
        pick_backend("tpu", 2)
    assert pick_backend("cpu", 4) == ("gloo", False)


def test_context_from_env_joins_a_torchrun_style_group(monkeypatch):
    import socket

    from cpkv.dist import context_from_env
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    try:
        ctx = context_from_env("cpu", timeout_s=30)
        assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device.type) == (0, 1, "gloo", "cpu")
        assert ctx.all_reduce_min(5) == 5 and ctx.all_gather_object("x") == ["x"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_context_from_env_needs_torchrun_variables(monkeypatch):
    from cpkv.dist import context_from_env
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="RANK"):
        context_from_env("cpu")


# -- long-lived groups (cpkv serve) ----------------------------------------------------------------
def _echo_until_stop(ctx):
    """Rank 0 reads its inbox and broadcasts each message; every rank reports what it got (rank 0 and 1 must
    agree); "stop" ends the loop, "die" makes rank 1 exit."""
    got = []
    while True:
        msg = ctx.inbox.get(timeout=60) if ctx.rank == 0 else None
        msg = ctx.broadcast_object(msg, src=0)
        if msg == "stop":
            return got
        if msg == "die" and ctx.rank == 1:
            os._exit(9)
        got.append(msg)
        ctx.report((ctx.rank, msg, ctx.all_reduce_max_list([ctx.rank, 5 - ctx.rank])))


def test_a_rank_group_serves_messages_until_stopped():
    import threading

    seen, ended = [], threading.Event()
    from cpkv.dist import RankGroup

    group = RankGroup(_echo_until_stop, 2, args=(), timeout_s=120, on_message=lambda r, m: seen.append(m),
                      on_exit=lambda exc: ended.set())
    group.start()
    for m in ("a", "b"):
        group.send(0, m)
    group.send(0, "stop")
    assert group.join(120) == [["a", "b"], ["a", "b"]]
    assert ended.is_set() and group.failure is None
    assert sorted(seen) == [(0, "a", [1, 5]), (0, "b", [1, 5]), (1, "a", [1, 5]), (1, "b", [1, 5])]


def test_a_dead_rank_of_a_group_is_named_to_on_exit():
    import threading

    from cpkv.dist import RankGroup

    failures, ended = [], threading.Event()
    group = RankGroup(_echo_until_stop, 2, timeout_s=120, grace_s=0.5,
                      on_exit=lambda exc: (failures.append(exc), ended.set()))
    group.start()
    group.send(0, "die")
    assert ended.wait(120)
    assert isinstance(failures[0], RankFailure) and str(failures[0]).startswith("rank 1 died with exit code 9")
    with pytest.raises(RankFailure):
        group.join(10)
    assert not any(p.is_alive() for p in group.spawned.procs)


def _listening_sockets(ctx):
    from listening import listening

    t = torch.ones(1)
    dist.all_reduce(t)  # the gloo pairs are connected: its listeners exist
    ctx.barrier()
    return {"self": listening(os.getpid()), "parent": listening(os.getppid())}


def test_every_listening_socket_of_a_launch_is_on_loopback(monkeypatch):
    """The rendezvous store (torch binds every interface by itself) and gloo's listeners (which bind the hostname's
    address, or GLOO_SOCKET_IFNAME's) are all on 127.0.0.1, even with GLOO_SOCKET_IFNAME naming another interface."""
    from listening import is_loopback, outside_interfaces

    others = outside_interfaces()
    if others:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", others[0])
    out = launch(_listening_sockets, 2, timeout_s=120)
    store = out[0]["parent"]
    assert len(store) == 1 and store == out[1]["parent"], out  # the parent listens once: the store
    assert all(o["self"] for o in out), out  # each rank listens (gloo) ...
    for o in out:
        for addr, _ in o["self"] + o["parent"]:
            assert is_loopback(addr), out  # ... and nothing anywhere leaves loopback
