"""``cpkv layout``: show how a batch's pages split over the CP ranks (prefix owners round-robin)."""
from __future__ import annotations

import argparse

from cpkv.cli import fmt
from cpkv.cli.args import as_flags, flags_of
from cpkv.config import STRATEGIES
from cpkv.layout import BatchLayout, build_layout

HELP = "Lay out a CP batch: per request its pages and writers, per rank its pages and causal work."


MAX_LAYOUT_PAGES = 1 << 20  # pages of one batch's layout (each is an object; --json lists every one)


def parse_req(text: str) -> tuple[int, int]:
    """'PREFIX:EXTEND' -> (prefix, extend), each 0..MAX_TOKENS; argparse turns the error into a usage error
    (exit 2)."""
    from cpkv.cli.args import MAX_TOKENS

    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected PREFIX:EXTEND with two integers (e.g. 4096:1000), got {text!r}")
    prefix, extend = int(parts[0]), int(parts[1])
    if max(prefix, extend) > MAX_TOKENS:  # the low ends are build_layout's to check (named errors)
        raise argparse.ArgumentTypeError(f"expected PREFIX:EXTEND with each in 0..2^24 tokens, got {text[:60]!r}")
    return prefix, extend


parse_req.bounds = (0, 1 << 24)  # type: ignore[attr-defined]
parse_req.range_text = "PREFIX, EXTEND each up to 2^24"  # type: ignore[attr-defined]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a

    p.add_argument("--cp", type=a.sim_ranks, required=True, help="CP group size")
    p.add_argument("--page-size", type=a.page_size, required=True, help="tokens per page (a power of two)")
    p.add_argument("--strategy", default="zigzag", choices=STRATEGIES, help="how current pages split (default zigzag)")
    p.add_argument("--req", type=parse_req, action="append", required=True, metavar="PREFIX:EXTEND",
                   help="a request: cached prefix tokens and new tokens (repeat for a batch; at most "
                        f"{MAX_LAYOUT_PAGES} pages in all)")
    p.add_argument("--max-context", type=a.tokens, default=None, help="reject requests longer than this")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def check_size(args: argparse.Namespace) -> None:
    """The layout's pages (one object each) stay within MAX_LAYOUT_PAGES: ConfigError naming --req otherwise."""
    from cpkv.errors import ConfigError

    pages = sum(-(-(p + e) // args.page_size) for p, e in args.req)
    if pages > MAX_LAYOUT_PAGES:
        raise ConfigError(f"--req: the batch spans {pages} pages of --page-size {args.page_size}, expected at most "
                          f"{MAX_LAYOUT_PAGES}: shorten the requests or raise --page-size")


def run(args: argparse.Namespace) -> int:
    check_size(args)
    with as_flags(flags_of(["cp", "page_size", "max_context"])):
        layout = build_layout(args.req, page_size=args.page_size, cp=args.cp, strategy=args.strategy,
                              max_context=args.max_context)
    if args.json:
        fmt.emit_json(layout.to_dict())
    else:
        print_layout(layout)
    return 0


MAX_RUNS = 8  # runs shown per cell; a long request's cell is cut short (``--json`` lists every page)


def _runs(items: list[tuple[int, int]]) -> str:
    """Compress [(page, rank), ...] into 'p0-p3:r1 p4:r0' style runs; a cell of more than MAX_RUNS runs shows
    the first and last few and how many there are."""
    out: list[str] = []
    start = 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i][1] != items[start][1]:
            a, b = items[start][0], items[i - 1][0]
            out.append(f"{a}{'' if a == b else f'-{b}'}:r{items[start][1]}")
            start = i
    if len(out) > MAX_RUNS:
        out = out[: MAX_RUNS - 2] + ["..."] + out[-2:] + [f"({len(items)} pages in {len(out)} runs)"]
    return " ".join(out) or "-"


def print_layout(layout: BatchLayout) -> None:
    print(f"page_size {layout.page_size}  cp {layout.cp}  strategy {layout.strategy}  "
          f"slots {layout.num_slots} ({layout.num_prefix_pages} prefix, {layout.num_current} current)")
    rows = []
    for r in layout.requests:
        prefix = _runs([(k, p.owner) for k, p in enumerate(r.prefix_pages)])
        cur = _runs([(c.index, c.writer) for c in r.current_pages])
        rows.append((r.index, r.prefix_len, r.extend_len, f"{r.slot_start}-{r.slot_end - 1}", prefix, cur))
    fmt.table(("req", "prefix", "extend", "slots", "prefix pages:owner", "current pages:writer"), rows)
    print()
    mean = sum(layout.rank_work) / layout.cp
    rows = [(rank, len(layout.rank_current[rank]), layout.query_tokens(rank), layout.rank_work[rank],
             f"{layout.rank_work[rank] / mean:.3f}" if mean else "-") for rank in range(layout.cp)]
    fmt.table(("rank", "current pages", "query tokens", "causal work", "work/mean"), rows)
    print(f"\nbalance (max/mean causal work): {layout.balance():.4f}")
