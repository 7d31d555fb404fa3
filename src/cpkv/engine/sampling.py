"""Picking a generation's next token from its last-token logits (``SamplingParams``): pure functions over one
logits row, in float64 on the host, so a token depends on the logits, the parameters, the seed and the step alone
(not on the device, the batch or the rank).

    pick(row, p, tokens, prompt_len, step)     row: [vocab] float32 logits (any device) -> token id
        greedy (temperature 0, no penalty)     argmax(row) on its device: the exact path ``cpkv run`` checks
        penalize                               vLLM's definitions: repetition over prompt + output tokens
                                               (logit > 0: / r, else * r), then - frequency * count(output),
                                               then - presence * [count(output) > 0]
        temperature 0 with a penalty           argmax of the penalized logits
        filtered_probs                         softmax(logits / temperature), then on the probabilities sorted
                                               best first (stable: ties keep id order), as SGLang's reference:
                                               top_k keeps the first k, top_p keeps a token while the mass before
                                               it is <= top_p, min_p keeps p >= min_p * p_max; renormalised
        draw                                   argmax(probs / q), q = -log u ~ Exp(1), u = ``uniforms``: each
                                               token id's 53-bit uniform hashed from mix_seed(seed, step): a draw
                                               from probs (the exponential race)
    logprobs(row, token, n)                    log_softmax of the raw logits: (log p(token), top n (id, log p))
    pick_rows(rows, params, ...)               ``pick`` of a step's rows: those without penalties or
                                               log-probabilities in one ``sample_rows`` call (the server's)
    sample_rows(logits, ...)                   the same pick for a batch of rows without penalties, on their
                                               device in tensors alone (no host sync, no per-row Python): what a
                                               graphed decode step runs (``engine.decode_graph``), token for token
                                               ``pick``'s but where float64 sums in another order flip a near-tie

Every rank that holds a request's last token could pick it; only that one does, and the token travels as the
greedy one does (``OnlineLoop._step``: an all-reduce max over -1).
"""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.engine.protocol import SamplingParams, mix_seed


def pick(row: torch.Tensor, p: SamplingParams, tokens: Sequence[int], prompt_len: int, step: int) -> int:
    """row: [vocab] float32 logits; tokens: prompt + output so far (the first ``prompt_len`` are the prompt);
    step: the index of the token being picked (0 = first) -> the token id."""
    if p.greedy:
        return int(torch.argmax(row))
    logits = penalize(row.detach().to("cpu", torch.float64), tokens[:prompt_len], tokens[prompt_len:], p)
    if p.temperature == 0:
        return int(torch.argmax(logits))
    return draw(filtered_probs(logits, p), p.seed, step)


def pick_rows(rows: Sequence[torch.Tensor], params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]],
              prompt_lens: Sequence[int], steps: Sequence[int]) -> list[int]:
    """``pick`` of several rows (their own parameters, tokens, prompt lengths and steps) -> token ids: the greedy
    ones in one argmax, the other ``device_ok`` ones in one ``sample_rows`` call, on the rows' device (a host sync
    each), the rest (penalties, log-probabilities) one by one on the host."""
    out: list[int | None] = [None] * len(rows)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        for i, t in zip(greedy, torch.stack([rows[i] for i in greedy]).argmax(-1).tolist()):
            out[i] = t
    batch = [i for i, p in enumerate(params) if device_ok(p) and not p.greedy]
    if batch:
        ps = [params[i] for i in batch]
        dev = rows[batch[0]].device
        f64 = dict(dtype=torch.float64, device=dev)
        got = sample_rows(torch.stack([rows[i].float() for i in batch]),
                          torch.tensor([p.temperature for p in ps], **f64),
                          torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev),
                          torch.tensor([p.top_p for p in ps], **f64), torch.tensor([p.min_p for p in ps], **f64),
                          torch.tensor([mix_seed(p.seed, steps[i]) for p, i in zip(ps, batch)], dtype=torch.int64,
                                       device=dev)).tolist()
        for i, t in zip(batch, got):
            out[i] = t
    for i, t in enumerate(out):
        if t is None:
            out[i] = pick(rows[i], params[i], tokens[i], prompt_lens[i], steps[i])
    return out  # type: ignore[return-value]


