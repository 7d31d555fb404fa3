"""Page gather: copy whole pages as bytes from a table of sources (pools, stagings) into a dense buffer.

    out    : uint8 [n_out, page_bytes]          destination pages (a dense buffer viewed by pages)
    dest   : int [n]                            destination page of entry i (int32 or int64)
    src    : int [n]                            source index of entry i in [0, n_src), -1 = zero fill, or
                                                SKIP (-2): entry i writes nothing
    page   : int [n]                            page id inside that source
    Triton: bases   int64 [n_src]  byte address of each source's page 0 (any process-mapped memory:
                                   this rank's pools, peers' pools and stagings mapped through IPC)
    torch:  sources list of n_src uint8 [n_pages_s, page_bytes] tensors

    out[dest[i]] = source[src[i]][page[i]]      (all page_bytes bytes), or zeros where src[i] == -1 (out[dest[i]]
                                                untouched where src[i] == SKIP: a static-size gather whose tail
                                                rows are padding nobody reads, e.g. the expert exchange's)

The Triton kernel moves 16-byte vectors when ``page_bytes`` and every address are multiples of 16
(4-byte words otherwise, bytes as a last resort). A unit is one block of one entry's page; a program
copies one unit with no inner loop, so all of a thread's loads are in flight before its stores; no cache hints.
``cpkv bench compose`` (``kernel_bench``) sweeps its block and warp shapes against ``copy_`` in device time.
No persistent programs and no cache hints: both were slower than this form (BENCHMARKS.md).
Triton is imported lazily; :func:`cpkv.kernels.page_gather.ref.page_gather_ref` is the reference and the CPU path.
"""
from __future__ import annotations

import functools
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

# one program per whole page (block >= the page: 41,984-byte token pages and 8,448-byte index pages each fit
# one 16,384-element block), 8 warps: the fastest shape (BENCHMARKS.md, ``cpkv bench compose``: near copy_'s rate)
DEFAULT_CONFIG = {"block": 16384, "num_warps": 8}
# compose gathers a layer's two KV kinds as two launches of this kernel, each at DEFAULT_CONFIG: one kernel doing
# both kinds would hold its larger segment's registers, so the index pages would run at token-page occupancy


