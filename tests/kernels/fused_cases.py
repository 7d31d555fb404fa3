"""Cases of the fused elementwise kernels, run by Triton's interpreter on CPU tensors (not collected by pytest:
``test_fused_interpret.py`` runs each case in a subprocess with TRITON_INTERPRET=1, set before Triton loads).

    python tests/kernels/fused_cases.py <case>      exit 0 when every check holds

Triton 3.6's interpreter rounds float32 -> bfloat16 toward zero and float32 -> fp8 e4m3 half-up without
carrying into the exponent (126.9 -> 64); the GPU rounds both to nearest even (the kernels ask for it).
``patch_interpreter_rounding`` makes the interpreter round as the GPU does (through torch's conversions), so
the checks below hold the kernels to the GPU's semantics; the kernels themselves are not changed for it.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

SKIP = 77  # exit status: the case cannot run on this Triton (the pytest wrapper skips it)


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds a scalar kernel argument as a 1-element 1-d array and turns it into a loop
    bound with ``int(array)``, which NumPy >= 2.3 refuses (``range(program_id, blocks, num_programs)`` with blocks
    from an argument): after its own patching, __index__ reads the one element (what the GPU does)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def patch_interpreter_rounding() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:  # another Triton whose interpreter converts elsewhere: the checks cannot be trusted
        print("this Triton's interpreter has no _convert_float to patch")
        sys.exit(SKIP)
    targets = {tl.bfloat16: (torch.bfloat16, torch.uint16), tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8)}

    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst in targets:
            to, bits = targets[dst]
            t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(to)
            return t.view(bits).numpy().reshape(data.shape)
        return original(data, src, dst, rounding_mode)

    interpreter._convert_float = convert


def ulp(x: torch.Tensor) -> torch.Tensor:
    """float32: one unit in the last place of each value of x in x's dtype."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[x.dtype]
    _, e = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - bits).clamp(min=2.0 ** -126)


def within_ulp(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> bool:
    """True when every value of ``got`` is within ``ulps`` units in the last place of ``want`` (their dtype)."""
    return bool(((got.float() - want.float()).abs() <= ulps * ulp(want)).all())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def case_add_rms_norm() -> None:
    from cpkv.kernels.add_norm import triton as kern
    from cpkv.kernels.add_norm.ref import add_rms_norm_ref
    from cpkv.kernels.fp8_gemm.ref import act_quant_ref
    from cpkv.model.linear import empty_quant

    bf16, f32 = torch.bfloat16, torch.float32
    for t, d, dtype, with_delta, quant in [(1, 256, bf16, True, True), (7, 640, bf16, True, True),
                                           (5, 300, bf16, True, True), (3, 512, bf16, False, True),
                                           (4, 384, f32, True, False), (6, 200, bf16, False, False)]:
        gen = _gen(t * d)
        h = (torch.randn(t, d, generator=gen) * 3).to(dtype)
        delta = (torch.randn(t, d, generator=gen) * 2).to(dtype) if with_delta else None
        if with_delta:
            delta[0, :128] = -h[0, :128]  # a zero group after the add: scale 0, zeros
        w = (torch.randn(d, generator=gen) * 0.5 + 1).to(dtype)
        h_out = torch.full_like(h, float("nan")) if with_delta else None
        x = torch.full_like(h, float("nan"))
        q, s = empty_quant(t, d, torch.device("cpu")) if quant else (None, None)
        kern.add_rms_norm(h, delta, w, 1e-5, h_out, x, q, s)
        hs, want_x, _ = add_rms_norm_ref(h, delta, w, 1e-5)
        if with_delta:
            assert torch.equal(h_out, hs), f"h + delta differs at {(t, d)}"
        # bf16: one rounding of nearly equal float32 values; float32: the sum order moves rstd by an ulp or two
        assert within_ulp(x, want_x, 1 if dtype == torch.bfloat16 else 4), f"x beyond the tolerance at {(t, d, dtype)}"
        assert dtype != torch.bfloat16 or (x == want_x).float().mean() >= 0.9, "bf16 x mostly equal to the reference"
        if quant:
            rq, rs = act_quant_ref(x)
            assert torch.equal(s, rs), f"scales differ at {(t, d)}"
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), f"fp8 bytes differ at {(t, d)}"
            if with_delta:
                assert s[0, 0] == 0 and not q[0, :128].float().any()
    kern.add_rms_norm(torch.empty(0, 256), None, torch.ones(256), 1e-6, None, torch.empty(0, 256))  # T = 0