def penalize(logits: torch.Tensor, prompt: Sequence[int], output: Sequence[int], p: SamplingParams) -> torch.Tensor:
    """logits: [vocab] float64 -> a penalized copy (vLLM's ``apply_penalties`` for one row)."""
    vocab = logits.numel()
    out = logits.clone()
    if p.repetition_penalty != 1:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt) + list(output), dtype=torch.long)] = True
        r = p.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if output and (p.frequency_penalty != 0 or p.presence_penalty != 0):
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)[:vocab].double()
        out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [vocab] float64 (penalized), p.temperature > 0 -> [vocab] float64 probabilities summing to 1, zero
    where top_k, top_p or min_p masks a token (module docstring)."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    ranked, ids = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    if p.top_p < 1:
        keep &= (ranked.cumsum(-1) - ranked) <= p.top_p
    if p.min_p > 0:
        keep &= ranked >= ranked[0] * p.min_p
    out = torch.zeros_like(probs)
    out[ids[keep]] = ranked[keep]
    return out / out.sum()


def draw(probs: torch.Tensor, seed: int, step: int) -> int:
    """probs: [vocab] float64 -> one token drawn from it, the same for the same (seed, step) on any machine."""
    u = uniforms(torch.tensor([mix_seed(seed, step)], dtype=torch.int64), probs.shape[0])[0]
    return int(torch.argmax(probs / -torch.log(u)))


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without overflowing int64 (the product's two 16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, the "lowbias32" constants) of int64 x in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: int64 [B] (``mix_seed(seed, step)``, 63-bit) -> float64 [B, vocab] in (0, 1): each token id's uniform,
    53 bits hashed from (key, id) in integer tensor ops on the keys' device: the same numbers on any device, and
    counter-based (no generator state), so a captured graph draws afresh from each replay's keys."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    lo, hi = (keys & _M32)[:, None], ((keys >> 32) & _M32)[:, None]
    a = _hash32(_hash32(ids ^ lo) ^ hi)
    b = _hash32(a ^ 0x9E3779B9)
    return ((a << 21) + (b >> 11)).double().add_(0.5).mul_(2.0 ** -53)


def device_ok(p) -> bool:
    """``p`` (SamplingParams) is picked by ``sample_rows`` as ``pick`` would: no penalty (they read the token
    counts), no log-probabilities (reported from the host)."""
    return not p.penalized and p.logprobs is None


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits float32 [B, vocab]; per row float64 temperature (0: the argmax), top_p, min_p, int64 top_k (<= 0:
    none) and keys (``mix_seed(seed, step)``) -> int64 [B] tokens: ``pick`` of each row (``device_ok``
    parameters), batched in tensors on the logits' device."""
    B, V = logits.shape
    greedy = logits.argmax(-1)
    t = torch.where(temperature > 0, temperature, 1.0)
    probs = torch.softmax(logits.double() / t[:, None], dim=-1)
    ranked, ids = probs.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(V, device=logits.device)[None, :]
    keep = (top_k[:, None] <= 0) | (pos < top_k[:, None])
    keep &= (ranked.cumsum(-1) - ranked) <= top_p[:, None]
    keep &= ranked >= ranked[:, :1] * min_p[:, None]
    kept = torch.zeros_like(probs).scatter_(-1, ids, torch.where(keep, ranked, 0.0))  # back in id order
    drawn = (kept / -torch.log(uniforms(keys, V))).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


def logprobs(row: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """row: [vocab] float32 raw logits -> (log p(token), the n most likely (id, log p), best first; ties by id)."""
    lp = torch.log_softmax(row.detach().to("cpu", torch.float64), dim=-1)
    best, ids = lp.sort(descending=True, stable=True)
    top = tuple((int(i), float(v)) for i, v in zip(ids[:n].tolist(), best[:n].tolist()))
    return float(lp[token]), top
