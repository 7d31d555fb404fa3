"""Limits checked before allocation (docs/reliability.md): every numeric option of every command has a range,
shown in its --help; a value outside it is one error line naming the option, in-process and at once; options
that size memory are checked against what the machine holds; a folder named like a preset never changes what
the ranks load."""
from __future__ import annotations

import argparse
import os
import time

import pytest

from cpkv.cli import CHECKS, COMMANDS, GROUPS, build_parser, main
from cpkv.cli.hostmem import HostMemory, check_shm_fits
from cpkv.config import PRESETS, model_source
from cpkv.errors import ConfigError

HUGE = "1" + "0" * 30
NUMERIC = (int, float)


def _commands() -> list[list[str]]:
    out = [[c] for c in COMMANDS]
    for group, (_, table) in GROUPS.items():
        out += [[group, t] for t in table]
    return out


def _parser(words: list[str]) -> argparse.ArgumentParser:
    parser = build_parser(words)
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _numeric_options() -> list[tuple[list[str], argparse.Action]]:
    """(command words, action) of every option that takes a number (a bounded type, or a plain int/float)."""
    found = []
    for words in _commands():
        for action in _parser(words)._actions:
            if action.option_strings and (action.type in NUMERIC or hasattr(action.type, "bounds")):
                found.append((words, action))
    return found


OPTIONS = _numeric_options()
IDS = [f"{' '.join(w)} {a.option_strings[0]}" for w, a in OPTIONS]
# options that need others to reach the parser's check of them
NEEDS = {"layout": ["--cp", "2", "--page-size", "64", "--req", "0:9"]}


def test_every_command_has_its_numeric_options_found():
    names = {i.split(" --")[0] for i in IDS}
    assert {"run", "replay", "layout", "check compose", "bench engine", "bench compose", "bench attention"} <= names
    assert len(OPTIONS) >= 40


@pytest.mark.parametrize("words,action", OPTIONS, ids=IDS)
def test_every_numeric_option_is_bounded_and_documented(words, action):
    assert hasattr(action.type, "bounds"), f"{action.option_strings[0]} takes any {action.type.__name__}"
    assert action.type.range_text in (action.help or ""), action.help


@pytest.mark.parametrize("value", [HUGE, "-" + HUGE, "nan"])
@pytest.mark.parametrize("words,action", OPTIONS, ids=IDS)
def test_a_huge_value_is_one_line_naming_the_option_at_once(words, action, value, capsys):
    option = action.option_strings[0]
    argv = [*words, *NEEDS.get(words[0], []), f"{option}={value}"]
    start = time.monotonic()
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and f"argument {option}" in lines[0] and "expected" in lines[0], err
    assert "Traceback" not in err
    assert time.monotonic() - start < 30  # in-process, before anything is read or started


# -- memory ----------------------------------------------------------------------------------------------------
def _cfg(**kw):
    from cpkv.engine.config import EngineConfig

    return EngineConfig(**kw)


SMALL = HostMemory(available=8 << 30, shm_free=4 << 30)


@pytest.mark.parametrize("kw,needle", [
    ({"pages_per_rank": 1 << 24}, "lower --pages-per-rank (now 16777216; at most"),
    ({"host_pages": 1 << 24, "pages_per_rank": 64}, "the largest item is the KV pool"),  # host tier: the pool's item
    ({"model": "glm5", "pages_per_rank": 64}, "the largest item is the expert shard"),
    ({"cp": 24, "pages_per_rank": 8}, "the largest item is the other workspace"),  # 24 processes of their own
])
def test_memory_sized_options_are_checked_against_the_machine(kw, needle, monkeypatch):
    """On the CPU the memory plan judges a run against each rank's share of the host's available memory."""
    from cpkv.cli import plan_cmd

    cfg = _cfg(**kw)
    monkeypatch.setattr(plan_cmd, "host_available", lambda: (2 << 30) if cfg.cp == 24 else (8 << 30))
    with pytest.raises(ConfigError) as info:
        plan_cmd.check_run(cfg, cfg.model_config(), verify=True)
    assert needle in str(info.value), str(info.value)
    plan_cmd.check_run(_cfg(), _cfg().model_config(), verify=True)  # the defaults fit


def test_the_pools_must_fit_dev_shm(monkeypatch):
    cfg = _cfg(pages_per_rank=1 << 16)
    need = 2 * (1 << 16) * cfg.page_size * cfg.model_config().kv_bytes_per_token()
    with pytest.raises(ConfigError, match=r"^--pages-per-rank 65536: the KV pools of --cp 2 ranks need .* of /dev/shm"):
        check_shm_fits(cfg, cfg.model_config(), HostMemory(available=1 << 40, shm_free=need - 1))
    check_shm_fits(cfg, cfg.model_config(), HostMemory(available=1 << 40, shm_free=need))
    monkeypatch.setenv("CPKV_DISABLE_PEER_MEMORY", "1")  # no peer memory: the pools are private, not in /dev/shm
    check_shm_fits(cfg, cfg.model_config(), HostMemory(available=1 << 40, shm_free=0))


@pytest.mark.parametrize("argv,needle", [
    (["run", "--pages-per-rank", str(1 << 24)], "lower --pages-per-rank (now 16777216"),  # the memory plan's line
    (["run", "--model", "glm5", "--device", "cpu"], "the largest item is the expert shard"),
    (["replay", "--kv-tokens-per-rank", str(1 << 40)], "--kv-tokens-per-rank 1099511627776: the simulated pools hold"),
    (["layout", "--cp", "2", "--page-size", "1", "--req", "0:16777216"], "--req: the batch spans 16777216 pages"),
    (["check", "compose", "--page-size", "65536", "--layers", "1024", "--model", "glm5"],
     "--page-size 65536 --layers 1024: the ranks' KV pools and buffers need"),
    (["bench", "compose", "--device", "cpu", "--prefix-tokens", str(1 << 30), "--layers", "1024"],
     "--prefix-tokens 1073741824 --extend-tokens 44600: the pools and dense buffers need"),
])
def test_commands_refuse_what_this_machine_cannot_hold(argv, needle, capsys):
    start = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1, err
    assert time.monotonic() - start < 30


# -- presets ---------------------------------------------------------------------------------------------------
def test_a_folder_named_like_a_preset_is_never_loaded_silently(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert model_source("tiny") == ("preset", "tiny")
    (tmp_path / "tiny").mkdir()
    with pytest.raises(ConfigError, match=r"--model 'tiny' names both the preset tiny and the directory .*: write "
                                          r"--model preset:tiny for the preset or --model ./tiny"):
        model_source("tiny")
    assert model_source("preset:tiny") == ("preset", "tiny")
    assert model_source("./tiny") == ("dir", "./tiny")
    assert main(["run", "--model", "tiny"]) == 2
    assert "names both the preset tiny and the directory" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        model_source("preset:nope")


def test_preset_form_loads_the_preset_everywhere(tmp_path, monkeypatch):
    from cpkv.engine.config import is_preset
    from cpkv.model.config import load_model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert is_preset("preset:tiny") and load_model_config("preset:tiny") == PRESETS["tiny"]
    assert _cfg(model="preset:tiny").model == "preset:tiny"


# -- the environment -------------------------------------------------------------------------------------------
def test_a_misspelt_variable_is_an_error_with_the_closest_name(monkeypatch, capsys):
    monkeypatch.setenv("CPKV_BARIER_TIMEOUT_S", "5")
    assert main(["layout", "--cp", "2", "--page-size", "64", "--req", "0:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpkv layout: error: CPKV_BARIER_TIMEOUT_S is not a cpkv environment variable (did you "
                          "mean CPKV_BARRIER_TIMEOUT_S?)"), err
    assert main(["env"]) == 2 and "CPKV_BARIER_TIMEOUT_S" in capsys.readouterr().out


def test_check_commands_are_covered():
    assert set(CHECKS) <= {w[1] for w, _ in OPTIONS if w[0] == "check"}
    assert os.path.exists("/proc/meminfo") or True
