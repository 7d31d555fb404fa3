"""Direct Triton launches (``cpkv.kernels.launch.fast``): Triton's own binder on a real JIT function, with the JIT
launch and the compiled kernel replaced by recorders, so it runs wherever Triton imports (no GPU). Checked: a key
seen once launches directly with the arguments in declared order (defaults filled), every change Triton
specialises on (alignment, an int equal to 1 or divisible by 16, a dtype, a constexpr, an option) goes back to the
JIT launcher, hooks and failures fall back."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import triton.language as tl  # noqa: E402
from cpkv.kernels import launch  # noqa: E402


@triton.jit
def _kernel(X, Y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _Compiled:
    def __init__(self, tag: int) -> None:
        self.tag, self.calls = tag, []
        self.function, self.packed_metadata = f"fn{tag}", f"meta{tag}"

    def run(self, *args) -> None:
        self.calls.append(args)


class _Jit:
    """Stands in for the JIT launch: a new compiled kernel per call, recorded with its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.made: list[_Compiled] = []

    def __call__(self, *args, grid, warmup, **kwargs):
        self.calls.append((grid, args, kwargs))
        self.made.append(_Compiled(len(self.made)))
        return self.made[-1]


@pytest.fixture
def kern(monkeypatch):
    """A fresh JIT function's launcher with device 0's binder in place and the JIT launch recorded."""
    k = triton.jit(_kernel.fn)
    k.device_caches[0] = ({}, {}, None, BaseBackend, create_function_from_signature(k.signature, k.params,
                                                                                    BaseBackend))
    jit = _Jit()
    monkeypatch.setattr(k, "run", jit)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda d: 7000 + d)
    monkeypatch.setattr(launch, "ENABLED", [True])
    return k, jit


def _buffers():
    x = torch.zeros(64, dtype=torch.float32)
    return x, torch.zeros(64, dtype=torch.float32)


def test_second_launch_of_a_key_is_direct_with_every_argument_in_order(kern):
    k, jit = kern
    x, y = _buffers()
    first = launch.fast(k)[(5,)](x, y, 37, 0.5, BLOCK=64, num_warps=4)
    again = launch.fast(k)[(5, 2)](x, y, 37, 0.5, BLOCK=64, num_warps=4)
    assert launch.fast(k) is launch.fast(k)  # one wrapper per kernel
    assert len(jit.calls) == 1 and first is again is jit.made[0]
    (call,) = first.calls
    assert call[:3] == (5, 2, 1) and call[3] == 7000 and call[4:6] == ("fn0", "meta0")
    assert call[6:9] == (None, None, None)  # no launch metadata, no hooks
    # X, Y, n, scale, BLOCK, FLAG (its default): every declared parameter, in order
    assert call[9:] == (x, y, 37, 0.5, 64, False)


def test_every_specialisation_change_goes_back_to_the_jit_launcher(kern):
    k, jit = kern
    x, y = _buffers()
    run = launch.fast(k)[(1,)]
    cases = [
        ((x, y, 37, 0.5), dict(BLOCK=64, num_warps=4)),
        ((x, y, 37, 0.5), dict(BLOCK=64, num_warps=8)),  # an option
        ((x, y, 37, 0.5), dict(BLOCK=128, num_warps=4)),  # a constexpr
        ((x, y, 37, 0.5), dict(BLOCK=64, FLAG=True, num_warps=4)),  # a defaulted constexpr given
        ((x[1:], y, 37, 0.5), dict(BLOCK=64, num_warps=4)),  # a pointer no longer 16-byte aligned
        ((x.half(), y, 37, 0.5), dict(BLOCK=64, num_warps=4)),  # a dtype
        ((x, y, 1, 0.5), dict(BLOCK=64, num_warps=4)),  # an int equal to 1
        ((x, y, 48, 0.5), dict(BLOCK=64, num_warps=4)),  # an int divisible by 16
        ((x, y, 2**40 + 3, 0.5), dict(BLOCK=64, num_warps=4)),  # an int past int32
    ]
    for args, kw in cases:
        run(*args, **kw)
    assert len(jit.calls) == len(cases) and not any(c.calls for c in jit.made)
    for args, kw in cases:  # each key seen: all direct now, each with its own compiled kernel
        run(*args, **kw)
    assert len(jit.calls) == len(cases) and [len(c.calls) for c in jit.made] == [1] * len(cases)
    # what Triton does not specialise on changes nothing: another aligned buffer, another int of the same kind,
    # another float
    x2, _ = _buffers()
    run(x2, y, 53, 2.0, BLOCK=64, num_warps=4)
    assert len(jit.calls) == len(cases) and len(jit.made[0].calls) == 2
    assert jit.made[0].calls[-1][9:] == (x2, y, 53, 2.0, 64, False)


def test_hooks_pre_run_hooks_and_a_failure_fall_back(kern, monkeypatch):
    k, jit = kern
    x, y = _buffers()
    run = launch.fast(k)[(1,)]
    run(x, y, 37, 0.5, BLOCK=64)
    run(x, y, 37, 0.5, BLOCK=64)
    assert len(jit.calls) == 1 and len(jit.made[0].calls) == 1
    from triton import knobs
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton >= 3.5: an empty chain is no hook; an installed one is
        assert launch.hooks_idle()
        seen = []
        hook.add(seen.append)
        try:
            assert not launch.hooks_idle() and not launch.direct_ok()
            run(x, y, 37, 0.5, BLOCK=64)
        finally:
            hook.remove(seen.append)
        assert len(jit.calls) == 2 and len(jit.made[0].calls) == 1
    assert launch._no_hook(None) and not launch._no_hook(print)
    k.pre_run_hooks.append(lambda *a, **kw: None)
    run(x, y, 37, 0.5, BLOCK=64)
    k.pre_run_hooks.clear()
    calls = len(jit.calls)

    def boom(*args):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(jit.made[0], "run", boom)
    run(x, y, 37, 0.5, BLOCK=64)  # the direct launch fails: the JIT launcher runs it, and all later launches
    assert not launch.ENABLED[0] and len(jit.calls) == calls + 1
    run(x, y, 37, 0.5, BLOCK=64)
    assert len(jit.calls) == calls + 2


def test_other_objects_pass_through_and_unseen_devices_use_the_jit_launcher(kern, monkeypatch):
    k, jit = kern
    stand_in = object()
    assert launch.fast(stand_in) is stand_in  # the interpreter's kernels, autotuners, a missing Triton
    monkeypatch.setattr(launch, "current_device", lambda: 3)  # no binder for device 3 yet: the JIT launcher makes it
    x, y = _buffers()
    launch.fast(k)[(1,)](x, y, 37, 0.5, BLOCK=64)
    launch.fast(k)[(1,)](x, y, 37, 0.5, BLOCK=64)
    assert len(jit.calls) == 2 and 3 not in k.device_caches
    grid_of = []
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    launch.fast(k)[(1,)](x, y, 37, 0.5, BLOCK=64)
    launch.fast(k)[lambda p: grid_of.append(p["n"]) or (p["n"],)](x, y, 37, 0.5, BLOCK=64)
    assert grid_of == [37] and jit.made[2].calls[0][:3] == (37, 1, 1)
