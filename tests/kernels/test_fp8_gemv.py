"""CPU tests of the fp8 GEMV (``cpkv.kernels.fp8_gemm.gemv``; the GPU runs are in test_fp8_gemv_gpu.py): its split
plan, its refusals, ``CPKV_FP8_GEMV`` and the Backends it resolves to, the fp8 linears' choice of path, the
kernel compiled offline for sm_90a (Triton ships ptxas: no GPU needed), and the cases of ``gemv_cases.py`` in
Triton's interpreter (a subprocess each: the interpreter is chosen at import; tolerances there).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted

from cpkv import envs
from cpkv.config import FP8_GEMV_AUTO_ROWS, FP8_GEMV_MAX_ROWS
from cpkv.errors import ConfigError, GemvError
from cpkv.kernels import platform
from cpkv.kernels.fp8_gemm import gemv as gv
from cpkv.kernels.platform import Backends
from cpkv.model import linear as lin

HERE = Path(__file__).resolve().parent
CASES = re.findall(r"^def case_(\w+)\(", (HERE / "gemv_cases.py").read_text(), re.M)
FP8 = torch.float8_e4m3fn
# GLM-5's fp8 linears read in a decode step, (N, K): q_a, kv_a (576: a partial weight block), the indexer's wk,
# q_a + kv_a + wk stacked, q_b, the indexer's wq_b, o_proj, the dense MLP's gate_up and down, the shared expert's
GLM5 = [(2048, 6144), (576, 6144), (128, 6144), (2752, 6144), (16384, 2048), (4096, 2048), (6144, 16384),
        (24576, 6144), (6144, 12288), (4096, 6144), (6144, 2048)]


def test_every_case_is_found():
    assert len(CASES) >= 5 and "linear_dispatch" in CASES


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES)
def test_gemv_under_the_interpreter(case):
    run = run_interpreted([str(HERE / "gemv_cases.py"), case])
    if run.returncode == 77:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, f"{case}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert f"{case}: ok" in run.stdout


@pytest.mark.parametrize("n,k", GLM5)
def test_plan_covers_k_once_in_one_wave(n, k):
    """At 132 SMs (H200): every K group in exactly one program of each column tile (none empty), at least the
    SMs' worth of programs wherever K allows min_groups per program, at most one wave of them (RESIDENT per SM)
    unless the column tiles alone are more, and the same split for every M of one BM."""
    cfg = gv.DEFAULT
    groups = k // 128
    for bm, rows in [(16, (1, 2, 16)), (32, (17, 32)), (64, (33, 64))]:
        p = gv.plan(rows[0], n, k, 132)
        assert p.bm == bm and p.tiles == -(-n // cfg.block_n)
        assert p.split * p.per >= groups > (p.split - 1) * p.per
        assert p.programs >= 132 or p.split == max(1, groups // cfg.min_groups)
        assert p.programs <= gv.RESIDENT[bm] * 132 or p.split == 1
        assert p.per >= min(cfg.min_groups, groups)
        assert all(gv.plan(m, n, k, 132) == p for m in rows)


def _ops(m: int = 3, n: int = 256, k: int = 512) -> dict:
    g = k // 128
    return {"q": torch.zeros(m, k, dtype=FP8), "s": torch.ones(m, g), "w": torch.zeros(n, k, dtype=FP8),
            "ws": torch.ones(-(-n // 128), g)}


@pytest.mark.parametrize("change,match", [
    ({"q": torch.zeros(0, 512, dtype=FP8), "s": torch.ones(0, 4)}, "1 to 64 rows, got 0"),
    ({"q": torch.zeros(65, 512, dtype=FP8), "s": torch.ones(65, 4)}, "1 to 64 rows, got 65"),
    ({"q": torch.zeros(3, 512)}, "float8_e4m3fn q and w, got torch.float32"),
    ({"q": torch.zeros(3, 300, dtype=FP8)}, "K a positive multiple of 128"),
    ({"w": torch.zeros(256, 640, dtype=FP8)}, r"got q \[3, 512\], w \[256, 640\]"),
    ({"w": torch.zeros(512, 256, dtype=FP8).t()}, "unit K strides"),
    ({"s": torch.ones(3, 5)}, r"s float32 \[3, 4\], got torch.float32 \[3, 5\]"),
    ({"ws": torch.ones(2, 4, dtype=torch.float64)}, r"ws float32 \[2, 4\], got torch.float64"),
])
def test_operands_outside_the_contract_are_refused(change, match):
    op = {**_ops(), **change}
    with pytest.raises(GemvError, match=match):
        gv.gemv(op["q"], op["s"], op["w"], op["ws"])


def test_out_tickets_and_config_are_checked():
    op = _ops()
    with pytest.raises(GemvError, match=r"expected out \[3, 256\]"):
        gv.gemv(**op, out=torch.empty(3, 256, dtype=torch.int32))
    with pytest.raises(GemvError, match=r"expected out \[3, 256\]"):
        gv.gemv(**op, out=torch.empty(256, 3, dtype=torch.bfloat16).t())
    with pytest.raises(GemvError, match=r"tickets int32 \[>= 2\]"):
        gv.gemv(**op, tickets=torch.zeros(1, dtype=torch.int32), cfg=gv.GemvConfig(min_groups=1))
    with pytest.raises(GemvError, match="divisor of 128 >= 32, got 96"):
        gv.GemvConfig(block_n=96)
    with pytest.raises(GemvError, match="one of ticket, reduce, got 'atomic'"):
        gv.GemvConfig(reduce="atomic")
    assert gv.new_tickets(6144, "cpu").shape == (6144 // gv.MIN_BLOCK_N,)  # enough for any block_n
    assert [gv.block_rows(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert gv.plan(1, 6144, 16384, 132, gv.GemvConfig(waves=1)).programs <= 132


@pytest.mark.parametrize("raw,rows", [("auto", FP8_GEMV_AUTO_ROWS), ("on", FP8_GEMV_MAX_ROWS), ("off", 0),
                                      ("OFF", 0), ("8", 8), ("0", 0), ("64", 64)])
def test_env_choice_gives_the_rows(monkeypatch, raw, rows):
    monkeypatch.setenv("CPKV_FP8_GEMV", raw)
    assert envs.problems() == []
    assert platform.fp8_gemv_rows(envs.get("CPKV_FP8_GEMV")) == rows


@pytest.mark.parametrize("raw", ["65", "-1", "yes", "16.0"])
def test_env_choice_outside_the_range_is_one_error(monkeypatch, raw):
    monkeypatch.setenv("CPKV_FP8_GEMV", raw)
    assert envs.problems() == [f"CPKV_FP8_GEMV={raw!r}: expected one of auto, on, off or a row count 0..64"]
    with pytest.raises(ConfigError, match="row count 0..64"):
        platform.fp8_gemv_rows(raw)


def test_backends_take_the_rows_only_with_triton(monkeypatch):
    """A CPU device: the references, no GEMV; a CUDA device (capability faked): the env's rows where Triton runs,
    0 where CPKV_DISABLE_TRITON turns Triton off; Backends refuses rows past the kernel's limit."""
    assert platform.resolve("cpu").fp8_gemv_rows == 0
    monkeypatch.setattr(platform, "capability", lambda x: (9, 0))
    monkeypatch.setattr(platform, "triton_importable", lambda: True)
    monkeypatch.setattr(platform, "gluon_importable", lambda: False)
    assert platform.resolve("cuda", sparse_mla="cpkv", fp8_gemv="auto").fp8_gemv_rows == FP8_GEMV_AUTO_ROWS
    assert platform.resolve("cuda", sparse_mla="cpkv", fp8_gemv="12").fp8_gemv_rows == 12
    assert platform.resolve("cuda", sparse_mla="cpkv", fp8_gemv="on", disable_triton=True).fp8_gemv_rows == 0
    monkeypatch.setenv("CPKV_FP8_GEMV", "off")
    assert platform.resolve("cuda", sparse_mla="cpkv").fp8_gemv_rows == 0
    with pytest.raises(ConfigError, match="fp8_gemv_rows: expected 0..64, got 65"):
        Backends(triton=True, fp8_gemv_rows=65)