def case_token_rows() -> None:
    from cpkv.attention.ref import quant_token_kv_ref, row_views
    from cpkv.config import RopeConfig, RowFormat
    from cpkv.kernels.token_rows import triton as kern
    from cpkv.kernels.token_rows.ref import token_kv_ref, token_rows_ref
    from cpkv.model.ops import Rotary

    yarn = RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
                      mscale_all_dim=1.0)
    for t, fmt, dtype, launch in [(9, RowFormat(512, 4, 64), torch.bfloat16, None),
                                  (3, RowFormat(128, 1, 32), torch.bfloat16, (2, 4)),
                                  (5, RowFormat(256, 2, 16), torch.float32, None)]:
        gen = _gen(t)
        d_l, d_r = fmt.fp8_bytes, fmt.rope_dims
        kv = (torch.randn(t, d_l + d_r + 8, generator=gen) * 4).to(dtype)[:, 8:]  # a row stride wider than the row
        kv[0, 128:256 if d_l > 128 else 128] = 0  # a zero latent group (when there are two)
        w = (torch.randn(d_l, generator=gen) * 0.3 + 1).to(dtype)
        rot = Rotary.build(torch.arange(t) * 977 + 3, d_r, yarn)
        rows = torch.zeros(t, fmt.row_bytes, dtype=torch.uint8)
        out = torch.full((t, d_l + d_r), float("nan"), dtype=dtype)
        kern.token_rows(kv, w, rot.cos, rot.sin, 1e-6, *row_views(rows, fmt), out=out, launch=launch)
        want = token_kv_ref(kv, w, rot.cos, rot.sin, 1e-6)
        assert torch.equal(out[:, d_l:], want[:, d_l:]), f"rope differs at {(t, fmt)}"
        assert within_ulp(out[:, :d_l], want[:, :d_l], 1 if dtype == torch.bfloat16 else 4), f"latent at {(t, fmt)}"
        assert torch.equal(rows, quant_token_kv_ref(out, fmt)), f"row bytes of the kernel's values at {(t, fmt)}"
        ref_rows = token_rows_ref(kv, w, rot.cos, rot.sin, 1e-6, fmt)
        assert (rows == ref_rows).float().mean() >= 0.95, "row bytes mostly equal to the reference's"
        again = torch.zeros_like(rows)
        kern.token_rows(kv, w, rot.cos, rot.sin, 1e-6, *row_views(again, fmt), launch=launch)
        assert torch.equal(again, rows), "rows without the values output"
    empty = torch.zeros(0, 656, dtype=torch.uint8)
    kern.token_rows(torch.zeros(0, 576), torch.ones(512), torch.zeros(0, 32), torch.zeros(0, 32), 1e-6,
                    *row_views(empty, RowFormat(512, 4, 64)))  # T = 0


