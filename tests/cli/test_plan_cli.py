"""``cpkv plan`` (figures, JSON keys, exit status), ``cpkv run``'s memory pre-check, and the parent's model
config being the ranks' (the --precision exact defect of a kv_lora_rank that is not a multiple of 128)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import cpkv.cli.plan_cmd as plan_cli
from cpkv.cli import main
from cpkv.config import preset
from cpkv.engine.config import EngineConfig
from cpkv.memplan import GB
from cpkv.model.config import COMPUTE_DTYPES, config_to_dict, load_model_config
from cpkv.model.model import default_dtype, load_model, precision_config
from cpkv.model.weights import random_weights, save_checkpoint

PER_RANK = {"weights_bytes", "expert_bytes", "kv_bytes", "kv_tokens", "kv_pages", "staging_bytes", "compose_bytes",
            "logits_bytes", "activation_bytes", "graph_bytes", "decision_bytes", "workspace_bytes", "total_bytes",
            "budget_bytes", "experts"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def plan(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["plan", *args, "--gpu-memory", "141", "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["glm5", "deepseek-v32"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_plan_json(capsys, model, cp):
    rc, out = plan(capsys, "--model", model, "--cp", str(cp))
    assert list(out) == ["model", "cp", "params", "weights_dtype", "fits", "per_rank", "node", "routed_experts",
                         "experts_option"]
    assert (out["routed_experts"], out["experts_option"]) == (256, None)
    assert set(out["per_rank"]) == PER_RANK and set(out["node"]) == {"kv_tokens_shared", "kv_tokens_replicated"}
    assert (out["model"], out["cp"], out["weights_dtype"]) == (model, cp, "fp8")
    assert out["fits"] == (cp == 8) and rc == (0 if cp == 8 else 1)
    r = out["per_rank"]
    items = sum(v for k, v in r.items() if k.endswith("_bytes") and k not in ("total_bytes", "budget_bytes"))
    assert r["total_bytes"] == items and r["budget_bytes"] == 141 * GB and r["experts"] == 256 // cp
    assert out["node"]["kv_tokens_shared"] == cp * r["kv_tokens"] == cp * out["node"]["kv_tokens_replicated"]
    if cp == 8:
        assert r["kv_tokens"] >= 100_000 and r["total_bytes"] <= 141 * GB


def test_graph_tokens_take_their_buffers_and_pool_from_the_kv_pool(capsys):
    """--graph-tokens N (default 1024, as cpkv run on CUDA): the graphs' bytes grow with N (0 without), the KV
    pool gives up what they take, and the plan's suggested run passes the option on."""
    _, off = plan(capsys, "--model", "glm5", "--cp", "8", "--graph-tokens", "0")
    _, small = plan(capsys, "--model", "glm5", "--cp", "8", "--graph-tokens", "512")
    _, default = plan(capsys, "--model", "glm5", "--cp", "8")
    assert default["per_rank"]["graph_bytes"] == plan(capsys, "--model", "glm5", "--cp", "8", "--graph-tokens",
                                                      "1024")[1]["per_rank"]["graph_bytes"]
    _, big = plan(capsys, "--model", "glm5", "--cp", "8", "--graph-tokens", "2048")
    g = [x["per_rank"]["graph_bytes"] for x in (off, small, big)]
    assert g[0] == 0 < g[1] < g[2] < 2 * GB
    kv = [x["per_rank"]["kv_tokens"] for x in (off, small, big)]
    assert kv[0] > kv[1] > kv[2] >= 100_000
    assert all(x["per_rank"]["total_bytes"] <= 141 * GB for x in (off, small, big))
    _, exact = plan(capsys, "--model", "glm5", "--cp", "8", "--precision", "exact")
    assert exact["per_rank"]["graph_bytes"] == 0  # exact precision runs eagerly unless asked
    assert main(["plan", "--model", "glm5", "--cp", "8", "--gpu-memory", "141", "--graph-tokens", "512"]) == 0
    assert "--graph-tokens 512" in capsys.readouterr().out


