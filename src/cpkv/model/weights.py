"""DSA model weights: the public checkpoint naming, random weights from a seed, safetensors loading.

Names and shapes (``[out, in]`` for linear layers), as in DeepSeek-V3.2 / GLM-5 checkpoints::

    model.embed_tokens.weight                               [vocab, hidden]
    model.layers.N.input_layernorm.weight                   [hidden]
    model.layers.N.self_attn.q_a_proj.weight                [q_lora, hidden]
    model.layers.N.self_attn.q_a_layernorm.weight           [q_lora]
    model.layers.N.self_attn.q_b_proj.weight                [H * (nope + rope), q_lora]
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight      [kv_lora + rope, hidden]
    model.layers.N.self_attn.kv_a_layernorm.weight          [kv_lora]
    model.layers.N.self_attn.kv_b_proj.weight               [H * (nope + v), kv_lora]
    model.layers.N.self_attn.o_proj.weight                  [hidden, H * v]
    model.layers.N.self_attn.indexer.wq_b.weight            [Hi * Di, q_lora]
    model.layers.N.self_attn.indexer.wk.weight              [Di, hidden]
    model.layers.N.self_attn.indexer.k_norm.weight / .bias  [Di]   (LayerNorm)
    model.layers.N.self_attn.indexer.weights_proj.weight    [Hi, hidden]
    model.layers.N.post_attention_layernorm.weight          [hidden]
    model.layers.N.mlp.{gate_proj,up_proj}.weight           [inter, hidden]
    model.layers.N.mlp.down_proj.weight                     [hidden, inter]
    model.norm.weight                                       [hidden]
    lm_head.weight                                          [vocab, hidden]

Block-quantised fp8 checkpoints (a float8 ``.weight`` beside ``.weight_scale_inv`` of one float32 scale
per 128 x 128 block) are dequantised on load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cpkv.config import ModelConfig
from cpkv.errors import CheckpointError

Weights = dict[str, torch.Tensor]
NORM_SUFFIXES = ("layernorm.weight", "norm.weight")
FP8_BLOCK = 128


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's tensors, keyed by the name after ``model.layers.N.``."""
    d, h, qr, kr = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    hi, di, inter = cfg.index_n_heads, cfg.index_head_dim, cfg.intermediate_size
    a = "self_attn."
    return {
        "input_layernorm.weight": (d,),
        a + "q_a_proj.weight": (qr, d),
        a + "q_a_layernorm.weight": (qr,),
        a + "q_b_proj.weight": (h * (nope + rope), qr),
        a + "kv_a_proj_with_mqa.weight": (kr + rope, d),
        a + "kv_a_layernorm.weight": (kr,),
        a + "kv_b_proj.weight": (h * (nope + v), kr),
        a + "o_proj.weight": (d, h * v),
        a + "indexer.wq_b.weight": (hi * di, qr),
        a + "indexer.wk.weight": (di, d),
        a + "indexer.k_norm.weight": (di,),
        a + "indexer.k_norm.bias": (di,),
        a + "indexer.weights_proj.weight": (hi, d),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (inter, d),
        "mlp.up_proj.weight": (inter, d),
        "mlp.down_proj.weight": (d, inter),
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, full public names -> shape."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for n in range(cfg.num_layers):
        out.update({f"model.layers.{n}.{k}": s for k, s in layer_shapes(cfg).items()})
    out["model.norm.weight"] = (cfg.hidden_size,)
    out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> Weights:
    """Seeded random weights: linear ~ N(0, 1/in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1).

    Drawn on ``device`` with a generator seeded per tensor (same seed, same device type -> same weights).
    """
    out: Weights = {}
    for i, (name, shape) in enumerate(expected_shapes(cfg).items()):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
        out[name] = _random_tensor(name, shape, gen, device).to(dtype)
    return out


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if name.endswith(NORM_SUFFIXES):
        return 1.0 + 0.1 * x
    if name.endswith(".bias"):
        return 0.1 * x
    if name == "model.embed_tokens.weight":
        return x
    return x / shape[-1] ** 0.5


def check_weights(weights: Weights, cfg: ModelConfig, source: str = "weights") -> None:
    """CheckpointError naming every missing or mis-shaped tensor."""
    problems = []
    for name, shape in expected_shapes(cfg).items():
        t = weights.get(name)
        if t is None:
            problems.append(f"missing {name} (expected shape {list(shape)})")
        elif tuple(t.shape) != shape:
            problems.append(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{source}: {shown}")


def load_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Weights:
    """Read the tensors ``cfg`` needs from ``path/*.safetensors`` (layers beyond cfg.num_layers skipped)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    wanted = expected_shapes(cfg)
    raw: Weights = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in wanted or (key.endswith("_scale_inv") and key[: -len("_scale_inv")] in wanted):
                    raw[key] = st.get_tensor(key)
    out = {name: _dequant(raw, name).to(device=device, dtype=dtype, copy=True) for name in wanted if name in raw}
    check_weights(out, cfg, str(path))
    return out


def _dequant(raw: Weights, name: str) -> torch.Tensor:
    """A float8 weight times its per-128x128-block ``weight_scale_inv`` (other dtypes pass through)."""
    w, scale = raw[name], raw.get(name + "_scale_inv")
    if scale is None or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return w
    rows, cols = w.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return w.float() * s


def save_checkpoint(path: str | Path, cfg: ModelConfig, weights: Weights, shards: int = 2) -> None:
    """Write ``config.json`` and ``weights`` split over ``shards`` safetensors files (tests, examples)."""
    from safetensors.torch import save_file

    from cpkv.model.config import config_to_dict

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    names = list(weights)
    per = -(-len(names) // shards)
    for i in range(shards):
        part = {k: weights[k].contiguous() for k in names[i * per:(i + 1) * per]}
        if part:
            save_file(part, str(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
