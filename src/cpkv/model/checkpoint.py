"""A checkpoint directory's safetensors files, checked from their headers and their values. No torch import.

    files = checkpoint_files(dir)            # shards of model.safetensors.index.json, else *.safetensors
    index = read_headers(dir)                # tensor name -> TensorInfo(file, dtype, shape), every header checked
    check_checkpoint(dir, cfg)               # every tensor cfg needs: present, right shape and dtype (fp8: its
                                             #   scales too), then every value scanned (check_values)

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}}`` and the data. A 0-byte, truncated or corrupt file, a tensor whose byte
range does not fit the file or its dtype x shape, a shard the index names but the directory lacks, an
index entry naming a file outside the checkpoint folder (an absolute path, a ``..`` component), a
missing tensor or a wrong shape: each is one CheckpointError naming the file and the tensor.

Contents, per tensor the model needs: a floating dtype (F64, F32, F16, BF16; F8_E4M3 / F8_E5M2 only for a
2-D weight with its ``weight_scale_inv`` beside it; integer and bool weights are refused); every value
finite (no NaN, no Inf); every fp8 block scale a positive finite float. The value scan is **full**, not
sampled (one NaN in one block is enough to poison every logit): the raw bits are tested on the memory-mapped
file with numpy (exponent all ones = NaN or Inf), tensors spread over up to 8 threads. Cost: about half a second
per GiB in the page cache (``benchmarks/checkpoint_scan.py``; BENCHMARKS.md) plus the disk read of a cold file;
GLM-5's ~700 GB fp8 checkpoint: minutes, dominated by the disk. The parent
process runs ``check_checkpoint`` before any rank starts, so a bad checkpoint costs no rank a traceback;
``load_weights`` runs it again in each process that loads (a library user gets the same checks; within one
process a clean tensor of an unchanged file is scanned once).
"""
from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np

from cpkv.config import ModelConfig
from cpkv.errors import CheckpointError
from cpkv.files import absent, kind as file_kind

INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # weights of any of these are cast to the compute dtype at load
# a value is non-finite when its bits, sign cleared, reach ``limit`` (exponent all ones); == limit is an Inf
# (F8_E4M3 is the "fn" format: no Inf, S.1111.111 is its NaN)
NONFINITE = {"F64": ("<u8", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000), "F32": ("<u4", 0x7FFF_FFFF, 0x7F80_0000),
             "F16": ("<u2", 0x7FFF, 0x7C00), "BF16": ("<u2", 0x7FFF, 0x7F80), "F8_E4M3": ("u1", 0x7F, 0x7F),
             "F8_E5M2": ("u1", 0x7F, 0x7C)}
SCAN_CHUNK = 1 << 22  # values per step of the scan (<= 32 MB of buffer per thread)
SCAN_THREADS = 8
_SCANNED: set[tuple] = set()  # tensors found clean in this process: (file identity, name)
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
FP8_BLOCK = 128


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1  # byte offset of the data in the file (-1: unknown)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index json lists, else every ``*.safetensors``."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            entries = sorted(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: expected a JSON object with a weight_map of tensor -> file ({exc})") from None
        for tensor, name in entries:
            _check_shard_name(index, path, tensor, name)
        names = sorted({name for _, name in entries})
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard {missing[0]}, which {path} {absent(path / missing[0])}"
                                  + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX_FILE})")
    return files


def _check_shard_name(index: Path, folder: Path, tensor: str, name: object) -> None:
    """A weight_map entry must name a file inside the checkpoint folder: relative, no ``..``, no drive."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: tensor {tensor}: expected a file name (a non-empty string), got {name!r}")
    posix, win = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or win.is_absolute() or win.drive or ".." in posix.parts or ".." in win.parts:
        raise CheckpointError(f"{index}: tensor {tensor}: file {name!r} is outside the checkpoint folder (expected a "
                              f"path relative to {folder}, without '..')")


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
    return {name: _entry(file, name, info, data, 8 + n) for name, info in header.items() if name != "__metadata__"}


def _size(file: Path) -> int:
    """The file's size; CheckpointError for a path that is not a regular file (never opened: a FIFO blocks)."""
    try:
        st = os.stat(file)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror})") from None
    if file_kind(st):
        raise CheckpointError(f"{file}: expected a safetensors file, got {file_kind(st)}")
    return st.st_size