def near_fp8(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp8 values within one e4m3 step of each other (3 mantissa bits), and at most 2 % of them differing."""
    g, w = got.float(), want.float()
    return bool(((g - w).abs() <= w.abs() * 2.0 ** -3 + 2.0 ** -9).all()) and float((g != w).float().mean()) <= 0.02


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())


def case_head_weights() -> None:
    from cpkv.kernels.index_rows import triton as kern
    from cpkv.kernels.index_rows.ref import head_weights_ref

    for t, k, n in [(37, 300, 32), (1, 256, 4), (70, 128, 20), (3, 2100, 32)]:  # 2100: K in 7 slices
        gen = _gen(t + k)
        x = torch.randn(t, k + 2, generator=gen).bfloat16()[:, 2:]  # a wider row stride
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        out = torch.full((t, n), float("nan"))
        kern.head_weights(x, w, 0.125, out)
        want = head_weights_ref(x, w, 0.125)
        bound = (x.float().abs() @ w.abs().t()) * 0.125 * 2.0 ** -20  # float32 sums in another order
        assert bool(((out - want).abs() <= bound).all()), f"head weights at {(t, k, n)}"
    kern.head_weights(torch.zeros(0, 64), torch.zeros(8, 64), 1.0, torch.zeros(0, 8))  # T = 0
    # a row's value does not depend on the rows beside it (a decode step's row equals its prefill row)
    gen = _gen(9)
    x, w = torch.randn(70, 2100, generator=gen).bfloat16(), torch.randn(32, 2100, generator=gen) / 50
    every, one = torch.empty(70, 32), torch.empty(1, 32)
    kern.head_weights(x, w, 0.5, every)
    kern.head_weights(x[66:67], w, 0.5, one)
    assert torch.equal(every[66:67], one)


def case_rope() -> None:
    from cpkv.kernels.rope import triton as kern
    from cpkv.kernels.rope.ref import rope_interleaved_ref
    from cpkv.model.ops import Rotary

    for t, h, r, dtype in [(5, 3, 64, torch.bfloat16), (2, 4, 32, torch.float32), (1, 1, 16, torch.bfloat16)]:
        gen = _gen(t * h * r)
        q = (torch.randn(t, h, 96 + r, generator=gen) * 3).bfloat16()[..., 96:]  # the query's rope part (a view)
        rot = Rotary.build(torch.arange(t) * 41 + 2, r, 10000.0)
        full = torch.full((t, h, 5 + r), float("nan"), dtype=dtype)
        kern.rope_interleaved(q, rot.cos, rot.sin, full[..., 5:])
        assert torch.equal(full[..., 5:], rope_interleaved_ref(q, rot.cos, rot.sin, dtype)), f"at {(t, h, r)}"
        assert torch.equal(full[..., 5:], rot.interleaved_ref(q).to(dtype)) and full[..., :5].isnan().all()


def case_combine() -> None:
    from cpkv.kernels.combine import triton as kern
    from cpkv.kernels.combine.ref import combine_ref

    for t, k, d, with_add, dtype in [(5, 4, 300, True, torch.bfloat16), (9, 8, 512, False, torch.bfloat16),
                                     (3, 2, 1030, True, torch.float32)]:
        gen = _gen(t * k + d)
        y = (torch.randn(t * k + 3, d, generator=gen) * 2).to(dtype)  # 3 padding rows nobody reads
        inv = torch.randperm(t * k, generator=gen)
        add = (torch.randn(t, d, generator=gen)).to(dtype) if with_add else None
        out = torch.full((t, d), float("nan"), dtype=dtype)
        kern.combine(y, inv, add, out)
        want, part = combine_ref(y, inv, t, k, add), combine_ref(y, inv, t, k)
        n = 1 if dtype == torch.bfloat16 else 8  # an ulp of the sum (other order), then one of the add
        assert bool(((out.float() - want.float()).abs() <= n * (ulp(part) + ulp(want))).all()), f"at {(t, k, d)}"
        assert dtype != torch.bfloat16 or (out == want).float().mean() >= 0.9
    kern.combine(torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64), None, torch.zeros(0, 64))  # T = 0


def case_swiglu() -> None:
    from cpkv.kernels.swiglu import triton as kern
    from cpkv.kernels.swiglu.ref import swiglu_weighted_ref

    for n, i, dtype in [(5, 256, torch.bfloat16), (19, 200, torch.bfloat16), (3, 128, torch.float32)]:
        gen = _gen(n * i)
        gu = (torch.randn(n, 2 * i + 6, generator=gen) * 3).to(dtype)[:, 6:]  # a wider row stride
        rw = torch.rand(n, generator=gen)
        out = torch.full((n, i), float("nan"), dtype=dtype)
        kern.swiglu_weighted(gu, rw, out)
        want = swiglu_weighted_ref(gu, rw)
        # tl.exp here (the interpreter runs no libdevice) against torch's CPU exp: a silu one ulp off moves the two
        # products after it by up to a few ulps (rarely); mostly equal
        assert within_ulp(out, want, 4 if dtype == torch.bfloat16 else 8), f"at {(n, i, dtype)}"
        assert dtype != torch.bfloat16 or (out == want).float().mean() >= 0.9, f"mostly equal at {(n, i, dtype)}"
    kern.swiglu_weighted(torch.zeros(0, 256), torch.zeros(0), torch.zeros(0, 128))  # N = 0
    # a device row count: rows 0..10 computed (as without it), rows 11.. untouched, with and without weights
    gen = _gen(77)
    gu = (torch.randn(19, 400, generator=gen) * 3).bfloat16()
    rw = torch.rand(19, generator=gen)
    for weights in (rw, None):
        full = torch.full((19, 200), float("nan"), dtype=torch.bfloat16)
        kern.swiglu_weighted(gu, weights, full)
        part = torch.full((19, 200), 7.0, dtype=torch.bfloat16)
        kern.swiglu_weighted(gu, weights, part, torch.tensor([11], dtype=torch.int32))
        assert torch.equal(part[:11], full[:11]) and bool((part[11:] == 7.0).all())


def case_swiglu_plain() -> None:
    """No row weights (the dense MLPs): ``F.silu(g) * u``'s two roundings; the dispatch in ``model.linear.swiglu``
    with Linears whose backends run Triton gives the kernel's bytes."""
    from cpkv.kernels.platform import Backends
    from cpkv.kernels.swiglu import triton as kern
    from cpkv.kernels.swiglu.ref import swiglu_ref
    from cpkv.model.linear import Linear, swiglu

    for n, i in [(5, 256), (19, 200), (1, 128)]:
        gen = _gen(n * i + 1)
        gu = (torch.randn(n, 2 * i + 6, generator=gen) * 3).bfloat16()[:, 6:]
        out = torch.full((n, i), float("nan"), dtype=torch.bfloat16)
        kern.swiglu_weighted(gu, None, out)
        want = swiglu_ref(gu)
        assert within_ulp(out, want, 2), f"at {(n, i)}"
        assert (out == want).float().mean() >= 0.9, f"mostly equal at {(n, i)}"
    gen = _gen(7)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    gate_up, down = Linear(torch.randn(256, 64, generator=gen).bfloat16()), Linear(torch.randn(64, 128, generator=gen).bfloat16())
    want = swiglu(x, gate_up, down)
    on = Backends(triton=True)
    got = swiglu(x, Linear(gate_up.weight, backends=on), Linear(down.weight, backends=on))
    gu = gate_up(x)
    a = torch.empty(9, 128, dtype=torch.bfloat16)
    kern.swiglu_weighted(gu, None, a)
    assert torch.equal(got, down(a)) and within_ulp(got, want, 64)


def case_dispatch() -> None:
    """The dispatch points' Triton branches (buffers, views, strides) on CPU tensors: backends that run Triton
    handed to them, their results against the same calls' torch path."""
    from cpkv.attention import quant as attention_quant
    from cpkv.attention.ref import GLM5_TOKEN, row_views
    from cpkv.indexer import dequantize_index_rows, head_weights, prepare_index_keys, prepare_index_queries
    from cpkv.kernels.platform import Backends
    from cpkv.model.experts import swiglu_weighted
    from cpkv.model.ops import Rotary, add_rms_norm

    gen = _gen(11)
    t = 6
    h, delta = (torch.randn(2, t, 1024, generator=gen) * 2).bfloat16()
    w = (torch.randn(1024, generator=gen) + 1).bfloat16()
    kv = (torch.randn(t, 576, generator=gen) * 3).bfloat16()
    kw = (torch.randn(512, generator=gen) * 0.2 + 1).bfloat16()
    rot = Rotary.build(torch.arange(t) * 5, 64, 10000.0)
    k, lw, lb = torch.randn(t, 128, generator=gen).bfloat16(), torch.ones(128).bfloat16(), torch.zeros(128).bfloat16()
    q, wts = torch.randn(t, 8, 128, generator=gen).bfloat16(), torch.rand(t, 8, generator=gen)
    gu, rw = torch.randn(t, 512, generator=gen).bfloat16(), torch.rand(t, generator=gen)
    pw = torch.randn(32, 1024, generator=gen) / 32

    def run(b=None):
        return (add_rms_norm(h, delta, w, 1e-5, quant=True, backends=b),
                attention_quant.token_rows(kv, kw, rot.cos, rot.sin, 1e-6, GLM5_TOKEN, b),
                prepare_index_keys(k, lw, lb, rot.cos, rot.sin, 64, True, backends=b),
                prepare_index_queries(q, wts, rot.cos, rot.sin, 64, True, b), swiglu_weighted(gu, rw, backends=b),
                head_weights(h, pw, 0.25, b))

    want = run()
    qrope = torch.randn(t, 4, 128, generator=gen).bfloat16()[..., 64:]
    want_rope = rot.interleaved(qrope, out=torch.empty(t, 4, 64, dtype=torch.bfloat16))
    on = Backends(triton=True)
    got = run(on)
    (hs, x, qa), (whs, wx, wqa) = got[0], want[0]
    assert torch.equal(hs, whs) and within_ulp(x, wx)
    assert qa.s.stride() == (1, 8) and qa.x is x  # empty_quant's outer-dim-major scales (T rounded up to 8)
    from cpkv.kernels.fp8_gemm.ref import act_quant_ref
    rq, rs = act_quant_ref(x)
    assert torch.equal(qa.s, rs) and torch.equal(qa.q.view(torch.uint8), rq.view(torch.uint8))
    fmt = GLM5_TOKEN
    assert torch.equal(row_views(got[1], fmt)[2], row_views(want[1], fmt)[2])  # rope bytes
    assert rel(row_views(got[1], fmt)[1], row_views(want[1], fmt)[1]) <= 2 ** -7  # scales (latent within an ulp)
    gk, gs = dequantize_index_rows(got[2])
    wk, ws = dequantize_index_rows(want[2])
    assert rel(gs, ws) <= 1e-5 and near_fp8(gk, wk)
    assert got[3][0].shape == (t, 8, 128) and rel(got[3][1], want[3][1]) <= 1e-5 and near_fp8(got[3][0], want[3][0])
    assert within_ulp(got[4], want[4])
    assert torch.equal(rot.interleaved_into(qrope, torch.empty(t, 4, 64, dtype=torch.bfloat16), on), want_rope)
    assert bool(((got[5] - want[5]).abs() <= (h.float().abs() @ pw.abs().t()) * 0.25 * 2.0 ** -20).all())


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


if __name__ == "__main__":
    patch_interpreter_rounding()
    patch_interpreter_index()
    CASES[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
