"""Every command starts from a named size preset (``cpkv.config.SIZES``) and the one page size: its defaults for cp,
chunk size, requests per batch, pool pages and page size are the preset's, so no setting has a second default."""
from __future__ import annotations

import pytest

from cpkv.cli import build_parser
from cpkv.config import DEFAULT_PAGE_SIZE, SIZES

# command -> the preset it names ("bench engine" measures one GPU: its cp 1 and 32K chunk are its cases')
COMMANDS = {("run",): "toy", ("serve",): "toy", ("replay",): "model", ("plan",): "model",
            ("bench", "compose"): "toy", ("check", "compose"): "toy"}
FIELDS = {"cp": "cp", "chunk_size": "chunk_size", "max_requests": "max_requests", "pages_per_rank": "pages_per_rank"}


@pytest.mark.parametrize("argv", list(COMMANDS), ids=" ".join)
def test_defaults_are_the_named_presets(argv):
    args = build_parser([*argv]).parse_known_args([*argv, *(["--model", "glm5"] if argv == ("plan",) else [])])[0]
    sizes = SIZES[COMMANDS[argv]]
    seen = 0
    for dest, field in FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:  # a command without the option (or sizing it itself, as serve's pool) has no default
            assert value == getattr(sizes, field), (argv, dest)
            seen += 1
    assert seen >= 1 and getattr(args, "page_size", DEFAULT_PAGE_SIZE) == DEFAULT_PAGE_SIZE
