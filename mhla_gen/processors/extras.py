"""Optional MHLA extras, each off by default: CPE and output gating."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvPositionEncoding(nn.Module):
    """CPE: depthwise conv of V on the 2D/3D token grid, added to the attention output.

    ``forward(v, grid)``: v ``(B, N, C)`` with heads merged, ``grid`` = ``(H, W)`` or ``(F, H, W)``
    -> ``(B, N, C)``. Initialised to zero so installing it does not change the model's output.
    """

    def __init__(self, channels: int, kernel_size: int, ndim: int = 2):
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"cpe kernel_size must be a positive odd integer, got {kernel_size}")
        if ndim not in (2, 3):
            raise ValueError(f"CPE works on 2D or 3D grids, got ndim={ndim}")
        conv = nn.Conv2d if ndim == 2 else nn.Conv3d
        self.ndim = ndim
        self.conv = conv(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, v: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        b, n, c = v.shape
        if len(grid) != self.ndim:
            raise ValueError(f"CPE built for {self.ndim}D grids, got grid {grid}")
        x = v.transpose(1, 2).reshape(b, c, *grid)  # (B, C, *grid)
        return self.conv(x).reshape(b, c, n).transpose(1, 2)


class OutputGate(nn.Module):
    """``out * act(Linear(x))`` with ``x`` the attention layer's input; ``act`` is sigmoid or SiLU.

    The projection starts at zero weight and a bias that makes the gate ≈ 1 (sigmoid(+6) ≈ 0.9975;
    for SiLU the bias is chosen so silu(b) = 1), so a freshly installed gate barely changes outputs.
    """

    def __init__(self, in_dim: int, out_dim: int, activation: str = "sigmoid"):
        super().__init__()
        if activation not in ("sigmoid", "silu"):
            raise ValueError(f"gate activation must be 'sigmoid' or 'silu', got {activation!r}")
        self.activation = activation
        self.proj = nn.Linear(in_dim, out_dim)
        nn.init.zeros_(self.proj.weight)
        nn.init.constant_(self.proj.bias, 6.0 if activation == "sigmoid" else 1.2785)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = self.proj(x)
        g = torch.sigmoid(g) if self.activation == "sigmoid" else F.silu(g)
        return out * g.to(out.dtype)
