"""Feature maps φ for linear attention: ``(..., d) -> (..., d)``, non-negative except ``identity``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def _relu_plus_1e6(x: torch.Tensor) -> torch.Tensor:
    """The original MHLA release's feature map, ``relu(x) + 1e-6``."""
    return F.relu(x) + 1e-6


def _identity(x: torch.Tensor) -> torch.Tensor:
    """No feature map: for inputs that already are features (e.g. Wan's RoPE after φ)."""
    return x


FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "elu+1": _elu_plus_one,
    "elu": _elu_plus_one,  # alias: the linear-transformer paper's φ(x) = elu(x) + 1
    "relu+1e-6": _relu_plus_1e6,  # the original release's φ
    "identity": _identity,
}


# In place on a fresh buffer (the fast path's block-major copies): one pass, no extra allocation.
FEATURE_MAPS_INPLACE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu_,
    "elu+1": lambda x: F.elu_(x).add_(1.0),
    "elu": lambda x: F.elu_(x).add_(1.0),
    "relu+1e-6": lambda x: F.relu_(x).add_(1e-6),
    "identity": _identity,
}


def feature_map_vjp_(name: str, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad * φ'(x)`` for a named φ; may reuse ``grad``'s memory. ``x`` is φ's input, or for ``relu``
    either its input or its output (``relu(x) > 0`` exactly where ``x > 0``, as ATen's relu backward uses).

    Uses ATen's own activation backward kernels (``threshold_backward``, ``elu_backward``): one fused
    pass over ``grad``, where building a ``x <= 0`` mask and ``masked_fill_`` would take two.
    """
    if name in ("relu", "relu+1e-6"):
        return torch.ops.aten.threshold_backward(grad, x, 0.0)
    if name in ("elu+1", "elu"):  # d/dx (elu(x) + 1) = 1 for x > 0, exp(x) otherwise
        return torch.ops.aten.elu_backward(grad, 1.0, 1.0, 1.0, False, x)
    if name == "identity":
        return grad
    raise ValueError(f"unknown feature_map {name!r}; choose one of {sorted(FEATURE_MAPS)}")


def get_feature_map(name: str | Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """A named feature map (``relu``, ``elu+1``) or a callable passed through unchanged."""
    if callable(name):
        return name
    if name not in FEATURE_MAPS:
        raise ValueError(
            f"unknown feature_map {name!r}; choose one of {sorted(FEATURE_MAPS)} or pass a callable"
        )
    return FEATURE_MAPS[name]
