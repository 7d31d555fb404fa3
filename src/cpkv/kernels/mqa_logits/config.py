"""Launch configuration of the indexer logits kernels (shared by the Triton and the Gluon kernel; PagedLogitsConfig:
the decode kernel over paged rows). No Triton import."""
from __future__ import annotations

from dataclasses import dataclass

VARIANTS = ("gluon", "lanes")
PAGED_VARIANTS = ("runs", "keys")


@dataclass(frozen=True)
class LogitsConfig:
    """Tile shape of the Triton kernel: N = BQ * H query rows per program (tokens x heads), BLOCK_S keys per
    tile, SPAN tiles; ``tma``: key tiles by TMA when k allows it (_tma_ready), else pointer loads.
    ``variant``: "gluon" (the Gluon kernel where it applies, else the Triton kernel with these fields) or
    "lanes" (always the Triton kernel). ``gluon_span`` / ``gluon_stages``: the Gluon kernel's 64-key tiles per
    program and TMA ring depth; an unclean call given a plan's work items (cpkv.kernels.mqa_logits.work)
    launches one program per non-empty item, span by span, the last wave cut into span // ``gluon_split``
    tiles."""

    n_rows: int = 128
    block_s: int = 128
    span: int = 8
    num_warps: int = 8
    num_stages: int = 3
    maxnreg: int | None = 128
    variant: str = "gluon"
    tma: bool = True
    gluon_span: int = 64
    gluon_stages: int = 2
    gluon_split: int = 4

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown logits variant {self.variant!r}; expected one of {', '.join(VARIANTS)}")
        if self.gluon_split < 1:
            raise ValueError(f"gluon split: expected >= 1, got {self.gluon_split}")

    def bq(self, heads: int) -> int:
        return max(self.n_rows // heads, 1)


@dataclass(frozen=True)
class PagedLogitsConfig:
    """Tile shape of the paged decode kernel (cpkv.kernels.mqa_logits.paged): BLOCK_S keys per tile (a power of
    two >= 16), SPAN tiles per program, the launch's warps, pipeline stages and register cap (None: ptxas's
    choice). ``variant``: "runs" (a tile read as runs of keys inside one page: the table read once per run) or
    "keys" (the table read once per key; ``paged.KEYS_CONFIG`` is its tile shape)."""

    block_s: int = 128
    span: int = 1
    num_warps: int = 4
    num_stages: int = 1
    variant: str = "runs"
    maxnreg: int | None = 64

    def __post_init__(self) -> None:
        if self.block_s < 16 or self.block_s & (self.block_s - 1) or self.span < 1:
            raise ValueError(f"paged logits config: block_s a power of two >= 16 and span >= 1, got {self}")
        if self.variant not in PAGED_VARIANTS:
            raise ValueError(f"unknown paged logits variant {self.variant!r}; expected one of "
                             f"{', '.join(PAGED_VARIANTS)}")
