"""``rank_plan`` and ``RankPlan.bounds`` against a per-token reference: the runs written straight into the staging
buffer give each rank exactly its tokens' ids, positions, last-token rows and dense key ranges."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpkv.engine.forward import BatchSpec, rank_plan
from cpkv.layout import build_layout


class _Model:
    device = torch.device("cpu")

    class cfg:
        index_topk = 16


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_rank_plan_matches_a_per_token_reference(cp):
    rng = np.random.default_rng(cp)
    reqs = [(128, 300), (0, 77), (64, 1), (0, 513)]  # (cached prefix, new tokens); prefixes page-aligned
    lay = build_layout(reqs, page_size=64, cp=cp)
    tokens = tuple(rng.integers(0, 50_000, p + e) for p, e in reqs)
    spec = BatchSpec(lay, tuple(t if i % 2 else t.tolist() for i, t in enumerate(tokens)),  # lists and arrays
                     tuple(range(len(lay.current_pages))))
    seen = 0
    for rank in range(cp):
        plan = rank_plan(spec, rank, _Model())
        ids, pos, ks, ke, last = [], [], [], [], []
        for req, s, e in lay.rank_query_ranges[rank]:
            r = lay.requests[req]
            for t in range(s, e):
                if t == r.seq_len - 1:
                    last.append((req, len(ids)))
                ids.append(int(tokens[req][t]))
                pos.append(t)
                ks.append(r.slot_start * 64)
                ke.append(r.slot_start * 64 + t + 1)
        assert plan.ids.tolist() == ids and plan.positions.tolist() == pos
        assert plan.last == last and plan.last_rows.tolist() == [row for _, row in last]
        got_ks, got_ke = plan.bounds()
        assert got_ks.tolist() == ks and got_ke.tolist() == ke
        assert plan.num_tokens == len(ids)
        seen += len(ids)
    assert seen == sum(e for _, e in reqs)  # every new token on exactly one rank


def test_rotary_tables_are_built_once_and_only_when_asked():
    """The GPU starts on the embedding before the rotary tables: rank_plan leaves them unbuilt, ``rotary`` builds
    them once from the plan's positions."""
    calls = []

    class Model(_Model):
        def rotary(self, positions):
            calls.append(positions.tolist())
            return ("rot", len(calls))

    lay = build_layout([(0, 5), (64, 3)], page_size=64, cp=1)
    spec = BatchSpec(lay, (list(range(5)), list(range(67))), tuple(range(len(lay.current_pages))))
    plan = rank_plan(spec, 0, Model())
    assert plan.rot is None and calls == []
    assert plan.rotary(Model()) == ("rot", 1) and plan.rotary(Model()) == ("rot", 1)
    assert calls == [[0, 1, 2, 3, 4, 64, 65, 66]]
