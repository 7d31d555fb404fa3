"""Triton launches without the JIT launcher's per-call host work.

    fast(kernel)[grid](*args, **kwargs)     launches what ``kernel[grid](*args, **kwargs)`` launches, on the
                                            current stream, and returns the compiled kernel

A layer of the model launches ~25 Triton kernels. Triton 3.6's JIT launcher spends ~28 µs of host time on each
(binding, a cache key built from ``str`` of the options, launch metadata for the hook chain, the hook chain
itself), where the launch proper, the compiled kernel's C launcher, costs a few µs. On a cached turn at cp 8
the host, not the GPU, sets the pace, so that difference is the layer's critical path.

How: the arguments go through Triton's own binder (the function it generates per kernel over its C
specialiser: the argument values in order, with defaults, and each argument's specialisation: type, 16-byte
alignment, ``== 1``, divisible by 16), so the specialisation is exactly the one the JIT launcher computes,
never one of ours. The compiled kernel is found under (device, specialisation, options) in a dict kept per
kernel, filled by the first JIT launch of each key, and launched through its C launcher. A kernel compiles and
launches through the JIT launcher the first time a key is seen; every later launch of the key is direct.

The JIT launcher runs instead (same results, its host cost) where a direct launch would skip something:
launch hooks installed (profilers read the launch metadata), pre-run hooks, objects that are not compiled JIT
functions (the interpreter's kernels, autotuners), and, for the rest of the process, after a direct launch
has failed once. Triton's global debug and instrumentation knobs are taken as fixed for the process (the JIT
launcher reads them per launch).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

ENABLED = [True]  # cleared for good when a direct launch fails (every launch then goes through Triton's JIT)


def fast(kernel: Any) -> Any:
    """``kernel`` (a ``triton.jit`` / ``gluon.jit`` function) wrapped for direct launches: index it with a grid
    and call it as the kernel itself. Anything else (the interpreter's kernels, autotuners, a stand-in for a
    missing Triton) is returned as it is. The wrapper is made once per kernel and kept on it."""
    if not hasattr(kernel, "device_caches"):
        return kernel
    wrapper = kernel.__dict__.get("_cpkv_fast")
    if wrapper is None:
        wrapper = kernel.__dict__["_cpkv_fast"] = Fast(kernel)
    return wrapper


def hooks_idle() -> bool:
    """Whether no Triton launch hook is installed (direct launches skip the hook chain and its metadata)."""
    from triton import knobs
    rt = knobs.runtime
    return _no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)


def direct_ok() -> bool:
    """Whether launches may bypass Triton's JIT launcher now: no launch hook, no earlier failure."""
    return ENABLED[0] and hooks_idle()


def _no_hook(hook: Any) -> bool:
    """None (Triton < 3.5), or an empty hook chain (Triton >= 3.5 always installs a ``HookChain``)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def current_device() -> int:
    """The current CUDA device's index (what Triton's driver reports; a launch has initialised CUDA)."""
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    """The raw handle of ``device``'s current stream."""
    return torch._C._cuda_getCurrentRawStream(device)


class Fast:
    """A JIT function's direct launcher (module docstring); ``hits``: (device, specialisation, options) ->
    compiled kernel."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.hits: dict[tuple, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self.run, grid)

    def __getattr__(self, name: str) -> Any:  # warmup, arg_names, ...: the kernel's own
        return getattr(self.kernel, name)

    def run(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        """Launch on ``grid`` (a tuple of 1-3 ints, or a function of the bound arguments) and return the compiled
        kernel."""
        kernel = self.kernel
        if not (ENABLED[0] and hooks_idle()) or kernel.pre_run_hooks:
            return kernel.run(*args, grid=grid, warmup=False, **kwargs)
        dev = current_device()
        caches = kernel.device_caches.get(dev)  # a defaultdict: .get creates nothing (the JIT launch will)
        if caches is None:
            return kernel.run(*args, grid=grid, warmup=False, **kwargs)
        params, spec, options = caches[4](*args, **kwargs)  # Triton's binder
        try:
            key = (dev, tuple(spec), tuple(options.items()))
            compiled = self.hits.get(key)
        except TypeError:  # an unhashable constexpr: nothing to key on
            return kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if compiled is None:
            compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if compiled is not None and not hasattr(compiled, "result"):
                self.hits[key] = compiled
            return compiled
        if callable(grid):
            grid = grid(params)
        n = len(grid)
        try:
            compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, current_stream(dev),
                         compiled.function, compiled.packed_metadata, None, None, None, *params.values())
        except Exception:  # noqa: BLE001 - Triton's JIT launcher for good from here (it raises a real error again)
            ENABLED[0] = False
            return kernel.run(*args, grid=grid, warmup=False, **kwargs)
        return compiled
