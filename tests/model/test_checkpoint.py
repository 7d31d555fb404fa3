"""Model configs from config.json (every indexer-pattern form), checkpoint loading (sharded, fp8 block
scales) and the one-line errors a bad checkpoint gives before any rank starts."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpkv.config import PRESETS, preset
from cpkv.errors import CheckpointError, ConfigError
from cpkv.model.checkpoint import check_checkpoint
from cpkv.model.config import config_from_dict, config_to_dict, load_model_config
from cpkv.model.model import DSAModel, load_model
from cpkv.model.weights import quant_fp8_blocks, random_weights, save_checkpoint

TINY = preset("tiny")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_glm5_preset_has_40_full_layers_of_78():
    g = preset("glm5")
    assert g.num_layers == 78 and len(g.full_layers) == 40
    assert g.full_layers[:4] == (0, 1, 3, 5) and g.full_layers[-1] == 77
    assert g.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert g.kv_bytes_per_token() == 78 * 656 + 40 * 132
    assert preset("deepseek-v32").full_layers == tuple(range(61))


@pytest.mark.parametrize("form, want", [
    ({"indexer_types": ["full", "shared", "shared", "full"]}, ("full", "shared", "shared", "full")),
    ({"index_topk_pattern": "FSFS"}, ("full", "shared", "full", "shared")),
    ({"index_topk_pattern": ["full", "full", "shared", "full"]}, ("full", "full", "shared", "full")),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 2}, ("full", "full", "shared", "full")),
    ({"index_topk_freq": 3, "index_skip_topk_offset": 1}, ("full", "shared", "shared", "full")),
    ({}, ("full", "full", "full", "full")),
])
def test_indexer_pattern_forms(form, want):
    raw = {k: v for k, v in config_to_dict(TINY.with_layers(4)).items()
           if k not in ("index_topk_freq", "index_skip_topk_offset")}
    cfg = config_from_dict({**raw, **form}, name="x")
    assert cfg.indexer_types == want
    assert cfg.kinds_at(1) == (("token", "index") if want[1] == "full" else ("token",))


@pytest.mark.parametrize("edit, needle", [
    ({"index_topk_pattern": "SFFF"}, "layer 0 must be a full"),
    ({"index_topk_pattern": "FXFF"}, "index_topk_pattern: expected one letter per layer, F .full. or S .shared., got "
                                     "'X' at layer 1"),
    ({"indexer_types": ["full", "shared"]}, r"indexer_types: expected one entry per layer \(num_hidden_layers = 4\), "
                                            "got 2"),
    ({"indexer_types": "full"}, "indexer_types: expected a list of 'full' / 'shared', one per layer, got str 'full'"),
    ({"mlp_layer_types": ["dense", "Sparse", "sparse", "sparse"]}, "mlp_layer_types: expected 'dense' or 'sparse' for "
                                                                   "every layer, got 'Sparse' at layer 1"),
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"n_routed_experts": 7}, "n_group"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope type 'longrope'"),
    ({"num_hidden_layers": "four"}, "expected an integer"),
])
def test_bad_configs_are_named(edit, needle):
    raw = {**config_to_dict(TINY.with_layers(4)), **edit}
    with pytest.raises(CheckpointError, match=needle):
        config_from_dict(raw, name="x")


def test_legacy_rope_scaling_form():
    raw = {**config_to_dict(PRESETS["deepseek-v32"]), "rope_theta": 10000}
    raw["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    del raw["rope_parameters"]
    assert config_from_dict(raw, name="deepseek-v32") == PRESETS["deepseek-v32"]


def test_num_layers_cut_keeps_the_pattern():
    assert load_model_config("glm5", num_layers=4).indexer_types == ("full", "full", "shared", "full")


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=4)


def test_sharded_checkpoint_round_trip(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=3)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == len(weights)
    m = load_model(str(tmp_path))
    ref = DSAModel(TINY, weights)
    toks = list(range(1, 90))
    assert torch.equal(m.reference_prefill(toks), ref.reference_prefill(toks))


def test_fp8_block_scaled_weights_dequantised_at_load(tmp_path, weights):
    save_checkpoint(tmp_path, TINY, weights, shards=2, fp8=True)
    m = load_model(str(tmp_path))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    q, s = quant_fp8_blocks(weights[name])
    assert s.shape == (1, 1)
    want = q.float() * s  # one 128 x 128 block covers the whole [64, 128] weight
    assert torch.equal(m.layers[1].moe.gate_up[3, 64:], want)  # gate_up stacks gate then up
    assert (want - weights[name]).abs().max() <= 0.07 * weights[name].abs().max()


def corrupt(tmp_path: Path, weights, how: str) -> Path:
    save_checkpoint(tmp_path, TINY, weights, shards=2)
    first = sorted(tmp_path.glob("*.safetensors"))[0]
    if how == "zero":
        first.write_bytes(b"")
    elif how == "truncated":
        first.write_bytes(first.read_bytes()[:4000])
    elif how == "garbage":
        first.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    elif how == "shape":
        from safetensors.torch import save_file
        bad = {k: v for k, v in weights.items() if k.startswith("model.layers.0.")}
        bad["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        (tmp_path / "model.safetensors.index.json").unlink()
        rest = {k: v for k, v in weights.items() if not k.startswith("model.layers.0.")}
        save_file(bad, str(tmp_path / "a.safetensors"))
        save_file(rest, str(tmp_path / "b.safetensors"))
    elif how == "missing_shard":
        first.unlink()
    return tmp_path


@pytest.mark.parametrize("how, needle", [
    ("zero", "not a safetensors file (0 bytes"),
    ("truncated", "truncated"),
    ("garbage", "corrupt safetensors header"),
    ("shape", "a.safetensors: tensor model.layers.0.self_attn.o_proj.weight: expected shape [128, 128], got [3, 3]"),
    ("missing_shard", "names shard model-00001-of-00002.safetensors"),
])
def test_bad_checkpoint_named_in_one_line(tmp_path, weights, how, needle):
    path = corrupt(tmp_path, weights, how)
    with pytest.raises(CheckpointError, match=None) as e:
        check_checkpoint(path, TINY)
    assert needle in str(e.value)
    if how not in ("zero", "shape"):
        return
    # the CLI: one line, exit 2, before any rank starts (no rank traceback)
    out = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(path), "--requests", "1"],
                         capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("cpkv run: error: ") and needle in out.stderr


def test_missing_tensor_named(tmp_path, weights):
    less = {k: v for k, v in weights.items() if k != "model.layers.2.self_attn.indexer.wk.weight"}
    save_checkpoint(tmp_path, TINY, less)
    with pytest.raises(CheckpointError, match="missing tensor model.layers.2.self_attn.indexer.wk.weight"):
        check_checkpoint(tmp_path, TINY)


def test_shared_layers_need_no_indexer_tensors(weights):
    assert not any(k.startswith("model.layers.1.self_attn.indexer") for k in weights)


def test_fp8_needs_whole_quant_groups():
    odd = config_from_dict({**config_to_dict(TINY), "kv_lora_rank": 96}, name="odd")
    with pytest.raises(ConfigError, match="--precision exact"):
        odd.token_format  # noqa: B018
    assert dataclasses.replace(odd, kv_dtype="float32").token_format.row_bytes == (96 + 32) * 4


def test_run_writes_logits_of_a_saved_checkpoint(tmp_path, weights):
    """``cpkv run --model DIR --logits-out F``: F holds each request's last-token logits, float32, by id."""
    from safetensors.torch import load_file

    from cpkv.cli.traces import default_trace
    from cpkv.scheduler.trace import materialize_tokens

    save_checkpoint(tmp_path / "ck", TINY, weights)
    out = tmp_path / "logits.safetensors"
    run = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(tmp_path / "ck"), "--requests", "2",
                          "--precision", "exact", "--logits-out", str(out), "--no-verify"],
                         capture_output=True, text=True, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr
    got = load_file(str(out))
    trace = default_trace(2)
    assert set(got) == {str(r.id) for r in trace}
    model = load_model(str(tmp_path / "ck"), precision="exact")
    tokens = materialize_tokens(trace, vocab_size=TINY.vocab_size)
    for r in trace:
        want = model.reference_prefill(tokens[r.id])
        assert got[str(r.id)].dtype == torch.float32 and got[str(r.id)].shape == (TINY.vocab_size,)
        assert float((got[str(r.id)] - want).abs().max()) <= 1e-4 * float(want.abs().max())
