"""What the streaming tests of MHLA Wan (``test_wan_streaming.py``) and of block-causal softmax Wan
(``test_wan_stream_softmax.py``) share: the chunk-by-chunk rollout and the causality check."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mhla_gen.integration.streaming import WanStreamCache, stream_step


def rollout(model, latent, text, timesteps, chunk: int, measure: Callable[[WanStreamCache], object],
            frames: int | None = None) -> tuple[torch.Tensor, list]:
    """The video ``latent (B, C, F, H, W)`` chunk by chunk through :func:`stream_step`, chunk c at
    ``timesteps[:, c]``: the outputs concatenated over frames and ``measure(cache)`` after each chunk."""
    cache = WanStreamCache.empty(model, latent.shape[0], latent.shape[-2:], frames)
    outs, measured = [], []
    for c, part in enumerate(latent.split(chunk, dim=2)):
        out, cache = stream_step(model, cache, part, timesteps[:, c], text)
        outs.append(out)
        measured.append(measure(cache))
    return torch.cat(outs, dim=2), measured


def assert_later_frames_leave_earlier_outputs(model, latent, text) -> None:
    """A block-causal model with one-frame chunks: changing frames 2.. leaves the outputs of frames 0-1
    bit for bit, and changes the later ones."""
    t = torch.tensor([500.0] * latent.shape[0], dtype=latent.dtype)
    changed = latent.clone()
    changed[:, :, 2:] += 1.0
    with torch.no_grad():
        before, after = model(latent, t, text).sample, model(changed, t, text).sample
    assert torch.equal(before[:, :, :2], after[:, :, :2])
    assert not torch.allclose(before[:, :, 2:], after[:, :, 2:])
