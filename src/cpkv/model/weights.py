"""DSA model weights: the public checkpoint naming, random weights from a seed, safetensors loading.

Names and shapes (``[out, in]`` for linear layers), as in the GLM-5 / DeepSeek-V3.2 checkpoints::

    model.embed_tokens.weight                               [vocab, hidden]
    model.layers.N.input_layernorm.weight                   [hidden]
    model.layers.N.self_attn.q_a_proj.weight                [q_lora, hidden]
    model.layers.N.self_attn.q_a_layernorm.weight           [q_lora]
    model.layers.N.self_attn.q_b_proj.weight                [H * (nope + rope), q_lora]
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight      [kv_lora + rope, hidden]
    model.layers.N.self_attn.kv_a_layernorm.weight          [kv_lora]
    model.layers.N.self_attn.kv_b_proj.weight               [H * (nope + v), kv_lora]
    model.layers.N.self_attn.o_proj.weight                  [hidden, H * v]
    full indexer layers only:
    model.layers.N.self_attn.indexer.wq_b.weight            [Hi * Di, q_lora]
    model.layers.N.self_attn.indexer.wk.weight              [Di, hidden]
    model.layers.N.self_attn.indexer.k_norm.weight / .bias  [Di]   (LayerNorm)
    model.layers.N.self_attn.indexer.weights_proj.weight    [Hi, hidden]
    model.layers.N.post_attention_layernorm.weight          [hidden]
    dense layers (N < first_k_dense_replace):
    model.layers.N.mlp.{gate_proj,up_proj}.weight           [inter, hidden]
    model.layers.N.mlp.down_proj.weight                     [hidden, inter]
    MoE layers:
    model.layers.N.mlp.gate.weight                          [experts, hidden]
    model.layers.N.mlp.gate.e_score_correction_bias         [experts]
    model.layers.N.mlp.experts.E.{gate_proj,up_proj}.weight [moe_inter, hidden]
    model.layers.N.mlp.experts.E.down_proj.weight           [hidden, moe_inter]
    model.layers.N.mlp.shared_experts.{gate_proj,up_proj}.weight  [moe_inter * shared, hidden]
    model.layers.N.mlp.shared_experts.down_proj.weight      [hidden, moe_inter * shared]
    model.norm.weight                                       [hidden]
    lm_head.weight                                          [vocab, hidden]

Checkpoints: ``*.safetensors`` files, or the shards a ``model.safetensors.index.json`` lists; tensors of
layers beyond the model's depth (DeepSeek's MTP layer 61, or a ``--num-layers`` cut) are not read, nor
(expert parallelism, ``experts=``) the routed experts other ranks hold.
Block-quantised fp8 weights (a float8 ``.weight`` beside ``.weight_scale_inv``, one float32 scale per
128 x 128 block): with ``fp8=True`` the linear weights the model runs as block-scaled fp8 GEMMs
(``fp8_kept``: ``FP8_LINEARS``, every linear weight of a layer but ``kv_b_proj``, split into W_UK / W_UV,
the indexer's ``weights_proj`` and the router, bf16 in the public files) stay fp8 beside their scales,
and a dense checkpoint's are quantised to that format (``quant_fp8_blocks``); every other fp8 tensor,
and all of them without ``fp8``, is **dequantised at load** into the compute dtype.
``cpkv.model.checkpoint.check_checkpoint`` validates every file header, name and shape without reading
tensor data (the parent process runs it before any rank starts).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from cpkv.config import ModelConfig
from cpkv.errors import CheckpointError
from cpkv.model.checkpoint import (FP8_LINEARS, expected_shapes, fp8_kept, is_local,  # noqa: F401  (the public names live there)
                                   layer_shapes)

Weights = dict[str, torch.Tensor]
NORM_SUFFIXES = ("layernorm.weight", "norm.weight")
FP8_BLOCK = 128
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}  # as GLM-5-FP8 / DeepSeek-V3.2 ship it


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", experts: range | None = None) -> Weights:
    """Seeded random weights: linear ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1).

    Drawn on ``device`` with a generator seeded per tensor (same seed, same device type -> same weights).
    ``experts``: only these routed experts (expert parallelism; None: all); the seed of a tensor is its index
    in the full model's list, so a rank's experts equal the full model's. The whole model at once: a model is
    built from ``random_weight_groups`` instead, one layer at a time.
    """
    out: Weights = {}
    for group in random_weight_groups(cfg, seed, dtype, device, experts):
        out.update(group)
    return out


def random_weight_groups(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu", experts: range | None = None, *,
                         fp8: bool = False) -> Iterator[Weights]:
    """``random_weights``' tensors (the same values) in groups a model is built from, one at a time: the outer
    tensors (embeddings, final norm, LM head), then each layer's (``model.layers.N.*``) in order. ``fp8``: each
    ``fp8_kept`` weight quantised (``quant_fp8_blocks``) as soon as it is drawn, its dense form dropped, so a group
    holds its stored form and the transient is one tensor's float32 draw. A tensor is one draw of its own
    generator (the values depend on the draw's shape, so it is never drawn in pieces); the largest draws, the
    embeddings and the head (float32 [vocab, hidden]: 3.8 GB at GLM-5), come first, while the device holds
    little else."""
    index = {name: i for i, name in enumerate(expected_shapes(cfg))}
    by_layer: dict[int | None, list[str]] = {}
    for name in local_shapes(cfg, experts):
        by_layer.setdefault(layer_of(name), []).append(name)
    shapes = expected_shapes(cfg)
    for key in [None, *range(cfg.num_layers)]:
        out: Weights = {}
        for name in by_layer.get(key, []):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index[name])
            w = _random_tensor(name, shapes[name], gen, device).to(dtype)
            if fp8 and fp8_kept(name):
                out[name], out[name + "_scale_inv"] = quant_fp8_blocks(w)
                del w
            else:
                out[name] = w
        yield out


def layer_of(name: str) -> int | None:
    """The layer a tensor belongs to (``model.layers.N.*`` -> N); None for the outer tensors."""
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".", 3)[2])


def by_layer(weights: Weights, num_layers: int) -> Iterator[Weights]:
    """``weights`` split as ``random_weight_groups`` orders them (outer tensors, then layers 0 .. num_layers - 1),
    the dict emptied as the groups are handed out (no tensor held twice; tensors of deeper layers dropped)."""
    keys: dict[int | None, list[str]] = {}
    for name in weights:
        keys.setdefault(layer_of(name), []).append(name)
    for key in [None, *range(num_layers)]:
        yield {name: weights.pop(name) for name in keys.get(key, [])}
    weights.clear()


def local_shapes(cfg: ModelConfig, experts: range | None = None) -> dict[str, tuple[int, ...]]:
    """``expected_shapes(cfg)`` without the routed experts outside ``experts`` (None: every tensor)."""
    return {k: v for k, v in expected_shapes(cfg).items() if is_local(k, experts)}


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if name.endswith(NORM_SUFFIXES):
        return 1.0 + 0.1 * x
    if name.endswith("bias"):  # k_norm.bias, the router's e_score_correction_bias
        return 0.1 * x
    if name == "model.embed_tokens.weight":
        return x
    return x / shape[-1] ** 0.5


def check_weights(weights: Weights, cfg: ModelConfig, source: str = "weights", experts: range | None = None) -> None:
    """CheckpointError naming every missing or mis-shaped tensor (of the routed ``experts`` only, when given)."""
    problems = []
    for name, shape in local_shapes(cfg, experts).items():
        t = weights.get(name)
        if t is None:
            problems.append(f"missing {name} (expected shape {list(shape)})")
        elif tuple(t.shape) != shape:
            problems.append(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{source}: {shown}")


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", experts: range | None = None, *, fp8: bool = False) -> Weights:
    """Read the tensors ``cfg`` needs from the checkpoint at ``path`` (headers checked first; tensors of other
    layers not read). ``experts``: read only these routed experts (expert parallelism: a rank's block; None:
    all). ``fp8``: the ``fp8_kept`` linear weights as float8_e4m3fn + ``<name>_scale_inv``: the
    ones an fp8 checkpoint stores fp8 (those it keeps dense stay dense), or all of them quantised here when
    the checkpoint has no fp8 tensor; every other fp8 tensor is dequantised."""
    from safetensors import SafetensorError, safe_open

    from cpkv.model.checkpoint import check_checkpoint

    index = check_checkpoint(path, cfg)
    wanted = set(local_shapes(cfg, experts))
    by_file: dict[Path, list[str]] = {}
    for name in wanted | {n + "_scale_inv" for n in wanted if n + "_scale_inv" in index}:
        by_file.setdefault(index[name].file, []).append(name)
    raw: Weights = {}
    for f, names in sorted(by_file.items()):
        try:
            with safe_open(str(f), framework="pt") as st:
                raw.update({name: st.get_tensor(name) for name in sorted(names)})
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{f}: cannot read tensors ({exc})") from None
    out: Weights = {}
    quantise = not any(is_fp8(t) for t in raw.values())  # a dense checkpoint: quantised at load
    for name in wanted:
        if fp8 and fp8_kept(name) and (quantise or is_fp8(raw[name])):
            out.update(_fp8_pair(raw, name, device))
        else:
            out[name] = _dequant(raw, name).to(device=device, dtype=dtype, copy=True)
    check_weights(out, cfg, str(path), experts)
    return out


def _fp8_pair(raw: Weights, name: str, device: torch.device | str) -> Weights:
    """{name: float8_e4m3fn [R, C], name_scale_inv: float32 [R/128, C/128]} on ``device`` (as stored, or
    quantised from a dense weight)."""
    w, scale = raw[name], raw.get(name + "_scale_inv")
    if scale is None or w.dtype != torch.float8_e4m3fn:
        q, s = quant_fp8_blocks(_dequant(raw, name).to(device))
        return {name: q, name + "_scale_inv": s}
    return {name: w.to(device, copy=True), name + "_scale_inv": scale.to(device=device, dtype=torch.float32, copy=True)}


def to_fp8(weights: Weights, consume: bool = False, quantise: bool | None = None) -> Weights:
    """``weights`` with every ``fp8_kept`` weight quantised to 128 x 128 blocks, when none is fp8 yet (a dense
    checkpoint or random weights); weights already holding fp8 tensors (an fp8 checkpoint) as they are.
    ``consume``: quantise in ``weights`` itself, each dense tensor dropped as its fp8 form arrives (the peak is
    the dense model plus one tensor, not the dense model plus its fp8 copy). ``quantise``: that decision taken
    already over the whole model (``weights`` is one layer's group of it); None: decided from ``weights``."""
    out = weights if consume else dict(weights)
    if quantise is None:
        quantise = not any(is_fp8(w) for w in out.values())
    if not quantise:
        return out
    for name in [n for n, w in out.items() if fp8_kept(n) and not is_fp8(w)]:
        out[name], out[name + "_scale_inv"] = quant_fp8_blocks(out[name])
    return out


def to_dense(weights: Weights, dtype: torch.dtype, consume: bool = False) -> Weights:
    """``weights`` with every fp8 tensor that has a ``_scale_inv`` dequantised into ``dtype`` (scales dropped).
    ``consume``: ``weights`` is emptied as the result fills (no tensor held twice)."""
    out = {}
    for name in list(weights):
        if name not in weights or (name.endswith("_scale_inv") and name[: -len("_scale_inv")] in weights):
            continue  # a scale already used with its weight, or one its weight will use
        w = weights[name]
        out[name] = _dequant(weights, name).to(dtype) if is_fp8(w) else w
        if consume:
            del weights[name]
            weights.pop(name + "_scale_inv", None)
    if consume:
        weights.clear()
    return out


def _dequant(raw: Weights, name: str) -> torch.Tensor:
    """A float8 weight times its per-128x128-block ``weight_scale_inv`` (other dtypes pass through)."""
    w, scale = raw[name], raw.get(name + "_scale_inv")
    if scale is None or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return w
    from cpkv.kernels.fp8_gemm.ref import dequant_blocks

    return dequant_blocks(w, scale)


def save_checkpoint(path: str | Path, cfg: ModelConfig, weights: Weights, shards: int = 2, fp8: bool = False) -> None:
    """Write ``config.json``, ``weights`` split over ``shards`` safetensors files and their
    ``model.safetensors.index.json`` (tests, examples). ``fp8``: the ``fp8_kept`` linear weights and
    ``kv_b_proj`` stored as DeepSeek ships them, float8_e4m3fn with 128 x 128 block ``weight_scale_inv``, and
    config.json says so (``quantization_config``)."""
    from safetensors.torch import save_file

    from cpkv.model.config import config_to_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = config_to_dict(cfg)
    if fp8:
        raw["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    stored: Weights = {}
    for k, w in weights.items():
        if fp8 and w.dim() == 2 and (fp8_kept(k) or k.endswith("kv_b_proj.weight")) and not is_fp8(w):
            stored[k], stored[k + "_scale_inv"] = quant_fp8_blocks(w)
        else:
            stored[k] = w
    names = list(stored)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        part = {k: stored[k].contiguous() for k in names[i * per:(i + 1) * per]}
        if part:
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(path / file))
            weight_map.update({k: file for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def quant_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)]): w ~ fp8 x scale."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale
