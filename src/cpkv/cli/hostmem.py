"""The host's free memory and /dev/shm space, and the checks that need them beside the memory plan. No torch
import.

    free = host_memory()                      # MemAvailable (/proc/meminfo), /dev/shm free space (statvfs)
    check_shm_fits(cfg, model_cfg)            # cpkv run on the CPU: the ranks' pools fit /dev/shm
    check_ranks_fit(option, what, ...)        # commands without a memory plan (check compose, bench compose)

What a rank holds (weights, expert shard, pool, host tier, buffers, a process's own pages) is the memory plan's
(``cpkv.memplan``, checked per rank against its share of ``host_memory().available`` on the CPU by
``cli.plan_cmd.check_run``); this module adds where the pools live (/dev/shm) and the machine's figures.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from cpkv.config import ModelConfig
from cpkv.errors import ConfigError
from cpkv.memplan import WORKSPACE

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class HostMemory:
    available: int | None  # MemAvailable in bytes (None: unknown, nothing is checked against it)
    shm_free: int | None   # free bytes of /dev/shm (None: no /dev/shm)


def host_memory() -> HostMemory:
    return HostMemory(_mem_available(), _shm_free())


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (os.sysconf's available pages where there is none; None when
    neither says)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _shm_free() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: float) -> str:
    """Bytes as a short human figure: '1.5 GiB', '3 PiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} EiB"


def check_shm_fits(cfg, model_cfg: ModelConfig, free: HostMemory | None = None) -> None:
    """``cpkv run`` on the CPU with peer memory: ConfigError naming --pages-per-rank when the ranks' KV pools
    (``cfg``: an EngineConfig; ``model_cfg`` its ``model_config()``) do not fit the free space of /dev/shm, where
    they live. Everything else a run holds is the memory plan's business (``cli.plan_cmd.check_run``)."""
    from cpkv import envs

    if cfg.device != "cpu" or envs.get("CPKV_DISABLE_PEER_MEMORY"):
        return
    free = free or host_memory()
    need = cfg.cp * cfg.pages_per_rank * cfg.page_size * model_cfg.kv_bytes_per_token()
    if free.shm_free is not None and need > free.shm_free:
        raise ConfigError(f"--pages-per-rank {cfg.pages_per_rank}: the KV pools of --cp {cfg.cp} ranks need "
                          f"{size_text(need)} of {SHM_DIR}, which has {size_text(free.shm_free)} free; lower "
                          f"--pages-per-rank or --cp")


def check_ranks_fit(option: str, what: str, per_rank: int, ranks: int, shm: bool, fix: str,
                    free: HostMemory | None = None) -> None:
    """ConfigError ``"{option}: {what} need ..."`` when ``ranks`` processes holding ``per_rank`` bytes each
    (in /dev/shm when ``shm``) cannot fit this machine (commands other than ``run``: ``check compose``)."""
    free = free or host_memory()
    total = ranks * per_rank
    if shm and free.shm_free is not None and total > free.shm_free:
        raise ConfigError(f"{option}: {what} need {size_text(total)} of {SHM_DIR} ({ranks} ranks), which has "
                          f"{size_text(free.shm_free)} free; {fix}")
    total += ranks * WORKSPACE["cpu"][0]
    if free.available is not None and total > free.available:
        raise ConfigError(f"{option}: {what} need {size_text(total)} of host memory ({ranks} ranks), this machine "
                          f"has {size_text(free.available)} available; {fix}")
