"""Launch configuration of the indexer logits kernels (shared by the Triton and the Gluon kernel). No Triton import."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogitsConfig:
    """Tile shape: N = BQ * H query rows per program (tokens x heads), BLOCK_S keys per tile, SPAN tiles.
    variant: "gluon" (mqa_logits_gluon where it applies, else "lanes" with these fields), "lanes"
    (mqa_logits_kernel_lanes, shuffle-free head sum) or "base" (mqa_logits_kernel); tma: lanes only,
    key tiles by TMA when k allows it (_tma_ready), else pointer loads. gluon_span / gluon_stages /
    gluon_maxnreg / gluon_warpgroups / gluon_pipe: the Gluon kernel's 64-key tiles per program, TMA ring
    depth, register cap, warpgroups sharing each key tile (1 or 2) and accumulators per program (2: the
    next tile's dot overlaps this tile's epilogue; 1: no overlap in a program, ~117 registers so four
    programs per SM overlap each other); gluon_box: 64-key tiles per TMA box (2 needs pipe 1).
    gluon_items: an unclean call given a plan's work items (cpkv.kernels.mqa_logits.work) launches one program per
    non-empty item, span by span, the last wave cut into span // gluon_split tiles; otherwise the grid
    (spans, token groups), or (token groups, spans) with gluon_t_major.
    Lanes with TMA, 8 warps, 128-key tiles was the fastest Triton variant measured on an H200
    (2026-11-29, `cpkv bench indexer --variants`): 0.58-0.62 of the fp8 GEMM rate vs 0.48-0.53 for
    "base"."""

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
    gluon_maxnreg: int | None = None
    gluon_warpgroups: int = 1
    gluon_pipe: int = 1
    gluon_box: int = 2
    gluon_items: bool = True
    gluon_t_major: bool = False
    gluon_split: int = 4

    def __post_init__(self) -> None:
        check_gluon_shape(self.gluon_warpgroups, self.gluon_pipe, self.gluon_box)
        if self.gluon_split < 1:
            raise ValueError(f"gluon split: expected >= 1, got {self.gluon_split}")

    def bq(self, heads: int) -> int:
        return max(self.n_rows // heads, 1)


def check_gluon_shape(warpgroups: int, pipe: int, box: int) -> None:
    """The Gluon kernel's structural choices that exist: 1 or 2 warpgroups, 1 or 2 accumulators, boxes of
    1 or 2 tiles (2 only with one accumulator); ValueError naming the field otherwise."""
    if warpgroups not in (1, 2):
        raise ValueError(f"gluon warpgroups: expected 1 or 2, got {warpgroups}")
    if pipe not in (1, 2):
        raise ValueError(f"gluon pipe (accumulators per program): expected 1 or 2, got {pipe}")
    if box not in (1, 2) or (box == 2 and pipe != 1):
        raise ValueError(f"gluon box: expected 1, or 2 with pipe 1; got box={box}, pipe={pipe}")