def _entry(file: Path, name: str, info: object, data_bytes: int, data_start: int) -> TensorInfo:
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
    return TensorInfo(file, dtype, shape, data_start + begin)


def read_headers(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (name -> TensorInfo), each file's header checked."""
    out: dict[str, TensorInfo] = {}
    for file in checkpoint_files(path):
        out.update(read_header(file))
    return out


# the linear weights kept fp8 (those the FP8 releases store fp8, but kv_b_proj: W_UK / W_UV are dense); the one rule
# the loader (``cpkv.model.weights``) and the memory plan (``cpkv.memplan``) both read
FP8_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight",
               "indexer.wq_b.weight", "indexer.wk.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def fp8_kept(name: str) -> bool:
    """True for the linear weights the model can run as block-scaled fp8 GEMMs: every linear weight of a layer but
    ``kv_b_proj`` (split into W_UK / W_UV, dense), the indexer's ``weights_proj`` and the router."""
    return name.startswith("model.layers.") and name.endswith(FP8_LINEARS)


def fp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the ``weight_scale_inv`` of an fp8 weight: one scale per 128 x 128 block."""
    return tuple(-(-d // FP8_BLOCK) for d in shape)


def check_checkpoint(path: str | Path, cfg: ModelConfig, values: bool = True) -> dict[str, TensorInfo]:
    """CheckpointError (file and tensor named) unless every tensor ``cfg`` needs is there with its shape and a
    floating dtype (fp8: with its block scales) and, with ``values``, every value of those is finite and every
    block scale positive (``check_values``)."""
    index = read_headers(path)
    needed: list[str] = []
    for name, shape in expected_shapes(cfg).items():
        t = index.get(name)
        if t is None:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        if t.shape != shape:
            raise CheckpointError(f"{t.file}: tensor {name}: expected shape {list(shape)}, got {list(t.shape)}")
        needed.append(name)
        if t.dtype in FP8_DTYPES:
            if len(shape) != 2:
                raise CheckpointError(f"{t.file}: tensor {name}: dtype {t.dtype}: fp8 is read only for 2-D linear "
                                      f"weights (with a weight_scale_inv beside them); expected one of "
                                      f"{', '.join(FLOAT_DTYPES)} for a tensor of shape {list(shape)}")
            _check_scale(index, name, shape, t.file)
            needed.append(name + "_scale_inv")
        elif t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.file}: tensor {name}: dtype {t.dtype}: expected a floating-point weight "
                                  f"({', '.join(FLOAT_DTYPES)}, or F8_E4M3/F8_E5M2 with a weight_scale_inv)")
    if values:
        check_values(index, needed)
    return index


def _check_scale(index: dict[str, TensorInfo], name: str, shape: tuple[int, ...], file: Path) -> None:
    scale = index.get(name + "_scale_inv")
    want = fp8_scale_shape(shape)
    if scale is None:
        raise CheckpointError(f"{file}: fp8 tensor {name} has no {name}_scale_inv (128 x 128 block scales)")
    if scale.shape != want:
        raise CheckpointError(f"{scale.file}: tensor {name}_scale_inv: expected shape {list(want)}, got "
                              f"{list(scale.shape)}")
    if scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{scale.file}: tensor {name}_scale_inv: dtype {scale.dtype}: expected float block "
                              f"scales ({', '.join(FLOAT_DTYPES)})")


# -- values ----------------------------------------------------------------------------------------
def check_values(index: dict[str, TensorInfo], names: list[str]) -> None:
    """CheckpointError for the first of ``names`` (in order) holding a NaN or an Inf, or, for a
    ``*_scale_inv``, a block scale that is not a positive finite number. Every value is read (full scan);
    a tensor found clean is not scanned again by this process while its file is unchanged (same inode, size
    and modification time), so checking a config twice costs one scan."""
    todo = [(n, index[n], _identity(index[n].file, n)) for n in names]
    todo = [x for x in todo if x[2] not in _SCANNED]
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(SCAN_THREADS, os.cpu_count() or 1, len(todo)))) as pool:
        for (name, t, key), problem in zip(todo, pool.map(lambda x: _scan(x[0], x[1]), todo)):
            if problem is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                raise CheckpointError(f"{t.file}: tensor {name}: {problem}")
            _SCANNED.add(key)


def _identity(file: Path, name: str) -> tuple:
    st = os.stat(file)
    return (str(Path(file).resolve()), st.st_ino, st.st_size, st.st_mtime_ns, name)


def _scan(name: str, t: TensorInfo) -> str | None:
    """What is wrong with one tensor's values (None: nothing)."""
    count = math.prod(t.shape)
    if count == 0:
        return None
    code, mask, limit = NONFINITE[t.dtype]
    try:
        data = np.memmap(t.file, dtype=code, mode="r", offset=t.offset, shape=(count,))
    except (OSError, ValueError) as exc:
        return f"cannot read its data ({exc})"
    if name.endswith("_scale_inv"):
        return _scale_problem(data, t)
    buf = np.empty(min(count, SCAN_CHUNK), dtype=code)
    for start in range(0, count, SCAN_CHUNK):
        bits = buf[:min(SCAN_CHUNK, count - start)]
        np.bitwise_and(data[start:start + SCAN_CHUNK], mask, out=bits)
        if bits.max() >= limit:
            i = int(np.argmax(bits >= limit))
            kind = "Inf" if bits[i] == limit and t.dtype != "F8_E4M3" else "NaN"
            at = [int(x) for x in np.unravel_index(start + i, t.shape)]
            return f"non-finite weight ({kind}) at {at}: expected finite values (a corrupt or diverged checkpoint)"
    return None


def _scale_problem(data: np.ndarray, t: TensorInfo) -> str | None:
    """fp8 block scales: positive and finite."""
    if t.dtype == "BF16":
        values = (data.astype(np.uint32) << 16).view(np.float32)
    else:
        values = data.view({"F64": np.float64, "F32": np.float32, "F16": np.float16}[t.dtype])
    bad = ~(np.isfinite(values) & (values > 0))
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    at = [int(x) for x in np.unravel_index(i, t.shape)]
    return f"block scale {float(values[i])!r} at {at}: expected a positive finite number"


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


def outer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers (embeddings, final norm, head), full public names -> shape."""
    return {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,),
            "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, full public names -> shape."""
    outer = outer_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": outer["model.embed_tokens.weight"]}
    for n in range(cfg.num_layers):
        out.update({f"model.layers.{n}.{k}": s for k, s in layer_shapes(cfg, n).items()})
    out.update(outer)
    return out


def layer_kinds(cfg: ModelConfig) -> dict[int, int]:
    """The first layer of each kind -> how many layers are of that kind. A layer's tensors (``layer_shapes``)
    depend only on its kind, (indexer type, MLP type): a model's weights are counted per kind, in O(kinds)."""
    first: dict[tuple[str, str], int] = {}
    count: dict[tuple[str, str], int] = {}
    for n, kind in enumerate(zip(cfg.indexer_types, cfg.mlp_layer_types)):
        first.setdefault(kind, n)
        count[kind] = count.get(kind, 0) + 1
    return {first[k]: count[k] for k in first}


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def routed_expert(name: str) -> int | None:
    """The routed expert a tensor belongs to (``model.layers.N.mlp.experts.E....`` -> E), else None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def is_local(name: str, experts: range | None) -> bool:
    """True when a rank holding the routed experts ``experts`` (None: all of them) needs tensor ``name``
    (every tensor but the other ranks' routed experts: attention, router, shared experts are replicated)."""
    e = routed_expert(name) if experts is not None else None
    return e is None or e in experts
