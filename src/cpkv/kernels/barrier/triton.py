"""Counting barrier on the GPU stream: one single-program kernel per round, arrive then a bounded wait.

    peers  : int64 [cp]      device addresses of every rank's signal pad (this rank's own included)
    pad    : int64 [cp]      this rank's pad; cell s = rounds rank s has arrived at (written by s only)
    state  : int64 [2 + cp]  this rank's, local: [0] rounds launched so far, [1] first round that timed
                             out (0: none), [2 + s] rank s's count seen then

Round k = state[0] + 1 (kept on the device, so a launch has no per-round argument and can sit in a CUDA
graph): store k into cell ``rank`` of every pad (release, system scope: the stream's earlier writes
become visible first), then poll the own pad (acquire, system scope) until every cell is >= k, for at
most ``timeout_ns`` of the GPU's global timer. On timeout the kernel records the round and the counts
in ``state`` and returns; later rounds then only arrive (no more waiting), and the host turns the record
into ``ComposeTimeout`` when it next checks (``cpkv.compose.barrier.DeviceBarrier.check``). Counters only
grow, so the pads are never reset and a rank one round ahead cannot release a slower one early (the
host barrier's argument, ``cpkv.compose.barrier``). The reference semantics are the host barrier's;
the GPU tests compare against round-stamped data, not a torch reimplementation (a spin has none).

Ranks sharing one GPU time-slice it: the wait is bounded and polls one small pad, so a rank's spin only
costs the others the rest of its time slice.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch


@lru_cache(maxsize=1)
def load() -> Any:
    """The Triton kernel, compiled on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _poll(PAD, offs, live, k):
        seen = tl.atomic_add(PAD + offs, tl.zeros_like(offs).to(tl.int64), mask=live, sem="acquire", scope="sys")
        return tl.where(live, seen, k)

    @triton.jit
    def _barrier(PEERS, PAD, STATE, timeout_ns, RANK: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        live = offs < CP
        k = tl.load(STATE) + 1
        tl.store(STATE, k)
        pads = tl.load(PEERS + offs, mask=live, other=0).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(pads + RANK, tl.zeros_like(offs).to(tl.int64) + k, mask=live, sem="release", scope="sys")
        if tl.load(STATE + 1) == 0:
            t0 = _now()
            seen = _poll(PAD, offs, live, k)
            elapsed = t0 - t0
            while (tl.min(seen, axis=0) < k) & (elapsed < timeout_ns):
                seen = _poll(PAD, offs, live, k)
                elapsed = _now() - t0
            if tl.min(seen, axis=0) < k:
                tl.store(STATE + 2 + offs, seen, mask=live)
                tl.store(STATE + 1, k)

    return _barrier


def block_for(cp: int) -> int:
    """Lanes of the kernel: the next power of two >= cp (at least 2)."""
    b = 2
    while b < cp:
        b *= 2
    return b


def barrier_launcher(peers: torch.Tensor, pad: torch.Tensor, state: torch.Tensor, rank: int,
                     timeout_ns: int) -> Callable[[], None]:
    """A zero-argument function that launches one barrier round on the current stream.

    ``peers`` int64 [cp] addresses, ``pad`` int64 [cp] and ``state`` int64 [2 + cp] on one CUDA device
    (see the module docstring). Compiled here, once; a call is one C-level launch of the compiled kernel
    (Triton's JIT launcher costs tens of µs of host time per call), falling back to the JIT launcher if
    a direct launch fails. The launcher keeps the tensors alive."""
    cp = peers.numel()
    args = (peers, pad, state, int(timeout_ns))
    const = dict(RANK=rank, CP=cp, BLOCK=block_for(cp))
    kernel = load()
    with torch.cuda.device(pad.device):
        compiled = kernel.warmup(*args, **const, grid=(1,), num_warps=1)
        run = compiled.run  # loads the binary on first use
    raw = (peers.data_ptr(), pad.data_ptr(), state.data_ptr(), int(timeout_ns), rank, cp, const["BLOCK"])
    current_stream, index = torch._C._cuda_getCurrentRawStream, pad.device.index or 0
    fallback = [False]

    def launch() -> None:
        if not fallback[0]:
            try:
                run(1, 1, 1, current_stream(index), compiled.function, compiled.packed_metadata, None, None, None,
                    *raw)
                return
            except Exception:  # noqa: BLE001 - the JIT launcher from now on
                fallback[0] = True
        kernel[(1,)](*args, **const, num_warps=1)
    launch.tensors = (peers, pad, state)
    launch.direct = lambda: not fallback[0]  # False once the JIT launcher took over
    return launch
