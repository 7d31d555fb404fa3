"""Cost of the full value scan of a checkpoint shard (issue 25): seconds per GiB of ``check_values``.

    PYTHONPATH=src python3 benchmarks/checkpoint_scan.py [--gib 1] [--dtype BF16] [--dir DIR] [--json]

Writes one safetensors shard of ``--gib`` GiB (8 tensors [N, 8192], random normal values, so that nothing is
found and every value is read) into ``--dir`` (default: a temporary folder, removed after), then times
``cpkv.model.checkpoint.check_values`` over its tensors three times: with one thread and with the default
threads (min(8, CPU count)). The first pass may read from the disk, the later ones from the page cache;
the report gives each. No torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cpkv.model import checkpoint
from cpkv.model.checkpoint import check_values, read_header

COLS = 8192
NUMPY = {"F32": np.float32, "F16": np.float16}


def write_shard(path: Path, gib: float, dtype: str) -> None:
    """8 tensors of random normal values filling ``gib`` GiB, in safetensors layout."""
    width = checkpoint.DTYPE_BYTES[dtype]
    rows = max(1, int(gib * (1 << 30) / 8 / COLS / width))
    names = [f"t{i}.weight" for i in range(8)]
    size = rows * COLS * width
    header = {n: {"dtype": dtype, "shape": [rows, COLS], "data_offsets": [i * size, (i + 1) * size]}
              for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _ in names:
            x = rng.standard_normal((rows, COLS), dtype=np.float32)
            if dtype == "BF16":
                f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
            else:
                f.write(x.astype(NUMPY[dtype]).tobytes())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--dtype", choices=("BF16", "F16", "F32"), default="BF16")
    p.add_argument("--dir", help="where to write the shard (default: a temporary folder, removed after)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cpkv-scan-"))
    try:
        shard = folder / "model.safetensors"
        t = time.perf_counter()
        write_shard(shard, args.gib, args.dtype)
        write_s = time.perf_counter() - t
        index = read_header(shard)
        gib = os.path.getsize(shard) / (1 << 30)
        runs = []
        for threads in (1, checkpoint.SCAN_THREADS, checkpoint.SCAN_THREADS):
            checkpoint.SCAN_THREADS = threads
            checkpoint._SCANNED.clear()  # scan again: the memo of clean tensors would skip them
            t = time.perf_counter()
            check_values(index, sorted(index))
            dt = time.perf_counter() - t
            runs.append({"threads": min(threads, os.cpu_count() or 1, len(index)), "seconds": round(dt, 3),
                         "s_per_gib": round(dt / gib, 3)})
            print(f"{runs[-1]['threads']} thread(s): {dt:.2f} s for {gib:.2f} GiB = {dt / gib:.2f} s/GiB",
                  file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report = {"dtype": args.dtype, "gib": round(gib, 3), "cpus": os.cpu_count(), "write_s": round(write_s, 2),
              "runs": runs}
    print(json.dumps(report) if args.json else
          "\n".join(f"{r['threads']} thread(s): {r['s_per_gib']} s/GiB" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
