"""benchmarks/ncu_sass.py on a small Nsight Compute source-page CSV written here: waits found through their branch,
instructions sorted by kind, regions summed, code run once a tile apart."""
from __future__ import annotations

import csv
import gzip
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_sass.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_long_sb", "stall_lg", "stall_barrier", "stall_long_sb (Not Issued)"]


def _load():
    if not SCRIPT.exists():
        pytest.skip("no benchmarks/ folder beside src/ (installed package)")
    spec = importlib.util.spec_from_file_location("ncu_sass", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(i: int, sass: str, samples: int, executed: int, long_sb: int = 0, lg: int = 0, barrier: int = 0) -> list:
    return [hex(0x1000 + 16 * i), sass, samples, samples, executed, long_sb, lg, barrier, long_sb]


def _write(path: Path) -> None:
    k1 = [
        _row(0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR4+0x100], R2", 3, 64),
        _row(1, "IMAD R8, R9, R10, RZ", 1, 64),  # ptxas put work between the try-wait and its branch
        _row(2, "@!P4  BRA 0x2000", 50, 64, long_sb=50),
        _row(3, "@!P1  LDG.E R12, desc[UR6][R4.64]", 20, 64, lg=20),
        _row(4, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", 5, 64),
        _row(5, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 30, 64, barrier=30),
        _row(6, "STG.E.128 desc[UR6][R4.64], R20", 7, 4),  # once a tile
        _row(7, "FMUL R1, R2, R3", 0, 4),  # once a tile
        _row(8, "@P2  FMUL R4, R5, R6", 1, 4),  # once a tile
        _row(9, "@!P0  BRA 0x3000", 9, 64),  # a branch on no try-wait
    ]
    k2 = [_row(0, "BAR.SYNC.DEFER_BLOCKING 0x9, 0x100", 11, 8)]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        for name, rows in (("kernel_one", k1), ("kernel_two", k2)):
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            w.writerows(rows)


def test_waits_kinds_and_regions(tmp_path, capsys) -> None:
    mod = _load()
    path = tmp_path / "sass.csv.gz"
    _write(path)
    kernels = mod.read_kernels(str(path))
    assert [k[0] for k in kernels] == ["kernel_one", "kernel_two"]
    ins = kernels[0][2]
    assert mod.wait_branches(ins) == {2: 0}  # the branch two instructions later, on the same predicate
    assert [mod.kind(r[1], i == 2) for i, r in enumerate(ins)] == [
        "mbarrier wait", "other", "mbarrier wait", "global load/store", "wgmma issue", "wgmma wait",
        "global load/store", "other", "other", "other"]
    assert mod.main([str(path), "--regions", "a=0:3,b=3:;", "--top", "2", "--tile-count", "4"]) == 0
    out = capsys.readouterr().out
    assert "UR4+0x100" in out and "53 (42.1 %)" in out  # 3 on the wait + 50 on its branch, of 126
    assert "region a [0:3]: 54 samples" in out and "region b [3:]: 72 samples (57.1 %), 8 in code run 4 times" in out
    assert "once a tile: 3 instructions, FMUL:2 STG.E.128:1" in out  # predicates dropped, most frequent first
    assert mod.opcode("@!UP1  BRA 0x10") == "BRA" and mod.opcode("  IMAD R1, R2, R3, RZ") == "IMAD"
    assert "mbarrier wait            53   long_sb:50" in out
    assert "kernel_two" in out and "11 samples" in out
    assert mod.parse_regions("x=1:2,y=2:;z=0:", 3) == [[("x", 1, 2), ("y", 2, None)], [("z", 0, None)],
                                                      [("all", 0, None)]]


def test_bad_input_is_one_line_error(tmp_path, capsys) -> None:
    mod = _load()
    assert mod.main([str(tmp_path / "missing.csv")]) == 2
    assert "ncu_sass: error:" in capsys.readouterr().err
    path = tmp_path / "sass.csv.gz"
    _write(path)
    assert mod.main([str(path), "--regions", "a=0:3,oops"]) == 2
    err = capsys.readouterr().err
    assert "expected NAME=START:END, got 'oops'" in err and "Traceback" not in err
    (tmp_path / "empty.csv").write_text("")
    assert mod.main([str(tmp_path / "empty.csv")]) == 1
