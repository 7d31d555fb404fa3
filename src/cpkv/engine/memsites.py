"""A diagnostic of where a CUDA rank's memory goes (CPKV_MEMORY_SITES=DIR): allocation history recorded from the
rank's start, and at each trace loop's set-up mark (``trace_loop.gpu_mark``) the live blocks summed by allocation
site -- the innermost frames in cpkv's own code -- written to DIR/memory_sites_r<rank>_<n>.json, largest first.
What `cpkv plan` does not count shows up there by name."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch

_STATE = {"rank": None, "n": 0}
FRAMES = 3  # cpkv frames per site


def start_if_asked(rank: int) -> None:
    """Record allocation stacks from now on when CPKV_MEMORY_SITES is set."""
    from cpkv import envs

    if envs.get("CPKV_MEMORY_SITES"):
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        _STATE["rank"] = rank


def sites(snapshot: dict, top: int = 60) -> list[dict]:
    """Live blocks of a ``torch.cuda.memory._snapshot()`` summed by their innermost cpkv frames (``FRAMES`` of
    them; "?" where the stack has none) -> [{"site", "bytes", "blocks"}], largest first."""
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            ours = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in blk.get("frames", [])
                    if "/cpkv/" in f.get("filename", "") and "memsites" not in f["filename"]]
            key = " < ".join(ours[:FRAMES]) or "?"
            by[key][0] += int(blk["size"])
            by[key][1] += 1
    rows = sorted(({"site": k, "bytes": v[0], "blocks": v[1]} for k, v in by.items()), key=lambda r: -r["bytes"])
    return rows[:top]


def write_if_asked(device: torch.device) -> None:
    """At a set-up mark: the live memory by site, to the folder CPKV_MEMORY_SITES names (when recording)."""
    from cpkv import envs

    where = envs.get("CPKV_MEMORY_SITES")
    if not where or _STATE["rank"] is None:
        return
    snap = torch.cuda.memory._snapshot(device)
    rows = sites(snap)
    os.makedirs(where, exist_ok=True)
    path = os.path.join(where, f"memory_sites_r{_STATE['rank']}_{_STATE['n']}.json")
    _STATE["n"] += 1
    with open(path, "w") as f:
        json.dump({"allocated": int(torch.cuda.memory_allocated(device)), "sites": rows}, f, indent=1)