def test_linears_take_the_gemv_only_when_allowed(monkeypatch):
    """fp8_linear's choice for a quantised activation: the GEMV for 1 .. fp8_gemv_rows rows where the backends run
    Triton, else ``_scaled_mm`` (rows 0 or past the limit, Triton off, rows 0 set, K not whole groups); the
    Linear's tickets and the activation's dtype passed on."""
    calls = []
    monkeypatch.setattr(gv, "gemv", lambda q, s, w, ws, tickets=None, dtype=None: calls.append(("gemv", q.shape[0],
                                                                                                 tickets, dtype)))
    monkeypatch.setattr(lin, "_scaled_mm", lambda x, w, ws: calls.append(("scaled_mm", x.q.shape[0])))
    on = Backends(triton=True, fp8_gemv_rows=8)
    w, ws = torch.zeros(256, 512, dtype=FP8), torch.ones(2, 4)
    tickets = gv.new_tickets(256, "cpu")

    def act(m: int, k: int = 512, dtype=torch.bfloat16) -> lin.QuantAct:
        return lin.QuantAct(torch.zeros(m, k, dtype=FP8), torch.ones(m, k // 128), dtype)

    lin.fp8_linear(act(1), w, ws, on, tickets)
    lin.fp8_linear(act(8, dtype=torch.float32), w, ws, on)
    assert calls == [("gemv", 1, tickets, torch.bfloat16), ("gemv", 8, None, torch.float32)]
    calls.clear()
    lin.fp8_linear(act(9), w, ws, on)
    lin.fp8_linear(act(0), w, ws, on)
    lin.fp8_linear(act(4), w, ws, Backends(triton=False))
    lin.fp8_linear(act(4), w, ws, Backends(triton=True))
    lin.fp8_linear(act(4), w, ws)  # no backends: the weight's device's (CPU: the references)
    assert [c[1] for c in calls] == [9, 0, 4, 4, 4] and {c[0] for c in calls} == {"scaled_mm"}
    ragged = lin.QuantAct(torch.zeros(2, 200, dtype=FP8), torch.ones(2, 2))
    assert not lin.gemv_ok(ragged, torch.zeros(256, 200, dtype=FP8), on)
    assert lin.gemv_ok(act(2), w, on) and not lin.gemv_ok(act(2, dtype=torch.int8), w, on)


def test_linear_owns_tickets_only_for_a_cuda_gemv():
    """A Linear makes its counters only where the GEMV may run on its weight (fp8, rows allowed, on CUDA)."""
    w, ws = torch.zeros(256, 512, dtype=FP8), torch.ones(2, 4)
    assert lin.Linear(w, ws, Backends(triton=True, fp8_gemv_rows=8)).tickets is None  # a CPU weight
    assert lin.Linear(w.float(), None, Backends(triton=True, fp8_gemv_rows=8)).tickets is None


def _compile(bm: int, bn: int, tma: bool, mode: int, num_warps: int = 4):
    """The kernel compiled for sm_90a at o_proj's shape (N 6144, K 16384), 3 rows."""
    from offline_sm90 import compile_sm90

    m, n, k = 3, 6144, 16384
    q, w = torch.empty(64, k, dtype=FP8), torch.empty(n, k, dtype=FP8)
    s, ws = torch.empty(k // 128, 64).t(), torch.empty(n // 128, k // 128)
    y, part, t = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(8 * m * n), gv.new_tickets(n, "cpu")
    qa, wa = (gv._descriptor(q[:m], bm), gv._descriptor(w, bn)) if tma else (q, w)
    args = (qa, s, wa, ws, y, part, t, m, n, k, q.stride(0), s.stride(0), s.stride(1), w.stride(0), ws.stride(0),
            ws.stride(1), y.stride(0), 11, 12)
    return compile_sm90(gv._gemv, args, {"BM": bm, "BN": bn, "TMA": tma, "MODE": mode}, num_warps=num_warps,
                        num_stages=gv.DEFAULT.num_stages)


@pytest.mark.triton
@pytest.mark.parametrize("bm,tma,mode", [(16, True, 1), (32, True, 0), (64, True, 1), (16, False, 2)])
def test_kernel_compiles_for_sm90_as_designed(bm, tma, mode, tmp_path):
    """At the default config: ptxas reports no spills, and registers and shared memory let RESIDENT[BM] programs
    share an SM (the plan's one wave); the tile product is fp8 wgmma m64 n=BM k32; TMA loads (host descriptors: no
    descriptor built on the device) or cp.async pointer loads; the ticket's atomic add comes after a barrier of the
    program's threads and a GPU-scope fence, and the partials are read back through L2 (strong GPU loads)."""
    from offline_sm90 import ptxas_and_sass

    cfg = gv.DEFAULT
    ck = _compile(bm, cfg.block_n, tma, mode, cfg.num_warps)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "Performance Loss" not in report and "warning" not in report.lower(), report
    assert not re.search(r"\b(STL|LDL)\b", sass)
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    threads = 32 * cfg.num_warps
    assert min(65536 // (regs * threads), 233472 // (ck.metadata.shared + 1024)) >= gv.RESIDENT[bm], (regs,
                                                                                                    ck.metadata.shared)
    assert set(re.findall(r"QGMMA\.\w+", sass)) == {f"QGMMA.64x{bm}x32"}
    assert ("UTMALDG" in sass) == tma and ("LDGSTS" in sass) == (not tma)
    assert "tensormap" not in ck.asm["ptx"]  # no device-side descriptor
    atomics = re.findall(r"\bATOMG\.E\.ADD\S*", sass)
    assert len(atomics) == (mode == 1) and (mode != 1 or "STRONG.GPU" in atomics[0])
    if mode == 1:
        before = sass[:sass.index("ATOMG.E.ADD")]
        assert before.rfind("BAR.SYNC") < before.rfind("MEMBAR.ALL.GPU")
        assert "LDG.E.128.STRONG.GPU" in sass[sass.index("ATOMG.E.ADD"):]
