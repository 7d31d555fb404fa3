"""Input checks shared by the attention's entry points."""
from __future__ import annotations

import torch

from cpkv.errors import AttentionError

__all__ = ["INDEX_DTYPES", "check_same_device", "check_tensor", "expect", "last_dim_contiguous"]

INDEX_DTYPES = (torch.int32, torch.int64)


def expect(cond: bool, what: str, got: object) -> None:
    """Raise AttentionError('expected <what>, got <got>') unless ``cond``."""
    if not cond:
        raise AttentionError(f"expected {what}, got {got}")


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """AttentionError unless ``t`` is a tensor of ``ndim`` dims and one of ``dtypes`` (the message is built only
    on failure: the entry points check every call, once per layer)."""
    if not isinstance(t, torch.Tensor):
        expect(False, f"{name} to be a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        expect(False, f"{name} with {ndim} dims", f"shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = "/".join(str(d).replace("torch.", "") for d in dtypes)
        expect(False, f"{name} of dtype {names}", t.dtype)


def check_same_device(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        expect(False, "all tensors on one device", {name: t.device for name, t in tensors.items()})


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (what the kernels need), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
