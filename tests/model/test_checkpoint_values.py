"""Checkpoint contents checked before use: dtypes per tensor kind, finite values (full scan), positive finite
fp8 block scales, config.json field types and ranges, index paths confined to the checkpoint folder. Each
problem is one CheckpointError naming the file and the tensor (or the config key)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpkv.config import preset
from cpkv.errors import CheckpointError
from cpkv.model import checkpoint
from cpkv.model.checkpoint import check_checkpoint
from cpkv.model.config import config_from_dict, config_to_dict, load_model_config
from cpkv.model.weights import load_weights, random_weights, save_checkpoint

TINY = preset("tiny")
SRC = str(Path(__file__).resolve().parents[2] / "src")
LATE = f"model.layers.{TINY.num_layers - 1}.mlp.experts.2.down_proj.weight"  # a late layer's weight
NORM = "model.layers.1.input_layernorm.weight"


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=5)


def shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite(path: Path, name: str, value: torch.Tensor) -> Path:
    """Replace tensor ``name`` in its shard (any dtype), keeping every other tensor."""
    file = shard_of(path, name)
    tensors = load_file(str(file))
    tensors[name] = value
    save_file(tensors, str(file))
    return file


def refused(path: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(path, TINY)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_clean_checkpoint_passes_the_value_scan(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    index = check_checkpoint(tmp_path, TINY)
    assert index[LATE].offset >= 8 and index[LATE].dtype == "F32"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad, kind", [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_non_finite_weight_named_with_its_position(tmp_path, weights, dtype, bad, kind):
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    w = weights[LATE].to(dtype).clone()
    w[3, 17] = bad
    file = rewrite(tmp_path, LATE, w)
    refused(tmp_path, f"{file}: tensor {LATE}: non-finite weight ({kind}) at [3, 17]")


def test_scan_finds_a_nan_in_the_last_chunk(tmp_path, weights, monkeypatch):
    """Every value is read (full scan): a NaN at the very last element, across many scan chunks."""
    monkeypatch.setattr(checkpoint, "SCAN_CHUNK", 7)
    save_checkpoint(tmp_path, TINY, weights, shards=1)
    w = weights[LATE].clone()
    w[-1, -1] = math.nan
    rewrite(tmp_path, LATE, w)
    rows, cols = w.shape
    refused(tmp_path, f"tensor {LATE}: non-finite weight (NaN) at [{rows - 1}, {cols - 1}]")


@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.int64, "I64"), (torch.uint8, "U8"),
                                         (torch.bool, "BOOL")])
def test_integer_and_bool_weights_refused(tmp_path, weights, dtype, name):
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    file = rewrite(tmp_path, NORM, torch.ones(TINY.hidden_size, dtype=dtype))
    refused(tmp_path, f"{file}: tensor {NORM}: dtype {name}: expected a floating-point weight")


def test_fp8_only_for_2d_weights_with_scales(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    file = rewrite(tmp_path, NORM, torch.ones(TINY.hidden_size).to(torch.float8_e4m3fn))
    refused(tmp_path, f"{file}: tensor {NORM}: dtype F8_E4M3: fp8 is read only for 2-D linear weights")


def fp8_name() -> str:
    return "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("value, shown", [(0.0, "0.0"), (-0.5, "-0.5"), (math.nan, "nan"), (math.inf, "inf")])
def test_bad_block_scales_refused(tmp_path, weights, value, shown):
    save_checkpoint(tmp_path, TINY, weights, shards=2, fp8=True)
    name = fp8_name() + "_scale_inv"
    scale = load_file(str(shard_of(tmp_path, name)))[name].clone()
    scale.view(-1)[-1] = value
    file = rewrite(tmp_path, name, scale)
    at = [d - 1 for d in scale.shape]
    refused(tmp_path, f"{file}: tensor {name}: block scale {shown} at {at}: expected a positive finite number")


def test_integer_block_scales_refused(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2, fp8=True)
    name = fp8_name() + "_scale_inv"
    shape = load_file(str(shard_of(tmp_path, name)))[name].shape
    rewrite(tmp_path, name, torch.ones(shape, dtype=torch.int32))
    refused(tmp_path, f"tensor {name}: dtype I32: expected float block scales")


def test_fp8_nan_weight_refused(tmp_path, weights):
    """F8_E4M3 has no Inf; its NaN is S.1111.111 (0x7F / 0xFF)."""
    save_checkpoint(tmp_path, TINY, weights, shards=2, fp8=True)
    name = fp8_name()
    w = load_file(str(shard_of(tmp_path, name)))[name].clone()
    w.view(torch.uint8)[5, 6] = 0xFF
    file = rewrite(tmp_path, name, w)
    refused(tmp_path, f"{file}: tensor {name}: non-finite weight (NaN) at [5, 6]")


def test_fp8_checkpoint_with_good_scales_loads(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2, fp8=True)
    out = load_weights(tmp_path, TINY)
    assert all(bool(torch.isfinite(t).all()) for t in out.values())


def test_load_weights_refuses_nan_too(tmp_path, weights):
    """The library path (``load_weights``, as ranks and ``load_model`` call it) runs the same checks."""
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    w = weights[LATE].clone()
    w[0, 0] = math.nan
    rewrite(tmp_path, LATE, w)
    with pytest.raises(CheckpointError, match=f"tensor {LATE}: non-finite weight"):
        load_weights(tmp_path, TINY)


# -- index paths ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["traversal", "absolute", "nested_traversal"])
def test_index_paths_confined_to_the_checkpoint_folder(tmp_path, weights, where):
    ck = tmp_path / "ck"
    save_checkpoint(ck, TINY, weights, shards=2)
    index_file = ck / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    victim = sorted(index["weight_map"].values())[0]
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((ck / victim).read_bytes())  # a readable shard outside the folder: refused, not "missing"
    entry = {"traversal": "../outside.safetensors", "absolute": str(outside),
             "nested_traversal": "sub/../../outside.safetensors"}[where]
    index["weight_map"] = {k: (entry if v == victim else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(ck, TINY)
    msg = str(e.value)
    assert msg.startswith(f"{index_file}: tensor ") and f"file {entry!r} is outside the checkpoint folder" in msg


def test_index_entry_must_be_a_file_name(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][NORM] = 7
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor {NORM}: expected a file name"):
        check_checkpoint(tmp_path, TINY)


def test_subfolder_inside_the_checkpoint_is_fine(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=1)
    (tmp_path / "sub").mkdir()
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for name in set(index["weight_map"].values()):
        (tmp_path / name).rename(tmp_path / "sub" / name)
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    check_checkpoint(tmp_path, TINY)


# -- config.json ------------------------------------------------------------------------------------
def raw_config(**edit):
    raw = {**config_to_dict(TINY.with_layers(4)), **edit}
    return {k: v for k, v in raw.items() if v is not DROP}


DROP = object()


@pytest.mark.parametrize("edit, needle", [
    ({"model_type": DROP}, "config.json lacks model_type (expected one of glm_moe_dsa, deepseek_v32)"),
    ({"model_type": 3}, "model_type 3 is not supported"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob: expected true or false (a JSON boolean), got 'false'"),
    ({"norm_topk_prob": 0}, "norm_topk_prob: expected true or false"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps: expected a finite number, got nan"),
    ({"rms_norm_eps": 0}, "rms_norm_eps: expected a finite number > 0, got 0"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps: expected a finite number, got '1e-6'"),
    ({"routed_scaling_factor": math.inf}, "routed_scaling_factor: expected a finite number, got inf"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_theta: expected a finite number > 0"),
    ({"hidden_size": -8}, "hidden_size: expected an integer >= 1, got -8"),
    ({"num_hidden_layers": 0}, "num_hidden_layers: expected an integer >= 1, got 0"),
    ({"vocab_size": 1.5}, "vocab_size: expected an integer >= 1, got 1.5"),
    ({"vocab_size": True}, "vocab_size: expected an integer >= 1, got True"),
    ({"n_routed_experts": -4}, "n_routed_experts: expected an integer >= 1, got -4"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace: expected an integer >= 0, got -1"),
    ({"n_shared_experts": "1"}, "n_shared_experts: expected an integer >= 0, got '1'"),
    ({"mlp_layer_types": "dense"}, "mlp_layer_types: expected a list of 'dense' / 'sparse', one per layer, got str "
                                   "'dense'"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types: expected 'dense' or 'sparse' for "
                                                                "every layer, got 'moe' at layer 1"),
    ({"indexer_types": ["full", "shared", "shared"]}, "indexer_types: expected one entry per layer "
                                                      "(num_hidden_layers = 4), got 3"),
    ({"indexer_types": "FSSF"}, "indexer_types: expected a list of 'full' / 'shared', one per layer, got str"),
    ({"indexer_types": DROP, "index_topk_pattern": 5}, "index_topk_pattern: expected a string of F/S, one letter per "
                                                       "layer, or a list"),
    ({"indexer_types": DROP, "index_topk_freq": -2}, "index_topk_freq: expected an integer >= 0, got -2"),
])
def test_config_fields_checked(edit, needle):
    with pytest.raises(CheckpointError) as e:
        config_from_dict(raw_config(**edit), name="x")
    assert needle in str(e.value) and str(e.value).startswith("x: config.json")


def test_nan_in_config_json_file_refused(tmp_path, weights):
    """json.dumps writes NaN and json.loads reads it back: the file form of a NaN rms_norm_eps."""
    save_checkpoint(tmp_path, TINY, weights, shards=1)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": math.nan}))
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(CheckpointError, match="rms_norm_eps: expected a finite number, got nan"):
        load_model_config(str(tmp_path))


def test_cli_refuses_a_nan_weight_in_one_line(tmp_path, weights):
    """``cpkv run --model DIR``: one line naming the shard and the tensor, exit 2, before any rank starts."""
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    w = weights[LATE].clone()
    w[1, 2] = math.nan
    file = rewrite(tmp_path, LATE, w)
    out = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(tmp_path), "--requests", "1",
                          "--no-verify"], capture_output=True, text=True,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"cpkv run: error: {file}: tensor {LATE}: non-finite weight (NaN) at [1, 2]: expected " \
                         f"finite values (a corrupt or diverged checkpoint)\n"
    assert "rank" not in out.stderr


def test_a_clean_tensor_is_scanned_once_per_process(tmp_path, weights, monkeypatch):
    """A second check of an unchanged checkpoint reads no value again (a rank's load after its config check)."""
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    check_checkpoint(tmp_path, TINY)
    scans = []
    monkeypatch.setattr(checkpoint, "_scan", lambda name, t: scans.append(name))
    check_checkpoint(tmp_path, TINY)
    assert scans == []
    w = weights[LATE].clone()
    w[0, 1] = math.nan
    file = rewrite(tmp_path, LATE, w)  # a changed file is scanned again
    st = file.stat()  # its mtime moved on for sure (a coarse clock could give the rewrite the same stamp)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match=f"tensor {LATE}: non-finite weight"):
        monkeypatch.undo()
        check_checkpoint(tmp_path, TINY)
