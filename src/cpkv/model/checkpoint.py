"""A checkpoint directory's safetensors files, checked from their headers alone. No torch import.

    files = checkpoint_files(dir)            # shards of model.safetensors.index.json, else *.safetensors
    index = read_headers(dir)                # tensor name -> TensorInfo(file, dtype, shape), every header checked
    check_checkpoint(dir, cfg)               # every tensor cfg needs: present, right shape (fp8: its scales too)

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` and the data. A 0-byte, truncated or corrupt file, a tensor whose byte
range does not fit the file or its dtype x shape, a shard the index names but the directory lacks, a
missing tensor or a wrong shape: each is one CheckpointError naming the file and the tensor. The parent
process runs ``check_checkpoint`` before any rank starts, so a bad checkpoint costs no rank a traceback.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from cpkv.config import ModelConfig
from cpkv.errors import CheckpointError
from cpkv.files import absent

INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
FP8_BLOCK = 128


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index json lists, else every ``*.safetensors``."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map of tensor -> file ({exc})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard {missing[0]}, which {path} {absent(path / missing[0])}"
                                  + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
    return files


def read_header(file: Path) -> dict[str, TensorInfo]:
    """One file's tensors from its header, each byte range checked against the file size."""
    size = _size(file)
    if size < 8:
        raise CheckpointError(f"{file}: not a safetensors file ({size} bytes; the header length alone takes 8)")
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file (header of {n} bytes in a file of "
                                  f"{size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (expected a JSON object)")
    data = size - 8 - n
    return {name: _entry(file, name, info, data) for name, info in header.items() if name != "__metadata__"}


def _size(file: Path) -> int:
    try:
        return os.stat(file).st_size
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror})") from None


def _entry(file: Path, name: str, info: object, data_bytes: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{file}: tensor {name}: corrupt header entry ({exc!r})") from None
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{file}: tensor {name}: unsupported dtype {dtype!r}")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end) or end - begin != want:
        raise CheckpointError(f"{file}: tensor {name}: byte range {[begin, end]} does not hold {dtype} {list(shape)} "
                              f"({want} bytes)")
    if end > data_bytes:
        raise CheckpointError(f"{file}: tensor {name}: truncated file (its data ends at byte {end}, the file holds "
                              f"{data_bytes} data bytes)")
    return TensorInfo(file, dtype, shape)


def read_headers(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (name -> TensorInfo), each file's header checked."""
    out: dict[str, TensorInfo] = {}
    for file in checkpoint_files(path):
        out.update(read_header(file))
    return out


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``weight_scale_inv`` of an fp8 weight: one scale per 128 x 128 block."""
    return tuple(-(-d // FP8_BLOCK) for d in shape)


def check_checkpoint(path: str | Path, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """CheckpointError (file and tensor named) unless every tensor ``cfg`` needs is there with its shape."""
    index = read_headers(path)
    for name, shape in expected_shapes(cfg).items():
        t = index.get(name)
        if t is None:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        if t.shape != shape:
            raise CheckpointError(f"{t.file}: tensor {name}: expected shape {list(shape)}, got {list(t.shape)}")
        if t.dtype in FP8_DTYPES:
            _check_scale(index, name, shape, t.file)
    return index


def _check_scale(index: dict[str, TensorInfo], name: str, shape: tuple[int, ...], file: Path) -> None:
    scale = index.get(name + "_scale_inv")
    want = fp8_scale_shape(shape)
    if scale is None:
        raise CheckpointError(f"{file}: fp8 tensor {name} has no {name}_scale_inv (128 x 128 block scales)")
    if scale.shape != want:
        raise CheckpointError(f"{scale.file}: tensor {name}_scale_inv: expected shape {list(want)}, got "
                              f"{list(scale.shape)}")


# -- the public tensor names and shapes a model needs (GLM-5 / DeepSeek-V3.2 naming) ----------------
def _mlp(prefix: str, inter: int, d: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, d), prefix + "up_proj.weight": (inter, d),
            prefix + "down_proj.weight": (d, inter)}


def layer_shapes(cfg: ModelConfig, n: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of layer ``n``'s tensors, keyed by the name after ``model.layers.n.``."""
    d, h, qr, kr = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    a = "self_attn."
    out: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (d,),
        a + "q_a_proj.weight": (qr, d),
        a + "q_a_layernorm.weight": (qr,),
        a + "q_b_proj.weight": (h * (nope + rope), qr),
        a + "kv_a_proj_with_mqa.weight": (kr + rope, d),
        a + "kv_a_layernorm.weight": (kr,),
        a + "kv_b_proj.weight": (h * (nope + v), kr),
        a + "o_proj.weight": (d, h * v),
    }
    if cfg.indexer_types[n] == "full":
        out.update({a + "indexer.wq_b.weight": (hi * di, qr), a + "indexer.wk.weight": (di, d),
                    a + "indexer.k_norm.weight": (di,), a + "indexer.k_norm.bias": (di,),
                    a + "indexer.weights_proj.weight": (hi, d)})
    out["post_attention_layernorm.weight"] = (d,)
    if cfg.mlp_layer_types[n] == "dense":
        out.update(_mlp("mlp.", cfg.intermediate_size, d))
        return out
    e, mi = cfg.n_routed_experts, cfg.moe_intermediate_size
    out.update({"mlp.gate.weight": (e, d), "mlp.gate.e_score_correction_bias": (e,)})
    for x in range(e):
        out.update(_mlp(f"mlp.experts.{x}.", mi, d))
    if cfg.n_shared_experts:
        out.update(_mlp("mlp.shared_experts.", mi * cfg.n_shared_experts, d))
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, full public names -> shape."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for n in range(cfg.num_layers):
        out.update({f"model.layers.{n}.{k}": s for k, s in layer_shapes(cfg, n).items()})
    out["model.norm.weight"] = (cfg.hidden_size,)
    out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return out
