"""CPU tests of the grouped fp8 GEMM's variants (the GPU runs are in test_fp8_gemm_gpu.py): the switches the
kept variants combine, the warp-specialised Gluon kernel's refusals and argument checks, that kernel and the
Triton variants compiled offline for sm_90a (Triton ships ptxas: no GPU needed) without spills or serialised
wgmma, and the Triton variants (and the Gluon variants' fallback) in Triton's interpreter (a subprocess: the
interpreter is chosen at import).
"""
from __future__ import annotations

import re
import subprocess
import textwrap

import pytest
from interpreted import run_interpreted
import torch
from offline_sm90 import compile_sm90, nvidia_tool, ptxas_and_sass

from cpkv.kernels.fp8_gemm import gluon_ws
from cpkv.kernels.fp8_gemm import triton as kern

FP8 = torch.float8_e4m3fn


def _operands(counts: list[int], n: int, k: int) -> dict:
    e, r = len(counts), sum(counts) + 3
    return {"a": torch.zeros(r, k, dtype=FP8), "a_s": torch.ones(r, k // 128), "b": torch.zeros(e, n, k, dtype=FP8),
            "b_s": torch.ones(e, n // 128, k // 128), "c": torch.empty(r, n, dtype=torch.bfloat16),
            "offs": torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)}


def test_variants_combine_only_their_kernels_switches():
    """Gluon variants name only the Gluon kernel's switches, Triton ones only ``_grouped_v``'s; the model's
    variant and the fallback (a Triton variant at 128-row tiles, the Gluon kernel's tile map) are registered."""
    gluon = {"GLUON", "PAIR", "GROUP_M", "EPI_TMA", "AHEAD", "WIDE"}
    assert all(set(f) <= gluon for f in kern.VARIANTS.values() if f.get("GLUON"))
    assert all(set(f) <= {"TMA", "PERSISTENT", "PREFETCH", "EMAP"} for f in kern.VARIANTS.values()
               if not f.get("GLUON"))
    assert kern.VARIANTS[kern.GROUPED["variant"]].get("GLUON")
    fallback, cfg = kern.GLUON_FALLBACK
    assert not kern.VARIANTS[fallback].get("GLUON") and cfg["BLOCK_M"] == 128 and cfg["BLOCK_N"] <= 128
    # WIDE only where ptxas keeps its K loops spill-free: with the TMA epilogue and the tile lookup ahead
    assert all(not f.get("WIDE") or (f.get("EPI_TMA") and f.get("AHEAD") and not f.get("PAIR"))
               for f in kern.VARIANTS.values())


def test_gluon_variant_rejects_other_tiles():
    op = _operands([3, 0, 5], 256, 256)
    with pytest.raises(ValueError, match="BLOCK_M 128, BLOCK_N 128, num_warps 4, got 64, 128, 4"):
        kern.grouped_gemm(op["a"], op["a_s"], op["offs"], op["b"], op["b_s"], op["c"], variant="gluon_ws_g8_tma_ah",
                          config={"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4})


def test_gluon_kernel_refuses_off_hopper_with_a_clear_error():
    op = _operands([3, 0, 5], 256, 256)
    assert "Hopper" in gluon_ws.applies(op["a"], op["b"], op["c"])
    with pytest.raises(ValueError, match="Hopper"):
        gluon_ws.launch(op["a"], op["a_s"], op["offs"], op["b"], op["b_s"], op["c"], op["offs"])


@pytest.fixture
def hopper(monkeypatch):
    """Pretend the CPU tensors sit on a Hopper GPU with Gluon (only the host-side checks run)."""
    from cpkv.kernels import platform

    monkeypatch.setattr(platform, "capability", lambda x: (9, 0))
    monkeypatch.setattr(platform, "gluon_importable", lambda: True)


def test_gluon_kernel_applies_only_where_it_can(hopper):
    op = _operands([3, 0, 5], 256, 384)
    assert gluon_ws.applies(op["a"], op["b"], op["c"]) is None
    odd = _operands([3, 0, 5], 200, 384)
    assert "multiples of 128" in gluon_ws.applies(odd["a"], odd["b"], odd["c"])
    bf = op["a"].to(torch.bfloat16)
    assert "float8_e4m3fn" in gluon_ws.applies(bf, op["b"], op["c"])
    strided = torch.zeros(op["a"].shape[0], 392, dtype=FP8)[:, :384]  # 392-byte rows: not 16-byte aligned
    assert "TMA" in gluon_ws.applies(strided, op["b"], op["c"])
    many = torch.zeros(gluon_ws.MAX_EXPERTS + 1, 128, 384, dtype=FP8)
    assert "experts" in gluon_ws.applies(op["a"], many, op["c"])
    assert "c [" in gluon_ws.applies(op["a"], op["b"], op["c"][:, :128])


def test_gluon_launch_checks_its_operands(hopper):
    op = _operands([3, 0, 5], 256, 384)
    args = [op[x] for x in ("a", "a_s", "offs", "b", "b_s", "c")]
    for i, bad, name in [(1, op["a_s"][:, :2], "a_s"), (4, op["b_s"][:, :1], "b_s"),
                         (2, op["offs"].long(), "offs")]:
        call = list(args)
        call[i] = bad
        with pytest.raises(ValueError, match=f"expected {name} "):
            gluon_ws.launch(*call, op["offs"])
    with pytest.raises(ValueError, match="expected tiles "):
        gluon_ws.launch(*args, op["offs"][:2])
    with pytest.raises(ValueError, match="2 to 6 stages"):
        gluon_ws.launch(*args, op["offs"], stages=7)
    assert [gluon_ws.expert_slots(e) for e in (1, 32, 33, 256)] == [32, 32, 64, 256]


@pytest.mark.parametrize("variant,want", [
    ("gluon_ws_pair_g8_tma_ah", {"pair": True, "group_m": 8, "epi_tma": True, "ahead": True, "wide": False}),
    ("gluon_ws_g8_tma_ah", {"pair": False, "group_m": 8, "epi_tma": True, "ahead": True, "wide": False}),
    ("gluon_ws_n256_g8_tma_ah", {"pair": False, "group_m": 8, "epi_tma": True, "ahead": True, "wide": True}),
])
def test_gluon_variants_pass_their_switches(hopper, monkeypatch, variant, want):
    """The dispatcher hands a GLUON variant's switches and ring depth (given, or the default for its tile
    width) to the kernel's launcher."""
    got = {}
    monkeypatch.setattr(gluon_ws, "launch", lambda *args, **kw: got.update(kw))
    op = _operands([3, 0, 5], 256, 384)
    kern.grouped_gemm(op["a"], op["a_s"], op["offs"], op["b"], op["b_s"], op["c"], variant=variant,
                      config={"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2})
    assert got == {"stages": 2, **want}
    kern.grouped_gemm(op["a"], op["a_s"], op["offs"], op["b"], op["b_s"], op["c"], variant=variant)
    assert got["stages"] == (gluon_ws.WIDE_STAGES if want["wide"] else gluon_ws.STAGES)


def test_gluon_launch_refuses_rings_past_shared_memory(hopper):
    """256-column tiles with the TMA epilogue: 3 stages fit (48 KB each + 64 KB of output buffers), 4 do not."""
    assert gluon_ws.shared_bytes(3, 256, True) <= gluon_ws.SHARED_MAX < gluon_ws.shared_bytes(4, 256, True)
    assert gluon_ws.shared_bytes(6, 128, True) <= gluon_ws.SHARED_MAX  # the largest ring of 128-column tiles
    op = _operands([3, 0, 5], 512, 384)
    args = [op[x] for x in ("a", "a_s", "offs", "b", "b_s", "c")]
    with pytest.raises(ValueError, match="4 stages of 256-column tiles and the TMA epilogue need 263168 B"):
        gluon_ws.launch(*args, op["offs"], stages=4, epi_tma=True, ahead=True, wide=True)


@pytest.mark.parametrize("n,pair,wide,stages,bn,aligned", [
    (512, False, True, 3, 256, True), (384, False, True, 4, 128, True), (512, True, True, 4, 128, True),
    (512, False, False, 6, 128, True), (512, False, True, 4, 128, False), (512, True, False, 6, 128, False)])
def test_gluon_launch_specialises_tiles_and_epilogue(hopper, monkeypatch, n, pair, wide, stages, bn, aligned):
    """What the launcher hands the kernel: 256-row B boxes only for WIDE at N % 256 == 0 without PAIR and with
    the TMA epilogue, that epilogue's 64 x 128 output box on c where c's rows allow it (else the register
    epilogue, and 128-row B boxes), one program per SM at most."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")  # the launcher builds Gluon descriptors
    calls = _recorded_launches(monkeypatch)
    op = _operands([3, 0, 5], n, 512)  # 4 K blocks: PAIR stays on
    if not aligned:  # rows of 2 (N + 4) bytes: not 16-byte multiples
        op["c"] = torch.empty(op["c"].shape[0], n + 4, dtype=torch.bfloat16)[:, :n]
    gluon_ws.launch(*[op[x] for x in ("a", "a_s", "offs", "b", "b_s", "c")], op["offs"], stages=stages, pair=pair,
                    group_m=8, epi_tma=True, ahead=True, wide=wide)
    (grid, args, meta), = calls
    assert grid == (4,) and args[1].block_shape == [bn, 128] and meta["EPI_TMA"] == aligned
    assert (args[2].base is op["c"] and args[2].block_shape == [64, 128]) if aligned else args[2] is args[0]
    assert meta["AHEAD"] and meta["PAIR"] == pair
    assert (meta["STAGES"], meta["GROUP_M"], meta["EP"]) == (stages, 8, 32)


def _recorded_launches(monkeypatch) -> list:
    """The Gluon kernel's launches (grid, args, meta) recorded instead of run, on a 4-SM stand-in device."""
    from cpkv.kernels import platform

    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append((grid, args, meta))

    monkeypatch.setattr(platform, "sm_count", lambda x: 4)
    monkeypatch.setattr(gluon_ws, "load", lambda: Kernel())
    return calls


def _compile_gluon(pair: bool, stages: int, group_m: int = 1, e: int = 32, epi_tma: bool = False,
                   ahead: bool = False, down: bool = False, wide: bool = False):
    """The Gluon kernel at GLM-5's gate_up (``down``: down) shapes (e experts, 32,768 rows; ``wide``: 256-column
    tiles)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (n, k), r = ((6144, 2048) if down else (4096, 6144)), 32768
    a, b = torch.empty(r, k, dtype=FP8), torch.empty(e * n, k, dtype=FP8)
    a_s, b_s = torch.empty(r, k // 128), torch.empty(e, n // 128, k // 128)
    offs, c = torch.zeros(e, dtype=torch.int32), torch.empty(r, n, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    a_desc = TensorDescriptor(a, [r, k], [k, 1], [128, 128], layout)
    c_desc = (TensorDescriptor(c, [r, n], [n, 1], [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128],
                                                                                                 gl.bfloat16))
              if epi_tma else a_desc)
    bn = 256 if wide else 128
    b_desc = TensorDescriptor(b, [e * n, k], [k, 1], [bn, 128], gl.NVMMASharedLayout.get_default_for([bn, 128],
                                                                                                   gl.float8e4nv))
    args = (a_desc, b_desc, c_desc, a_s, offs, offs, b_s, c,
            e, n, k, *a_s.stride(), *b_s.stride(), c.stride(0))
    consts = {"EP": gluon_ws.expert_slots(e), "STAGES": stages, "PAIR": pair, "GROUP_M": group_m,
              "EPI_TMA": epi_tma, "AHEAD": ahead,
              "CONSUMER_REGS": gluon_ws.CONSUMER_REGS, "PRODUCER_REGS": gluon_ws.PRODUCER_REGS,
              "SCALED": True, "INFLIGHT": False}
    return compile_sm90(gluon_ws.load(), args, consts, num_warps=4, maxnreg=gluon_ws.MAX_REGS)


def _compile_triton(variant: str, cfg: tuple[int, int, int, int]):
    """A Triton variant at GLM-5's down shapes (32 experts, 32,768 rows), row-major activation scales."""
    e, n, k, r = 32, 6144, 2048, 32768
    bm, bn, warps, stages = cfg
    a, b = torch.empty(r, k, dtype=FP8), torch.empty(e, n, k, dtype=FP8)
    a_s, b_s = torch.empty(r, k // 128), torch.empty(e, n // 128, k // 128)
    offs, c = torch.zeros(e, dtype=torch.int32), torch.empty(r, n, dtype=torch.bfloat16)
    f = kern.VARIANTS[variant]
    args = (a, a_s, offs, offs, b, b_s, c, r, e, n, k, a.stride(0), *a_s.stride(), b.stride(0), b.stride(1),
            b_s.stride(0), b_s.stride(1), c.stride(0))
    consts = {"LOG_E": e.bit_length(), "BLOCK_M": bm, "BLOCK_N": bn, "EVEN_K": True, "TMA": bool(f.get("TMA")),
              "PERSISTENT": int(f.get("PERSISTENT", 0)), "PREFETCH": bool(f.get("PREFETCH")),
              "EMAP": bool(f.get("EMAP")), "EP": kern.expert_slots(e)}
    return compile_sm90(kern._grouped_v, args, consts, num_warps=warps, num_stages=stages)


@pytest.mark.triton
@pytest.mark.parametrize("pair,experts", [(False, 32), (True, 32), (False, gluon_ws.MAX_EXPERTS)])
def test_gluon_kernel_compiles_for_sm90_without_spills(pair, experts, tmp_path):
    """The kept Gluon variants' kernel with the register epilogue (what runs where c's rows do not fit a TMA
    store; GROUP_M 8, AHEAD), ptxas: no local-memory spills (the largest expert map included), no serialised
    wgmma; 4 (PAIR: 8) m64n128k32 fp8 wgmmas per consumer; shared memory = the TMA ring (STAGES x 32 KB) plus
    barriers. (PAIR with AHEAD and the register epilogue at 256 experts does spill: 4 local-memory
    instructions in its K loops, Triton 3.6; PAIR without AHEAD, or with the TMA epilogue, does not.)"""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ptxas, cuobjdump = nvidia_tool("ptxas"), nvidia_tool("cuobjdump")
    ck = _compile_gluon(pair, stages=4, group_m=8, e=experts, ahead=True)
    (tmp_path / "k.ptx").write_text(ck.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Performance Loss" not in out.stderr and "warning" not in out.stderr.lower(), out.stderr
    (tmp_path / "k.cubin").write_bytes(ck.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                          timeout=300).stdout
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) == 2 * 4 * (2 if pair else 1)
    assert not re.search(r"\b(STL|LDL)\b", sass)  # no spills
    assert 4 * 32768 <= ck.metadata.shared <= 4 * 32768 + 1024


_FALLBACK_CFG = tuple(kern.GLUON_FALLBACK[1][x] for x in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))


@pytest.mark.triton
@pytest.mark.parametrize("variant,cfg", [("v4", (128, 128, 8, 4)), (kern.GLUON_FALLBACK[0], _FALLBACK_CFG)])
def test_triton_variants_compile_for_sm90_without_spills(variant, cfg, tmp_path):
    """The Triton variants (v16: the Gluon variants' fallback, at its config) compile for sm_90a at their
    sweep config without local-memory spills."""
    pytest.importorskip("triton.experimental.gluon._runtime")
    cuobjdump = nvidia_tool("cuobjdump")
    ck = _compile_triton(variant, cfg)
    (tmp_path / "k.cubin").write_bytes(ck.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                          timeout=300).stdout
    assert "QGMMA" in sass and not re.search(r"\b(STL|LDL)\b", sass)


@pytest.mark.triton
@pytest.mark.parametrize("pair,ahead,stages,experts", [(True, True, 4, 32), (True, True, 6, 32),
                                                       (False, True, 4, gluon_ws.MAX_EXPERTS)])
def test_tma_epilogue_compiles_for_sm90_without_spills(pair, ahead, stages, experts, tmp_path):
    """The EPI_TMA kernel at GLM-5's down shapes: no spills, no serialised wgmma, the wgmma count of its PAIR
    setting; shared memory = the ring + two 16 KB output buffers (6 stages fit the 227 KB); per consumer one
    TMA store of its half tile from a stmatrix-written buffer, fenced for the async proxy and issued after a
    barrier of the warpgroup, the buffer written only after the previous store is waited for; the partial
    half's masked register store kept."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ck = _compile_gluon(pair, stages=stages, group_m=8, e=experts, epi_tma=True, ahead=ahead, down=True)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "Performance Loss" not in report and "warning" not in report.lower(), report
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) == 2 * 4 * (2 if pair else 1)
    assert stages * 32768 + 2 * 16384 <= ck.metadata.shared <= stages * 32768 + 2 * 16384 + 1024 <= 232448
    assert len(re.findall(r"\bUTMASTG\b", sass)) == 2 and len(re.findall(r"\bSTSM\b", sass)) == 2 * 8
    assert len(re.findall(r"\bSTG\.E", sass)) == 2 * 32  # the partial halves: 32 bf16 pairs per thread
    ptx = ck.asm["ptx"]
    for store in re.finditer(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx):
        before = ptx[:store.start()]
        wait, stm = before.rfind("cp.async.bulk.wait_group.read"), before.rfind("stmatrix")
        fence, bar = before.rfind("fence.proxy.async.shared::cta"), before.rfind("bar.sync")
        assert 0 <= wait < stm < fence < bar, (wait, stm, fence, bar)


def _k_loop_spills(sass: str) -> tuple[int, int]:
    """(local-memory instructions inside the innermost loops that hold wgmmas, how many such loops) of a SASS
    listing: loops found by their backward branches."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, ins in lines:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in lines if int(m.group(1), 16) <= a <= addr]
            if any("QGMMA" in i for i in body):
                loops.append((int(m.group(1), 16), addr, body))
    inner = [x for x in loops if not any(y is not x and x[0] <= y[0] and y[1] <= x[1] for y in loops)]
    return sum(bool(re.search(r"\b(STL|LDL)\b", i)) for x in inner for i in x[2]), len(inner)


@pytest.mark.triton
@pytest.mark.parametrize("experts", [32, gluon_ws.MAX_EXPERTS])
def test_wide_tiles_compile_for_sm90_without_k_loop_spills(experts, tmp_path):
    """WIDE (128 x 256 tiles) with the TMA epilogue and AHEAD at GLM-5's down shapes, 3 stages: no serialised
    wgmma, 2 x 2 x 4 wgmmas (two n128 halves per consumer), no local-memory access inside the K loops (a few
    per tile outside them at small expert maps, at most 16 instructions), shared memory = 3 x 48 KB + four
    16 KB output buffers, per consumer two TMA stores of 64 x 128 (each split in two 64-column boxes)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ck = _compile_gluon(False, stages=gluon_ws.WIDE_STAGES, group_m=8, e=experts, epi_tma=True, ahead=True,
                        down=True, wide=True)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "Performance Loss" not in report and "warning" not in report.lower(), report
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) == 2 * 2 * 4
    in_loops, loops = _k_loop_spills(sass)
    assert loops >= 2 and in_loops == 0
    assert len(re.findall(r"\b(STL|LDL)\b", sass)) <= 16
    assert 3 * 49152 + 4 * 16384 <= ck.metadata.shared <= gluon_ws.shared_bytes(3, 256, True)
    assert len(re.findall(r"\bUTMASTG\b", sass)) == 4 and len(re.findall(r"\bSTSM\b", sass)) == 2 * 16


_INTERPRET = r'''
import torch
from fused_cases import patch_interpreter_index  # (tests/kernels, on the subprocess's path)

patch_interpreter_index()  # numpy >= 2.3 refuses int() of a 1-element array: loop bounds need the element

from cpkv.kernels.fp8_gemm import triton as kern
from cpkv.kernels.fp8_gemm.ref import grouped_fp8_ref

kern._sm_count = lambda index: 2  # two persistent programs: each walks several tiles
counts = [5, 0, 130, 1, 0, 3]
cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
fallback, fallback_cfg = kern.GLUON_FALLBACK
for n, k in [(256, 384), (200, 300)]:  # TMA loads; pointer loads with K masks (300-byte rows: no TMA)
    g = torch.Generator().manual_seed(k)
    e, r, kb = len(counts), sum(counts) + 7, -(-k // 128)
    a = (torch.randn(r, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    a_s = torch.rand(r, kb, generator=g) + 0.5
    a.view(torch.uint8)[2, 128:256] = 0  # a zero group: scale 0
    a_s[2, 1] = 0
    a_k = torch.empty(kb, r).t().copy_(a_s)  # the same scales K-major: the kernels take any strides
    w = (torch.randn(e, n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(e, -(-n // 128), kb, generator=g) * 0.01 + 0.001
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    want = grouped_fp8_ref(a, a_s, offs, w, ws)
    done = sum(counts)
    out = {}
    for name, variant, scales, conf in [("v4", "v4", a_s, cfg), ("v16", "v16", a_s, cfg), ("v16_k", "v16", a_k, cfg),
                                        ("fallback", fallback, a_s, fallback_cfg),
                                        ("gluon", kern.GROUPED["variant"], a_s, None)]:
        c = torch.full((r, n), 3.0, dtype=torch.bfloat16)
        kern.grouped_gemm(a, scales, offs, w, ws, c, config=conf, variant=variant)
        assert bool((c[done:] == 3.0).all()), (name, k)
        err = float((c[:done].float() - want[:done]).abs().max() / want[:done].abs().max())
        assert err <= 1e-2, (name, k, err)
        out[name] = c
    for v, base in [("v16", "v4"), ("v16_k", "v4"), ("gluon", "fallback")]:
        assert torch.equal(out[v], out[base]), f"{v} differs from {base} at K {k}"
print("ok")
'''


@pytest.mark.triton
def test_triton_variants_and_the_gluon_fallback_in_the_interpreter():
    """v16 (v4 + scales loaded one K block ahead + the expert map in registers) gives v4's bytes, with row-major
    or K-major activation scales; a Gluon variant's call where its kernel does not apply (here: no Hopper) gives
    GLUON_FALLBACK's bytes; all within 1e-2 of the float32 reference with padding rows untouched (Triton's
    interpreter: TMA and persistent loops included; on a tiny ragged load, at K 384 through TMA and at K 300,
    N 200 through masked pointer loads)."""
    res = run_interpreted(["-c", textwrap.dedent(_INTERPRET)])
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def _compile_bf16(wide: bool, inflight: bool, down: bool, e: int = gluon_ws.MAX_EXPERTS):
    """The kernel with bf16 operands (no scales) at GLM-5's gate_up (``down``: down) shapes, TMA epilogue,
    GROUP_M 8, the deepest ring that fits (WIDE 3 stages, else 6)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (n, k), r, bf = ((6144, 2048) if down else (4096, 6144)), 32768, torch.bfloat16
    a, b = torch.empty(r, k, dtype=bf), torch.empty(e * n, k, dtype=bf)
    offs, c = torch.zeros(e, dtype=torch.int32), torch.empty(r, n, dtype=bf)
    bn = 256 if wide else 128
    lay = gl.NVMMASharedLayout.get_default_for
    a_desc = TensorDescriptor(a, [r, k], [k, 1], [128, 64], lay([128, 64], gl.bfloat16))
    b_desc = TensorDescriptor(b, [e * n, k], [k, 1], [bn, 64], lay([bn, 64], gl.bfloat16))
    c_desc = TensorDescriptor(c, [r, n], [n, 1], [64, 128], lay([64, 128], gl.bfloat16))
    s = offs.view(1, 1, -1)
    args = (a_desc, b_desc, c_desc, s, offs, offs, s, c, e, n, k, 1, 1, *s.stride(), c.stride(0))
    consts = {"EP": gluon_ws.expert_slots(e), "STAGES": 3 if wide else 6, "PAIR": False, "GROUP_M": 8,
              "EPI_TMA": True, "AHEAD": False, "CONSUMER_REGS": gluon_ws.CONSUMER_REGS,
              "PRODUCER_REGS": gluon_ws.PRODUCER_REGS, "SCALED": False, "INFLIGHT": inflight}
    return compile_sm90(gluon_ws.load(), args, consts, num_warps=4, maxnreg=gluon_ws.MAX_REGS)


@pytest.mark.triton
@pytest.mark.parametrize("wide,inflight,down", [(False, True, False), (False, False, True), (True, True, True),
                                                (True, False, False)])
def test_bf16_kernel_compiles_for_sm90_without_spills(wide, inflight, down, tmp_path):
    """bf16 operands: ptxas reports no serialised wgmma and no spills (256 experts' map); per consumer and K block
    (64) four m64n128k16 bf16 wgmmas (WIDE: eight), twice over with INFLIGHT (the peeled first block); no
    scale loads; shared memory = the ring (STAGES x 32 KB, WIDE 48 KB) + the output buffers + barriers."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ck = _compile_bf16(wide, inflight, down)
    report, sass = ptxas_and_sass(ck, tmp_path)
    assert "Performance Loss" not in report and "warning" not in report.lower(), report
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert len(re.findall(r"HGMMA\.64x128x16\.F32\.BF16", sass)) == 2 * 4 * (2 if wide else 1) * (2 if inflight else 1)
    assert "QGMMA" not in sass
    ring = 3 * 49152 + 4 * 16384 if wide else 6 * 32768 + 2 * 16384
    assert ring <= ck.metadata.shared <= ring + 1024 <= gluon_ws.SHARED_MAX


def test_bf16_operands_take_the_kernel_unscaled(hopper, monkeypatch):
    """bf16 operands (both): the kernel applies; the launcher hands it 64-wide K boxes (128 bytes a row), SCALED
    off, AHEAD and PAIR off whatever was asked, INFLIGHT as asked; scales given for bf16 are refused; mixed
    dtypes are refused."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    calls = _recorded_launches(monkeypatch)
    op = _operands([3, 0, 5], 512, 512)
    a, b = op["a"].to(torch.bfloat16), op["b"].to(torch.bfloat16)
    assert gluon_ws.applies(a, b, op["c"]) is None
    assert "both alike" in gluon_ws.applies(a, op["b"], op["c"])
    with pytest.raises(ValueError, match="take no scales"):
        gluon_ws.launch(a, op["a_s"], op["offs"], b, None, op["c"], op["offs"])
    gluon_ws.launch(a, None, op["offs"], b, None, op["c"], op["offs"], stages=3, pair=True, ahead=True, wide=True,
                    inflight=True, epi_tma=True, group_m=8)
    (grid, args, meta), = calls
    assert args[0].block_shape == [128, 64] and args[1].block_shape == [256, 64]
    assert not meta["SCALED"] and meta["INFLIGHT"] and not meta["AHEAD"] and not meta["PAIR"]
    assert set(gluon_ws.BF16) <= set(gluon_ws.launch.__code__.co_varnames)
