"""What this machine can hold, as a plain estimate, checked before any rank starts. No torch import.

    free = host_memory()                      # MemAvailable (/proc/meminfo), /dev/shm free space (statvfs)
    check_run_fits(cfg, model_cfg, verify)    # cpkv run: ConfigError naming the option that does not fit

A ``cpkv run`` on the CPU holds, per rank: the interpreter with torch (``RANK_BASE_BYTES``), the model's
weights, its KV pool (``--pages-per-rank`` pages of every layer's rows, in ``/dev/shm`` when peer memory is
on) and its host tier (``--host-pages``); the verifying parent holds the weights once more. On CUDA the
device side is the GPU memory plan's business; the host tier (pinned host memory) is checked here.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cpkv.config import ModelConfig
from cpkv.errors import ConfigError

RANK_BASE_BYTES = 384 << 20  # one rank process with torch imported, before any buffer
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class HostMemory:
    available: int | None  # MemAvailable in bytes (None: unknown, nothing is checked against it)
    shm_free: int | None   # free bytes of /dev/shm (None: no /dev/shm)


def host_memory() -> HostMemory:
    return HostMemory(_mem_available(), _shm_free())


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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


def weight_params(m: ModelConfig) -> int:
    """Parameters of the model (embedding, attention with the indexer, dense MLPs and MoE, head): an estimate
    within a few percent of the checkpoint's, enough to say whether it fits."""
    h = m.hidden_size
    attn = (h * m.q_lora_rank + m.q_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
            + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            + m.num_heads * m.v_head_dim * h)
    indexer = m.q_lora_rank * m.index_n_heads * m.index_head_dim + h * m.index_head_dim + h * m.index_n_heads
    dense = 3 * h * m.intermediate_size
    moe = (m.n_routed_experts + m.n_shared_experts) * 3 * h * m.moe_intermediate_size + h * m.n_routed_experts
    layers = sum(attn + (indexer if t == "full" else 0) for t in m.indexer_types)
    layers += sum(dense if t == "dense" else moe for t in m.mlp_layer_types)
    return layers + 2 * m.vocab_size * h


def kv_bytes_per_token(m: ModelConfig, precision: str, device: str) -> int:
    """Pool bytes of one cached token over every layer under ``--precision`` (exact: float32 on the CPU,
    bfloat16 on CUDA)."""
    if precision == "exact":
        m = dataclasses.replace(m, kv_dtype="float32" if device == "cpu" else "bfloat16")
    return m.kv_bytes_per_token()


@dataclass(frozen=True)
class RunNeeds:
    """Host bytes a ``cpkv run`` needs, by what asks for them."""

    ranks: int
    base: int      # per rank
    weights: int   # per copy (each rank, and the verifying parent)
    pool: int      # per rank
    host: int      # per rank
    copies: int    # weight copies on the host
    shm: int       # /dev/shm bytes (the CPU pools of every rank, when peer memory is on)

    @property
    def total(self) -> int:
        return self.ranks * (self.base + self.pool + self.host) + self.copies * self.weights


def run_needs(cfg, model_cfg: ModelConfig, verify: bool, peer_memory: bool = True) -> RunNeeds:
    """``cfg``: an EngineConfig (cp, device, page_size, pages_per_rank, host_pages, precision)."""
    per_token = kv_bytes_per_token(model_cfg, cfg.precision, cfg.device)
    page = cfg.page_size * per_token
    cpu = cfg.device == "cpu"
    weights = weight_params(model_cfg) * 4 if cpu else 0  # float32 on the CPU; on CUDA the weights are on the GPU
    pool = cfg.pages_per_rank * page if cpu else 0
    return RunNeeds(ranks=cfg.cp, base=RANK_BASE_BYTES, weights=weights, pool=pool,
                    host=cfg.host_pages * page, copies=(cfg.cp + int(verify)) if cpu else 0,
                    shm=cfg.cp * pool if cpu and peer_memory else 0)


def check_run_fits(cfg, model_cfg: ModelConfig, verify: bool, free: HostMemory | None = None) -> None:
    """ConfigError naming the option that asks for the most when the run cannot fit this machine's memory."""
    from cpkv import envs

    free = free or host_memory()
    need = run_needs(cfg, model_cfg, verify, peer_memory=not envs.get("CPKV_DISABLE_PEER_MEMORY"))
    if free.shm_free is not None and need.shm > free.shm_free:
        raise ConfigError(f"--pages-per-rank {cfg.pages_per_rank}: the KV pools of --cp {cfg.cp} ranks need "
                          f"{size_text(need.shm)} of {SHM_DIR}, which has {size_text(free.shm_free)} free; lower "
                          f"--pages-per-rank or --cp")
    if free.available is None or need.total <= free.available:
        return
    parts = {f"--pages-per-rank {cfg.pages_per_rank}": need.ranks * need.pool,
             f"--host-pages {cfg.host_pages}": need.ranks * need.host,
             f"--model {cfg.model}" + (f" --num-layers {cfg.num_layers}" if cfg.num_layers else ""):
                 need.copies * need.weights,
             f"--cp {cfg.cp}": need.ranks * need.base}
    option, bytes_ = max(parts.items(), key=lambda kv: kv[1])
    what = {"--pages-per-rank": "the KV pools", "--host-pages": "the host tiers",
            "--model": "the weights (a copy per rank, and one to verify)", "--cp": "the rank processes"}
    flag = option.split()[0]
    fix = ("give fewer --num-layers or a smaller --model, or run on --device cuda" if flag == "--model"
           else f"lower {flag}" + (" or --cp" if cfg.cp > 1 and flag != "--cp" else ""))
    raise ConfigError(f"{option}: {what[flag]} need {size_text(bytes_)} of host memory ({size_text(need.total)} in "
                      f"all, {cfg.cp} ranks), this machine has {size_text(free.available)} available; {fix}")


def check_ranks_fit(option: str, what: str, per_rank: int, ranks: int, shm: bool, fix: str,
                    free: HostMemory | None = None) -> None:
    """ConfigError ``"{option}: {what} need ..."`` when ``ranks`` processes holding ``per_rank`` bytes each
    (in /dev/shm when ``shm``) cannot fit this machine (commands other than ``run``: ``check compose``)."""
    free = free or host_memory()
    total = ranks * per_rank
    if shm and free.shm_free is not None and total > free.shm_free:
        raise ConfigError(f"{option}: {what} need {size_text(total)} of {SHM_DIR} ({ranks} ranks), which has "
                          f"{size_text(free.shm_free)} free; {fix}")
    total += ranks * RANK_BASE_BYTES
    if free.available is not None and total > free.available:
        raise ConfigError(f"{option}: {what} need {size_text(total)} of host memory ({ranks} ranks), this machine "
                          f"has {size_text(free.available)} available; {fix}")
