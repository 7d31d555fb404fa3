"""Per-rank KV pools: raw ``uint8`` pages of every layer and both kinds (docs/design.md, byte formats and pools).

    pool[kind]: uint8 [layers of kind, num_pages, page_size * row_bytes]
    rows(layer, kind): uint8 [num_pages * page_size, row_bytes]     (a view; token t of page p is row p*P + t)

Token rows exist on every layer, index rows only on the model's full indexer layers (a shared layer
reuses an earlier layer's top-k and keeps none): ``slot(layer, kind)`` is the layer's index in
``pool[kind]``.

Typed field views (``values``/``scales``/``rope``) reinterpret byte columns of the rows, so fp8 payloads
move as bytes on any device: never ``index_select`` / ``index_copy_`` a float8 tensor, move uint8 rows.
Page 0 is reserved. Storage comes from ``alloc`` so transports can place pools in shared or peer memory.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from cpkv.config import KINDS, ModelConfig, RowFormat
from cpkv.errors import ComposeError

Alloc = Callable[[tuple[int, ...], str], torch.Tensor]  # (shape, name) -> uint8 tensor


def torch_alloc(device: torch.device | str) -> Alloc:
    def alloc(shape: tuple[int, ...], name: str) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.uint8, device=device)
    return alloc


class KVPool:
    """One rank's pool: every layer, both kinds (which pages are in use is the KV-cache manager's business)."""

    def __init__(self, model: ModelConfig, num_pages: int, page_size: int, device: torch.device | str = "cpu",
                 alloc: Alloc | None = None, num_layers: int | None = None) -> None:
        if num_layers is not None and num_layers != model.num_layers:
            model = model.with_layers(num_layers)
        self.model, self.num_pages, self.page_size = model, num_pages, page_size
        self.num_layers = model.num_layers
        self.slots = {k: {layer: i for i, layer in enumerate(model.layers_of(k))} for k in KINDS}
        # the next layer holding rows of the kind (prefetch targets), None after the last
        self.next_layer = {k: dict(zip(model.layers_of(k), model.layers_of(k)[1:] + (None,))) for k in KINDS}
        alloc = alloc or torch_alloc(device)
        self.buffers = {
            kind: alloc((len(self.slots[kind]), num_pages, page_size * model.row_bytes(kind)), f"pool.{kind}")
            for kind in KINDS
        }

    def kinds_at(self, layer: int) -> tuple[str, ...]:
        """The kinds layer ``layer`` holds rows of."""
        return self.model.kinds_at(layer)

    def slot(self, layer: int, kind: str) -> int:
        """Index of ``layer`` in ``buffers[kind]`` (ComposeError when the layer keeps no rows of ``kind``)."""
        try:
            return self.slots[kind][layer]
        except KeyError:
            raise ComposeError(f"layer {layer} keeps no {kind} rows (a shared indexer layer has none)") from None

    @property
    def device(self) -> torch.device:
        return self.buffers["token"].device

    def row_bytes(self, kind: str) -> int:
        return self.model.row_bytes(kind)

    def pages(self, layer: int, kind: str) -> torch.Tensor:
        """uint8 [num_pages, page_size * row_bytes] of one layer."""
        return self.buffers[kind][self.slot(layer, kind)]

    def rows(self, layer: int, kind: str) -> torch.Tensor:
        """uint8 [num_pages * page_size, row_bytes] of one layer."""
        return self.pages(layer, kind).view(self.num_pages * self.page_size, self.row_bytes(kind))

    def write_rows(self, layer: int, kind: str, row_ids: torch.Tensor, data: torch.Tensor) -> None:
        """rows[row_ids] = data; ``data`` uint8 [n, row_bytes] (row id = page * page_size + offset)."""
        if data.dtype != torch.uint8 or data.shape[-1] != self.row_bytes(kind):
            raise ComposeError(f"{kind} rows must be uint8 [n, {self.row_bytes(kind)}], got {data.dtype} "
                               f"{list(data.shape)}")
        self.rows(layer, kind).index_copy_(0, row_ids, data)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


def page_row_ids(page_ids: Sequence[int], page_size: int, counts: Sequence[int] | None = None) -> list[int]:
    """Row ids of the first ``counts[i]`` tokens (all of them by default) of each page."""
    out: list[int] = []
    for i, p in enumerate(page_ids):
        n = page_size if counts is None else counts[i]
        out.extend(range(p * page_size, p * page_size + n))
    return out


def field_views(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Typed views of uint8 rows [n, row_bytes]: fp8 values [n, fp8_bytes], float32 scales [n, k], bf16 rope.

    Views share storage with ``rows`` (no copy). ``rope`` is None when the format has no rope part.
    """
    if rows.dtype != torch.uint8 or rows.shape[-1] != fmt.row_bytes:
        raise ComposeError(f"rows must be uint8 [..., {fmt.row_bytes}], got {rows.dtype} {list(rows.shape)}")
    values = rows[..., : fmt.fp8_bytes].view(torch.float8_e4m3fn)
    scales = rows[..., fmt.scale_offset: fmt.rope_offset].view(torch.float32)
    rope = rows[..., fmt.rope_offset:].view(torch.bfloat16) if fmt.rope_dims else None
    return values, scales, rope
