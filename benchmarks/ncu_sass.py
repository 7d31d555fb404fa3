"""Where a kernel's warps wait, from Nsight Compute's per-instruction stall samples (no GPU needed).

Reads the CSV of ``ncu -i REPORT --page source --print-source sass --csv`` (``benchmarks/h200_round.sh mla_ncu``
writes it as ``mla_sass.csv.gz``; plain or gzipped), and prints for each kernel in it:

* its mbarrier waits: each ``SYNCS.PHASECHK`` with the barrier's shared-memory offset, how often it ran, and the
  samples on it and on the branch that tests its result (where a waiting warp sits), so the code regions of a
  warp-specialised kernel (which partition waits on which barrier) can be read off;
* per region (``--regions``: ``NAME=START:END`` instruction indices, ``;`` between kernels, ``,`` between
  regions; default: the whole kernel): the samples by kind of instruction (mbarrier wait, wgmma wait, wgmma issue,
  global load / store, hardware barrier, other) with their top stall reasons, and the samples of code run once a
  tile (the execution count given by ``--tile-count``) apart, with that code's instruction count and its most
  frequent opcodes (an epilogue's cost: session 14 found a per-element division there this way);
* the ``--top`` instructions with the most samples.

    python3 benchmarks/ncu_sass.py mla_sass.csv.gz [--regions "C1=0:1950,prod=1950:2575,C0=2575:"] [--top 40]

Session 13 (BENCHMARKS.md) found the sparse MLA kernel's stalled index loads and narrow output stores this way.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import re
import sys
from collections import defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """[(kernel name, header, instruction rows)] of an ncu source-page CSV."""
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="")
    with raw as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    kernels: list[tuple[str, list[str], list[list[str]]]] = []
    header: list[str] = []
    for r in rows:
        if r and r[0] == "Kernel Name":
            kernels.append((r[1], header, []))
        elif r and r[0] == "Address":
            header = r
            if kernels:
                kernels[-1] = (kernels[-1][0], header, kernels[-1][2])
        elif kernels and len(r) > 5:
            kernels[-1][2].append(r)
    return kernels


def wait_branches(ins: list[list[str]]) -> dict[int, int]:
    """{index of a branch on a try-wait's result: index of that try-wait} (ptxas may schedule other instructions
    between the two; a waiting warp's samples sit on the branch)."""
    pending: dict[str, int] = {}
    out = {}
    for i, r in enumerate(ins):
        m = re.search(r"SYNCS\.PHASECHK\S*TRYWAIT\s+(P\d)", r[1])
        if m:
            pending[m.group(1)] = i
            continue
        b = re.match(r"\s*@!(P\d)\s+BRA", r[1])
        if b and b.group(1) in pending:
            out[i] = pending.pop(b.group(1))
    return out


def kind(sass: str, is_wait_branch: bool) -> str:
    """The kind of an instruction for the breakdown."""
    if "SYNCS.PHASECHK" in sass or is_wait_branch:
        return "mbarrier wait"
    if "DEPBAR" in sass:
        return "wgmma wait"
    if "HGMMA" in sass or "WARPGROUP.ARRIVE" in sass:
        return "wgmma issue"
    if re.search(r"\b(LDG|STG|LDGSTS)", sass):
        return "global load/store"
    if re.search(r"\bBAR\.(SYNC|ARV|RED)", sass):
        return "hardware barrier"
    return "other"


def parse_regions(spec: str | None, n_kernels: int) -> list[list[tuple[str, int, int | None]]]:
    """Per kernel [(name, start, end or None)] from ``--regions``."""
    out: list[list[tuple[str, int, int | None]]] = [[("all", 0, None)] for _ in range(n_kernels)]
    if not spec:
        return out
    for k, part in enumerate(spec.split(";")[:n_kernels]):
        regions = []
        for item in filter(None, part.split(",")):
            m = re.fullmatch(r"\s*([^=\s]+)\s*=\s*(\d*):(\d*)\s*", item)
            if m is None:
                raise ValueError(f"--regions: expected NAME=START:END, got {item!r}")
            regions.append((m.group(1), int(m.group(2) or 0), int(m.group(3)) if m.group(3) else None))
        out[k] = regions or out[k]
    return out


def report(name: str, header: list[str], ins: list[list[str]], regions, top: int, tile_count: int) -> None:
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    s, e = col[SAMPLES], col[EXECUTED]
    total = sum(int(r[s]) for r in ins) or 1
    print(f"== {name[:100]}\n   {len(ins)} instructions, {total} samples")
    branches = wait_branches(ins)
    on_wait: dict[int, int] = defaultdict(int)
    for b, w in branches.items():
        on_wait[w] += int(ins[b][s])
    print("   mbarrier waits with samples (index, barrier, executed, samples on the wait and its branch):")
    for i, r in enumerate(ins):
        if "SYNCS.PHASECHK" in r[1] and int(r[e]):
            n = int(r[s]) + on_wait.get(i, 0)
            if n >= total // 10000:  # the retry loops at a kernel's end run often but hold no samples
                bar = re.search(r"\[([^\]]*)\]", r[1])
                print(f"   {i:6d}  {bar.group(1) if bar else '?':<24} {r[e]:>10}  {n:8d} ({100 * n / total:4.1f} %)")
    for rname, a, b in regions:
        part = ins[a:b]
        by_kind: dict[str, int] = defaultdict(int)
        why: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        once = 0
        ops: dict[str, int] = defaultdict(int)  # opcodes of the code run once a tile
        for j, r in enumerate(part):
            k = kind(r[1], a + j in branches)
            n = int(r[s])
            by_kind[k] += n
            if int(r[e]) == tile_count:
                once += n
                ops[opcode(r[1])] += 1
            for x in reasons:
                why[k][x[6:]] += int(r[col[x]])
        n_part = sum(by_kind.values())
        print(f"   region {rname} [{a}:{'' if b is None else b}]: {n_part} samples ({100 * n_part / total:.1f} %), "
              f"{once} in code run {tile_count} times")
        if ops:
            common = sorted(ops.items(), key=lambda t: (-t[1], t[0]))[:8]
            print(f"      once a tile: {sum(ops.values())} instructions, " + " ".join(f"{o}:{c}" for o, c in common))
        for k, n in sorted(by_kind.items(), key=lambda t: -t[1]):
            top3 = sorted(why[k].items(), key=lambda t: -t[1])[:3]
            print(f"      {k:<18} {n:8d}   " + " ".join(f"{w}:{v}" for w, v in top3 if v))
    print(f"   top {top} instructions (index, samples, executed, SASS, top reasons):")
    for i in sorted(sorted(range(len(ins)), key=lambda i: -int(ins[i][s]))[:top]):
        r = ins[i]
        top2 = sorted(((int(r[col[x]]), x[6:]) for x in reasons), reverse=True)[:2]
        print(f"   {i:6d} {int(r[s]):7d} {r[e]:>9} {r[1].strip()[:64]:<64} "
              + " ".join(f"{w}:{v}" for v, w in top2 if v))


def opcode(sass: str) -> str:
    """The opcode of a SASS line, without its predicate (``@!P0  BRA 0x..`` -> ``BRA``)."""
    words = re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split()
    return words[0] if words else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu source-page CSV, plain or .gz")
    ap.add_argument("--regions", default=None, help="NAME=START:END,... per kernel, ';' between kernels")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--tile-count", type=int, default=32768,
                    help="execution count of code run once a tile (tiles x warps of a warpgroup; 8,192 x 4 for "
                         "the mla_ncu shape)")
    a = ap.parse_args(argv)
    try:
        regions = parse_regions(a.regions, 1 + (a.regions or "").count(";"))
        kernels = read_kernels(a.csv)
    except (OSError, ValueError, csv.Error, EOFError) as e:
        print(f"ncu_sass: error: {e}", file=sys.stderr)
        return 2
    if not kernels:
        print(f"ncu_sass: no kernel in {a.csv}", file=sys.stderr)
        return 1
    regions += [[("all", 0, None)]] * (len(kernels) - len(regions))
    for (name, header, ins), regs in zip(kernels, regions):
        report(name, header, ins, regs, a.top, a.tile_count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
