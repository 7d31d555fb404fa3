"""The warp-specialised Gluon sparse MLA variants (cpkv.kernels.sparse_mla.gluon_ws.VARIANTS) without a GPU.

The L2-hint PTX rewrite on synthetic PTX; every variant compiled offline for sm_90a (Triton ships ptxas; skipped
without Triton's NVIDIA tools or Gluon): no spills, 168 registers, no ptxas warning (a serialised wgmma is one),
the wgmma count of its schedule, at most the 232,448 B of shared memory, L2 hints on
exactly the key gathers, and in the SASS the schedule each switch promises: named-barrier consumer syncs (NAMED),
exponentials after the max signals (EARLY), index loads after the proxy fences (LATE_IDX), P0 shared under
consumer 0's value wgmma (OVERLAP), P1 shared before consumer 1's (P1_FIRST), mbarrier waits without a
warpgroup barrier in front (SPLIT_BARS).
Their outputs against the float64 reference: tests/attention/test_attention_gpu.py (CUDA).
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from cpkv.errors import AttentionError
from cpkv.kernels.sparse_mla import gluon_ws

SMEM_DATA = 230_512  # Q 72 KB + 2 x 72 KB keys + P1 8 KB + row maxima and sums (2 x 512 B) + 14 barriers
SMEM_DATA_PERSIST = 231_032  # + row sums by tile parity (512 B) + the Q-free barrier
# what Triton adds (partition captures, scratch: 280-456 B): SMEM_DATA* <= shared <= SMEM_LIMIT
SMEM_LIMIT = 232_448  # sm_90's largest dynamic shared memory per block

PTX = """.visible .entry k(
\t.param .u64 k_param_0
)
{
\t.reg .pred \t%p<3>;
\t.reg .b32 \t%r<50>;
\t.reg .b64 \t%rd<40>;
\tmov.b32 \t%r1, 0;
\tcp.async.cg.shared.global [ %r44 + 0 ], [ %rd29 + 0 ], 0x10, %r45;
\t// begin inline asm
\t// cpkv-sparse-mla-l2-v1
\tmov.b32 $0, 0;
\t// end inline asm
\tcp.async.cg.shared.global [ %r46 + 0 ], [ %rd30 + 0 ], 0x10, %r45;
\tcp.async.cg.shared.global [ %r47 + 1024 ], [ %rd31 + 128 ], 0x10, %r48;
\tcp.async.ca.shared.global [ %r47 + 0 ], [ %rd31 + 0 ], 0x8, %r48;
\tret;
}
"""


def test_l2_hint_rewrites_the_copies_after_the_mark() -> None:
    out = gluon_ws.l2_hint_ptx(PTX)
    hinted = re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint\.L2::256B (.*);", out)
    assert hinted == ["[ %r46 + 0 ], [ %rd30 + 0 ], 16, %r45, %cpkv_l2_policy",
                      "[ %r47 + 1024 ], [ %rd31 + 128 ], 16, %r48, %cpkv_l2_policy"]
    assert "cp.async.cg.shared.global [ %r44 + 0 ], [ %rd29 + 0 ], 0x10, %r45;" in out  # before the mark (Q)
    assert "cp.async.ca.shared.global [ %r47 + 0 ], [ %rd31 + 0 ], 0x8, %r48;" in out  # 8-byte .ca: untouched
    lines = out.splitlines()
    decl = lines.index("\t.reg .b64 \t%cpkv_l2_policy;")
    assert lines[decl - 1] == "\t.reg .b64 \t%rd<40>;"  # after the entry's declarations, before any instruction
    assert lines[decl + 1] == "\tcreatepolicy.fractional.L2::evict_last.b64 \t%cpkv_l2_policy, 1.0;"
    assert out.count("createpolicy") == 1


def test_l2_hint_leaves_unmarked_ptx_and_refuses_a_mark_without_copies() -> None:
    plain = PTX.replace(gluon_ws.L2_MARK, "something else")
    assert gluon_ws.l2_hint_ptx(plain) == plain
    head, _, _ = PTX.partition("\tcp.async.cg.shared.global [ %r46")
    with pytest.raises(RuntimeError, match="got 0 copies"):
        gluon_ws.l2_hint_ptx(head + "\tret;\n}\n")


@pytest.mark.triton
def test_ptx_hook_chains_and_installs_once(monkeypatch) -> None:
    from triton import knobs

    seen = []
    prev = lambda backend, stages, options, language, capability: seen.append(capability)  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", prev)
    gluon_ws.install_ptx_hook()
    hook = knobs.runtime.add_stages_inspection_hook
    gluon_ws.install_ptx_hook()
    assert knobs.runtime.add_stages_inspection_hook is hook is not prev
    stages = {"ptx": lambda src, metadata: src, "cubin": None}
    hook(None, stages, None, None, 90)
    assert seen == [90]
    assert stages["ptx"](PTX, {}) == gluon_ws.l2_hint_ptx(PTX) != PTX
    assert stages["ptx"]("// plain", {}) == "// plain"


def test_variant_registry() -> None:
    from cpkv.kernels.sparse_mla import triton as kernel

    assert list(gluon_ws.VARIANTS)[0] == gluon_ws.DEFAULT_VARIANT == kernel.GLUON_WS.impl
    assert [c.impl for c in kernel.gluon_variant_configs()] == list(gluon_ws.VARIANTS)
    assert kernel.gluon_variant_configs()[1].tag() == "h64 k64 w12 s2 gluon_ws"
    for flags in gluon_ws.VARIANTS.values():
        # setmaxnreg re-split of 168 x 3 warpgroups: consumer 0 gets 504 - consumer 1 - producer (56)
        assert set(flags) == {"L2_HINT", "AHEAD", "C1_REGS", "PERSIST", "NAMED", "EARLY", "LATE_IDX", "OVERLAP",
                              "P1_FIRST", "SPLIT_BARS"}
        assert flags["C1_REGS"] % 8 == 0
        assert 3 * gluon_ws.MAX_REGS - flags["C1_REGS"] - 56 <= 256
    with pytest.raises(AttentionError, match="expected one of gluon_ws_persist, .*got 'nope'"):
        gluon_ws.variant_flags("nope")


# offline sm_90a compiles ---------------------------------------------------------------------------------

def _nvidia_tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        pytest.skip(f"Triton's NVIDIA backend ships no {name} here")
    return path


def _compile_sm90(variant: str, dense: bool = False):
    """The kernel of ``variant`` compiled for sm_90a from CPU stand-ins of GLM-5 launch arguments (64 heads)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import native_specialize_impl

    fn = gluon_ws.load()
    q, kv = torch.empty(4, 64, 576, dtype=torch.bfloat16), torch.empty(100, 576, dtype=torch.bfloat16)
    idx, out, lse = torch.empty(4, 2048, dtype=torch.int32), torch.empty(4, 64, 512, dtype=torch.bfloat16), torch.empty(4, 64)
    consts = {"DENSE": dense, **gluon_ws.variant_flags(variant)}
    args = (q, kv, idx, idx, idx, out, lse, 100, 64, 2048, 0.1, 36864, 576, 576, 2048, 32768, 512, 64, 8)
    sig, cx, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], cx[(i,)] = "constexpr", consts[name]
            continue
        ty, spec = native_specialize_impl(BaseBackend, args[i], False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            cx[(i,)] = args[i]
        elif isinstance(spec, str) and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(GluonASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": gluon_ws.MAX_REGS})


@pytest.mark.triton
@pytest.mark.parametrize("variant", list(gluon_ws.VARIANTS))
def test_variant_compiles_for_sm90_without_spills(variant: str, tmp_path) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    ptxas, cuobjdump = _nvidia_tool("ptxas"), _nvidia_tool("cuobjdump")
    flags = gluon_ws.variant_flags(variant)
    ck = _compile_sm90(variant)
    ptx = ck.asm["ptx"]
    (tmp_path / "k.ptx").write_text(ptx)
    rep = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert "warning" not in rep.stderr.lower(), rep.stderr  # a serialised wgmma is reported as one
    assert "0 bytes spill stores, 0 bytes spill loads" in rep.stderr, rep.stderr
    # hardware barriers: Triton's 0..3 (CTA, partitions); NAMED adds 8..12 (consumer syncs: max0, max1, P0, P1,
    # row sums)
    assert f"Used {gluon_ws.MAX_REGS} registers, used {13 if flags['NAMED'] else 4} barriers" in rep.stderr, rep.stderr
    (tmp_path / "k.cubin").write_bytes(ck.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                          timeout=300).stdout
    assert not re.search(r"\b(STL|LDL)\b", sass)
    assert (SMEM_DATA_PERSIST if flags["PERSIST"] else SMEM_DATA) <= ck.metadata.shared <= SMEM_LIMIT
    # score wgmmas (n64, k16): 576 / 16 = 36 per consumer, 36 more in AHEAD (the peeled first block's and the
    # look-ahead's are two copies); value wgmmas (n256, k16): 64 keys / 16 = 4 per P x V product, two products
    # per consumer, 4 more in AHEAD (its last pair's product has its own branch)
    n64, n256 = (108, 20) if flags["AHEAD"] else (72, 16)
    assert len(re.findall(r"HGMMA\.64x64x16\.F32\.BF16", sass)) == n64
    assert len(re.findall(r"HGMMA\.64x256x16\.F32\.BF16", sass)) == n256
    # 16-byte copies per producer thread: Q 36, keys 72 (2 blocks x 64 rows x 576 dims x 2 B / 16 B / 128)
    hinted = len(re.findall(r"LDGSTS\.E\.BYPASS\.LTC256B\.128", sass))
    plain = len(re.findall(r"LDGSTS\.E\.BYPASS\.128", sass))
    assert (hinted, plain) == ((72, 36) if flags["L2_HINT"] else (0, 108))
    assert ptx.count("createpolicy.fractional.L2::evict_last") == int(flags["L2_HINT"])
    _check_consumer_syncs(flags, ptx, sass)
    _check_index_loads(flags, sass)
    _check_barrier_waits(flags, sass)


def _check_consumer_syncs(flags: dict, ptx: str, sass: str) -> None:
    """NAMED: the consumer-to-consumer syncs are bar.arrive / bar.sync of 256 threads on hardware barriers 8..12;
    EARLY: each consumer's 32 exponentials (+2 for the row rescale) scheduled after its max signal, not before;
    OVERLAP: consumer 0 shares P0 before waiting for its first value wgmma; P1_FIRST: consumer 1 shares P1
    before issuing its first."""
    arrives = sorted(re.findall(r"bar\.arrive (\d+), 256;", ptx))
    syncs = sorted(re.findall(r"bar\.sync (\d+), 256;", ptx))
    if not flags["NAMED"]:
        assert arrives == syncs == []
        return
    # per consumer loop: arrive max0 / P0 (consumer 0), max1 / P1 (consumer 1); sync on the other's; row sums 12
    assert arrives == ["10", "11", "8", "9"] and syncs == ["10", "11", "12", "12", "8", "9"]
    for bar in ("0x8", "0x9"):  # max0 (consumer 0), max1 (consumer 1)
        (m,) = re.finditer(rf"BAR\.ARV {bar}, 0x100", sass)
        rest = sass[m.end():]
        after = len(re.findall(r"MUFU\.EX2", rest[:rest.index("HGMMA.64x256x16")]))
        assert after == (34 if flags["EARLY"] else 0), (bar, after)
    # P0 ready (consumer 0): OVERLAP signals it with its value wgmma still in flight (no wait since it was issued)
    (m,) = re.finditer(r"BAR\.ARV 0xa, 0x100", sass)
    before = re.findall(r"HGMMA\.64x256x16|WARPGROUP\.DEPBAR", sass[:m.start()])[-1]
    assert before == ("HGMMA.64x256x16" if flags["OVERLAP"] else "WARPGROUP.DEPBAR"), before
    # P1 ready (consumer 1, after its max signal): P1_FIRST signals it before issuing its first value wgmma
    (m1,) = re.finditer(r"BAR\.ARV 0x9, 0x100", sass)
    (p1,) = re.finditer(r"BAR\.ARV 0xb, 0x100", sass)
    between = len(re.findall(r"HGMMA\.64x256x16", sass[m1.end():p1.start()]))
    assert (between == 0) if flags["P1_FIRST"] else (between >= 4), between


def _check_index_loads(flags: dict, sass: str) -> None:
    """The consumers' index loads (LDG.E.64) and the proxy fence (MEMBAR.ALL.CTA, which waits for every load of
    the thread in flight): LATE_IDX issues them under the score wgmmas, after the fences; else a fence follows."""
    events = [m[1] for m in re.finditer(r"\b(LDG\.E\.64|MEMBAR\.ALL\.CTA|HGMMA)\b", sass)]
    after = [next((e for e in events[i + 1:] if e != "LDG.E.64"), None) for i, e in enumerate(events)
             if e == "LDG.E.64"]
    assert after, "no index loads found in the consumers"
    if flags["LATE_IDX"]:
        assert set(after) == {"HGMMA"}, after
    else:
        assert "MEMBAR.ALL.CTA" in after, after


def _check_barrier_waits(flags: dict, sass: str) -> None:
    """mbarrier waits (SYNCS.PHASECHK) right after a warpgroup barrier (BAR.SYNC of 128 threads) that Triton's
    shared-memory analysis puts there when the barriers are one allocation: SPLIT_BARS leaves 4 of 26 (no arrive
    or wait on the same barrier since the last sync), else 10 or more."""
    events = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x[0-9a-f]+(?:, 0x80)?|SYNCS\.PHASECHK|HGMMA|BAR\.ARV|SYNCS\.ARRIVE"
                        r"|LDGSTS", sass)
    synced = sum(1 for i, e in enumerate(events) if e == "SYNCS.PHASECHK" and i and events[i - 1].endswith(", 0x80"))
    assert (synced <= 4) if flags["SPLIT_BARS"] else (synced >= 10), synced