@lru_cache(maxsize=1)
def load() -> Any:
    """The Triton kernel, compiled on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def _unit(OUT, BASES, DEST, SRC, PAGE, out_addr, u, n, PAGE_ELEMS: tl.constexpr, ELEM_BYTES: tl.constexpr,
              VEC: tl.constexpr, BLOCK: tl.constexpr):
        # unit u = (entry i = u % n, block c = u // n): elements [c * BLOCK, (c + 1) * BLOCK) of entry i's
        # page; every load of a thread is issued before its stores (no inner loop)
        i = u % n
        offs = _offs(u, n, BLOCK)
        mask = offs < PAGE_ELEMS
        s = tl.load(SRC + i)
        out_page = OUT + tl.load(DEST + i).to(tl.int64) * PAGE_ELEMS
        if s >= 0:
            addr = tl.load(BASES + s) + tl.load(PAGE + i).to(tl.int64) * (PAGE_ELEMS * ELEM_BYTES)
            # element offset from OUT, written as q * VEC so the compiler knows its 16-byte alignment
            delta = ((addr - out_addr) // (ELEM_BYTES * VEC)) * VEC
            x = tl.load(OUT + delta + offs, mask=mask)
            tl.store(out_page + offs, x, mask=mask)
        elif s == -1:
            tl.store(out_page + offs, tl.zeros([BLOCK], dtype=OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _offs(u, n, BLOCK: tl.constexpr):
        # unit u's element offsets inside its page (block u // n), BLOCK-aligned and contiguous
        offs = (u // n) * BLOCK + tl.arange(0, BLOCK)
        return tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)

    # the kernels find their helpers as module globals (also in TRITON_INTERPRET)
    globals()["_unit"] = _unit
    globals()["_offs"] = _offs

    @triton.jit
    def _page_gather(OUT, BASES, DEST, SRC, PAGE, out_addr, n, n_units, PAGE_ELEMS: tl.constexpr,
                     ELEM_BYTES: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
        # 1-D grid of n_units programs, entry-fastest: consecutive programs copy the same block of different
        # entries' pages (faster than page-major order on H200)
        _unit(OUT, BASES, DEST, SRC, PAGE, out_addr, tl.program_id(0), n, PAGE_ELEMS, ELEM_BYTES, VEC, BLOCK)

    return _page_gather


@lru_cache(maxsize=256)
def launch_params(page_bytes: int, aligned16: bool, block: int) -> tuple[torch.dtype, int, int, int, int, int]:
    """(element dtype, element bytes, elements per 16-byte vector, page elements, block, blocks per page).

    16-byte vectors need ``page_bytes`` and every address to be multiples of 16; 4-byte words need
    multiples of 4; bytes otherwise."""
    if page_bytes % 16 == 0 and aligned16:
        dtype, ebytes, vec = torch.int32, 4, 4
    elif page_bytes % 4 == 0:
        dtype, ebytes, vec = torch.int32, 4, 1
    else:
        dtype, ebytes, vec = torch.uint8, 1, 1
    elems = page_bytes // ebytes
    block = min(block, _pow2_at_least(elems))
    return dtype, ebytes, vec, elems, block, -(-elems // block)


_COMPILED: dict[tuple, Any] = {}
FAST_LAUNCH = [True]  # cleared for good if a direct launch of a compiled kernel ever fails


def page_gather_triton(out: torch.Tensor, bases: torch.Tensor, dest: torch.Tensor, src: torch.Tensor,
                       page: torch.Tensor, *, aligned16: bool = True, config: dict | None = None) -> None:
    """Triton gather. ``bases``: int64 [n_src] device tensor of byte addresses; ``aligned16``: every source
    address is a multiple of 16 (``out`` is checked here). Index tensors: any integer dtype. ``config``
    (missing keys: DEFAULT_CONFIG's): block (elements per unit), num_warps. See the module docstring for the
    semantics."""
    if dest.numel() == 0:
        return
    launch = _Launch(out, bases, dest, src, page, aligned16, config)
    compiled = _COMPILED.get(launch.key)
    if compiled is not None and FAST_LAUNCH[0]:
        try:
            return _launch(compiled, launch.grid, launch.args, out.device)
        except Exception:  # noqa: BLE001 - fall back to the JIT launcher for good
            FAST_LAUNCH[0] = False
    _COMPILED[launch.key] = launch.jit()


def gather_launcher(out: torch.Tensor, bases: torch.Tensor, dest: torch.Tensor, src: torch.Tensor,
                    page: torch.Tensor, *, aligned16: bool = True, config: dict | None = None) -> Callable[[], None]:
    """A zero-argument function that runs ``page_gather_triton(out, bases, dest, src, page, ...)`` on the
    current stream, for a gather repeated with the same tensors (a compose plan's entries, every layer).

    Everything but the stream is resolved here, once: the compiled kernel (compiled now, without a
    launch, if needed), the grid, and the arguments as raw addresses, so a call is one C-level launch.
    The launcher keeps its tensors alive. Falls back to ``page_gather_triton`` per call where a direct
    launch is not possible (launch hooks installed, or direct launches disabled after a failure)."""
    if dest.numel() == 0:
        return _noop
    if not _direct_launch_ok():
        return functools.partial(page_gather_triton, out, bases, dest, src, page, aligned16=aligned16, config=config)
    launch = _Launch(out, bases, dest, src, page, aligned16, config)
    return _direct(launch.key, lambda: launch.jit(warmup=True), launch.grid, launch.args, launch.args[:5], out.device)


def relaunch_with(launch: Callable[[], None], out: torch.Tensor, bases: torch.Tensor) -> Callable[[], None] | None:
    """A launcher equal to ``launch`` (from :func:`gather_launcher`) but writing into ``out`` from the sources
    ``bases``: the same entries, kernel and grid, so nothing is re-resolved (a few µs, for the same gather into
    another layer's pages or from another layer's sources). None when ``launch`` is not a direct launch or a new
    address would change what the kernel was specialised on (16-byte alignment, page bytes): build a full
    launcher then."""
    raw = getattr(launch, "raw", None)
    if raw is None:
        return None
    addr, table = out.data_ptr(), bases.data_ptr()
    if (out.shape[-1] * out.element_size() != launch.page_bytes or (addr & 15) != (raw[0] & 15)
            or (table & 15) != (raw[1] & 15) or bases.dtype is not torch.int64):
        return None
    # raw: (OUT, BASES, DEST, SRC, PAGE, out_addr, ...): the output's address is passed twice
    return _fast(launch.spec, (addr, table, *raw[2:5], addr, *raw[6:]), (*launch.tensors, out, bases),
                 launch.page_bytes)


def _direct_launch_ok() -> bool:
    """Whether launches may bypass Triton's JIT launcher (no launch hooks installed, no earlier failure)."""
    from triton import knobs
    return FAST_LAUNCH[0] and all(_no_hook(h) for h in (knobs.runtime.launch_enter_hook,
                                                          knobs.runtime.launch_exit_hook))


def _no_hook(hook: Any) -> bool:
    """None (Triton < 3.5), or an empty hook chain (Triton >= 3.5 always installs a ``HookChain``)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


def _direct(key: tuple, compile_fn: Callable[[], Any], grid: tuple[int, int, int], args: tuple, keep: tuple,
            device: torch.device) -> Callable[[], None]:
    """A zero-argument launch of the kernel compiled under ``key`` (``compile_fn`` compiles it if needed)
    with ``args`` as raw values; ``keep`` holds the tensors those addresses point into (out, bases, dest, src,
    page)."""
    with torch.cuda.device(device):  # the module is loaded into the current device's context
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = _COMPILED[key] = compile_fn()
        run = compiled.run  # loads the binary on first use
    raw = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in args)
    return _fast((run, grid, compiled.function, compiled.packed_metadata, device.index or 0), raw, keep,
                 keep[0].shape[-1] * keep[0].element_size())


def _fast(spec: tuple, raw: tuple, keep: tuple, page_bytes: int) -> Callable[[], None]:
    """The zero-argument launch of ``spec`` (run, grid, function, metadata, device index) with ``raw``;
    ``page_bytes``: the output's page size (what ``relaunch_with`` must keep)."""
    run, (g0, g1, g2), function, meta, index = spec
    current_stream = torch._C._cuda_getCurrentRawStream

    def fast() -> None:
        run(g0, g1, g2, current_stream(index), function, meta, None, None, None, *raw)
    fast.tensors = keep  # the launch holds raw addresses: keep what they point to alive
    fast.spec, fast.raw, fast.page_bytes = spec, raw, page_bytes
    return fast


def _noop() -> None:
    return None


class _Launch:
    """One gather's launch: grid, positional arguments, the compile-cache key, and how to JIT it."""

    __slots__ = ("grid", "args", "key", "warps")

    def __init__(self, out: torch.Tensor, bases: torch.Tensor, dest: torch.Tensor, src: torch.Tensor,
                 page: torch.Tensor, aligned16: bool, config: dict | None) -> None:
        n = dest.numel()
        if set(config or ()) - set(DEFAULT_CONFIG):
            raise ValueError(f"page gather config: expected keys among {sorted(DEFAULT_CONFIG)}, got {sorted(config)}")
        cfg = {**DEFAULT_CONFIG, **(config or {})}
        addr = out.data_ptr()
        dtype, ebytes, vec, elems, block, nblocks = launch_params(out.shape[-1], aligned16 and addr % 16 == 0,
                                                                  cfg["block"])
        units = n * nblocks
        self.grid = (units, 1, 1)
        self.args = (out.view(dtype), bases, dest, src, page, addr, n, units, elems, ebytes, vec, block)
        self.warps = cfg["num_warps"]
        # what Triton specialises on: dtypes, constexprs, 16-byte alignment of pointers, ints == 1 or % 16
        self.key = (self.warps, out.device.index, dest.dtype, src.dtype, page.dtype, *self.args[8:],
                    *(t.data_ptr() % 16 == 0 for t in self.args[:5]), addr % 16 == 0, n == 1, n % 16 == 0,
                    units == 1, units % 16 == 0)

    def jit(self, warmup: bool = False) -> Any:
        """Compile through Triton's JIT (and launch, unless ``warmup``); returns the compiled kernel."""
        a = self.args
        kernel = load()
        kw = dict(PAGE_ELEMS=a[8], ELEM_BYTES=a[9], VEC=a[10], BLOCK=a[11], num_warps=self.warps)
        if warmup:
            return kernel.warmup(*a[:8], grid=self.grid, **kw)
        return kernel[self.grid](*a[:8], **kw)


def _launch(compiled: Any, grid: tuple[int, int, int], args: tuple, device: torch.device) -> None:
    """Launch an already compiled kernel directly (what Triton's JIT launcher does after its cache lookup,
    without re-binding and re-specialising the arguments: ~30 us -> a few us of host time)."""
    from triton import knobs
    stream = torch.cuda.current_stream(device).cuda_stream
    meta = compiled.launch_metadata(grid, stream, *args)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, meta,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
