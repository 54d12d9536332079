"""scikit-learn's embedded 8×8 handwritten digits as image tensors: the offline dataset of the main job."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def digits_tensors(resolution: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits, upsampled to ``resolution`` × ``resolution``.

    Returns:
        images: float32 ``(1797, 1, R, R)`` in [0, 1] (antialiased bilinear resize of the 0..16 pixels).
        labels: long ``(1797,)`` in 0..9.
    """
    if resolution < 1:
        raise ValueError(f"resolution must be a positive int, got {resolution}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8) in [0, 1]
    if resolution != 8:
        images = F.interpolate(
            images, size=(resolution, resolution), mode="bilinear", align_corners=False, antialias=True
        )
    labels = torch.from_numpy(digits.target).long()
    return images.clamp_(0.0, 1.0).contiguous(), labels