def test_plan_text_names_the_largest_item(capsys):
    assert main(["plan", "--model", "glm5", "--cp", "4", "--gpu-memory", "141"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "the largest item is the expert shard (181.2 GB): change --cp" in out
    assert main(["plan", "--model", "glm5", "--cp", "8", "--gpu-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "64 of 256" not in out and "32 of 256 routed experts x 75 layers" in out and "cpkv run --model glm5" in out


def test_plan_bounds_its_depth_and_ranks_like_run(capsys):
    """--num-layers as cpkv run's (1..1024: 10^5 layers once took minutes and 15 GB), --cp as replay's (1..4096);
    the weights are counted per layer kind, so the deepest plan is as quick as any."""
    for argv, needle in ((["--num-layers", "100000"], "argument --num-layers: expected an integer in 1..1024, got 100000"),
                         (["--num-layers", "0"], "argument --num-layers: expected an integer in 1..1024, got 0"),
                         (["--cp", "5000"], "argument --cp: expected an integer in 1..4096, got 5000")):
        with pytest.raises(SystemExit) as exc:
            main(["plan", "--model", "glm5", "--cp", "8", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.splitlines()[-1] == f"cpkv plan: error: {needle}"
    rc, out = plan(capsys, "--model", "glm5", "--cp", "8", "--num-layers", "1024")
    assert rc == 1 and out["params"] > 1024 / 78 * 743e9  # every one of the 1024 layers counted


def test_plan_options_have_runs_ranges():
    """Every option plan shares with run takes run's range (nothing plan accepts is refused by the run it prints)."""
    import argparse

    from cpkv.cli import build_parser

    def bounds(command: str) -> dict:
        sub = next(a for a in build_parser([command])._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: getattr(a.type, "bounds", None) for a in sub.choices[command]._actions}

    plan, run = bounds("plan"), bounds("run")
    for dest in ("num_layers", "chunk_size", "page_size", "max_requests", "pages_per_rank", "graph_tokens"):
        assert plan[dest] == run[dest] and plan[dest] is not None, dest
    assert plan["cp"] == (1, 4096) and plan["gpu_memory"] == (0.0, 10_000.0)


@pytest.mark.parametrize("cp", [512, 3])
def test_expert_advice_names_the_divisors_that_fit(cp, capsys):
    """A --cp that does not divide the experts holds them all on every rank: more ranks would not help; the
    advice names the divisors of 256 with which the plan fits, and each of them does."""
    assert main(["plan", "--model", "glm5", "--cp", str(cp), "--gpu-memory", "141"]) == 1
    out = capsys.readouterr().out
    assert "more ranks" not in out
    assert (f"the largest item is the expert shard (725.0 GB): change --cp ({cp} does not divide the 256 routed "
            "experts, so every rank holds all of them) to a divisor of 256 that fits: 8, 16, 32, 64, 128, 256; or "
            "lower --num-layers") in out
    for d in (8, 256):
        assert main(["plan", "--model", "glm5", "--cp", str(d), "--gpu-memory", "141"]) == 0
        capsys.readouterr()
    assert main(["plan", "--model", "glm5", "--cp", "4", "--gpu-memory", "141"]) == 1
    assert main(["plan", "--model", "glm5", "--cp", "4", "--gpu-memory", "20"]) == 1
    out = capsys.readouterr().out
    assert "change --cp (now 4: 64 of the 256 routed experts per rank) to a divisor of 256 that fits: 8, 16" in out
    assert "change --cp (now 4: 64 of the 256 routed experts per rank; no --cp that divides them fits) or lower " \
           "--num-layers" in out


def test_bf16_weights_do_not_fit(capsys):
    rc, out = plan(capsys, "--model", "glm5", "--cp", "8", "--weights", "bf16")
    assert rc == 1 and out["weights_dtype"] == "bf16" and out["per_rank"]["expert_bytes"] > 180 * GB


def test_a_checkpoint_dir_plans_from_its_config(capsys, tmp_path):
    raw = config_to_dict(preset("glm5"))
    (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8}))
    _, preset_plan = plan(capsys, "--model", "glm5", "--cp", "8")
    rc, dir_plan = plan(capsys, "--model", str(tmp_path), "--cp", "8")
    assert rc == 0 and dir_plan["per_rank"] == preset_plan["per_rank"] and dir_plan["params"] == preset_plan["params"]
    (tmp_path / "config.json").write_text(json.dumps(raw))  # no quantization_config: bf16 as shipped
    rc, bf16 = plan(capsys, "--model", str(tmp_path), "--cp", "8")
    assert rc == 1 and bf16["weights_dtype"] == "bf16"


def test_plan_options(capsys):
    rc, small = plan(capsys, "--model", "glm5", "--cp", "8", "--pages-per-rank", "1000")
    assert rc == 0 and small["per_rank"]["kv_pages"] == 1000 and small["per_rank"]["kv_tokens"] == 999 * 64
    rc, four = plan(capsys, "--model", "glm5", "--cp", "2", "--num-layers", "4")
    assert rc == 0 and four["per_rank"]["experts"] == 128
    assert main(["plan", "--model", "glm5", "--cp", "8", "--chunk-size", "100"]) == 2
    assert "--chunk-size 100 must be a multiple of --page-size 64" in capsys.readouterr().err


# -- cpkv run's pre-check -------------------------------------------------------------------------
def test_run_refuses_a_pool_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "host_available", lambda: 8 * GB)
    assert main(["run", "--pages-per-rank", "16000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cpkv run: error: the configuration needs")
    assert "host's available memory (2 ranks) has 4.0 GB: lower --pages-per-rank (now 16000000; at most" in err[0]


def test_run_refuses_a_model_that_does_not_fit(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "host_available", lambda: 16 * GB)
    assert main(["run", "--model", "glm5", "--num-layers", "4"]) == 2
    err = capsys.readouterr().err
    assert "the largest item is the expert shard" in err and "change --cp" in err


def test_run_check_on_gpus(monkeypatch):
    """One GPU per rank: each rank has the whole GPU; fewer GPUs than ranks: the ranks share GPU 0."""
    from cpkv.errors import ConfigError

    monkeypatch.setattr(plan_cli, "gpu_memory", lambda: 141 * GB)
    cfg = EngineConfig(model="glm5", cp=8, device="cuda", pages_per_rank=2800, chunk_size=16384, weights="fp8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    plan_cli.check_run(cfg, cfg.model_config())
    with pytest.raises(ConfigError, match="--verify reruns every request on one GPU, whose whole model needs 7.*: "
                                          "pass --no-verify"):
        plan_cli.check_run(cfg, cfg.model_config(), verify=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="the one GPU 8 ranks share has 17.6 GB"):
        plan_cli.check_run(cfg, cfg.model_config())
    cfg = dataclasses.replace(cfg, cp=4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match=r"expert shard \(181.2 GB\): change --cp"):
        plan_cli.check_run(cfg, cfg.model_config())


# -- the parent's model config is the ranks' ---------------------------------------------------------
@pytest.fixture(scope="module")
def odd_latent(tmp_path_factory):
    """A checkpoint whose kv_lora_rank (96) is not a multiple of 128: fp8 token rows cannot hold it."""
    cfg = dataclasses.replace(preset("tiny"), name="odd", kv_lora_rank=96)
    path = tmp_path_factory.mktemp("odd")
    save_checkpoint(path, cfg, random_weights(cfg, seed=3), shards=2)
    return str(path)


@pytest.mark.parametrize("spec", ["tiny", "odd"])
@pytest.mark.parametrize("precision", ["fp8", "exact"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_parents_config_equals_the_ranks(spec, precision, device, odd_latent):
    """EngineConfig.model_config (the parent) is the config load_model gives a rank on that device."""
    spec = odd_latent if spec == "odd" else spec
    if spec == odd_latent and precision == "fp8":
        return  # refused before any rank starts (next test)
    cfg = EngineConfig(model=spec, num_layers=2, precision=precision, device=device)
    parent = cfg.model_config()
    assert default_dtype(device) == getattr(torch, COMPUTE_DTYPES[device])
    assert parent == precision_config(load_model_config(spec, 2), precision, default_dtype(device))
    if device == "cpu":  # the rank's own call (engine.rank.rank_main), run here
        assert parent == load_model(spec, seed=0, device=device, num_layers=2, precision=precision).cfg
    assert parent.kv_dtype == ("fp8" if precision == "fp8" else COMPUTE_DTYPES[device])


@pytest.mark.slow
def test_exact_precision_runs_a_latent_of_96(capsys, odd_latent):
    assert main(["run", "--model", odd_latent, "--precision", "fp8", "--requests", "2"]) == 2
    assert "fp8 token rows need kv_lora_rank in whole groups of 128, got 96 (use --precision exact)" in \
        capsys.readouterr().err
    assert main(["run", "--model", odd_latent, "--precision", "exact", "--requests", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["precision"] == "exact" and out["verify"]["tokens_equal"] and not out["rejected"]
