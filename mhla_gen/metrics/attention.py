"""Per-layer attention statistics of a transformer: numerical rank and mean row entropy of the
self-attention maps it actually computes (the paper's Fig. 3b measures, via
:mod:`mhla_gen.metrics.attention_maps`).

Capture: forward hooks on each self-attention layer's ``to_q`` / ``to_k`` record the projections
``(B, N, heads·d)``; the layer's q/k norms are applied the way the processors apply them (across heads
when the norm spans ``heads·d`` — SANA, Wan — else per head), then heads are split to ``(B, H, N, d)``.
The kind of map follows the layer's processor: an MHLA processor -> ``mhla`` with that layer's mixing
matrix, block layout and feature map; SANA's stock linear processor -> ``linear`` (ReLU); anything
else -> ``softmax``. Wan's RoPE is not applied (statistics of pre-RoPE q/k); attention maps are
``N × N``, so keep N small (``max_tokens``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from ..bases import base_for_model
from ..processors import MHLAProcessor
from ..processors.grid import latent_from_call
from .attention_maps import attention_matrix, attention_rank, mirror_block_share, mirror_mass, row_entropy


def self_attention_layers(transformer: nn.Module) -> list[nn.Module]:
    """The self-attention modules in depth order (via the base model's MHLA processor class)."""
    return base_for_model(transformer).processor.self_attention(transformer)


def layer_kind(attn: nn.Module) -> str:
    processor = attn.processor
    if isinstance(processor, MHLAProcessor):
        return "mhla"
    return "linear" if "LinearAttn" in type(processor).__name__ else "softmax"


def _apply_norm(norm: nn.Module | None, x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x (B, N, heads·d)`` -> ``(B, heads, N, d)`` with ``norm`` across heads or per head."""
    weight = getattr(norm, "weight", None)
    across_heads = weight is not None and weight.numel() == x.shape[-1]
    if across_heads:
        x = norm(x)
    x = x.unflatten(-1, (heads, -1)).transpose(1, 2)
    if norm is not None and not across_heads:
        x = norm(x)
    return x


@contextmanager
def capture_qk(transformer: nn.Module):
    """Context manager yielding ``{layer index: {"q": (B,H,N,d), "k": ..., "kind", "attn", "grid"}}``
    filled by the first forward run inside it (later forwards are ignored)."""
    records: dict[int, dict] = {}
    grid: dict = {}  # the token grid of the first forward (the grid every MHLA layer of that call uses)

    def save_grid(model, args, kwargs):
        latent = latent_from_call(args, kwargs)
        grid.setdefault("grid", base_for_model(model).processor.latent_grid(model, latent))

    handles = [transformer.register_forward_pre_hook(save_grid, with_kwargs=True)]
    for index, attn in enumerate(self_attention_layers(transformer)):
        slot: dict = {"kind": layer_kind(attn), "attn": attn}

        def save(name, slot=slot):
            def hook(module, args, output):
                slot.setdefault(name, output.detach())
            return hook

        handles.append(attn.to_q.register_forward_hook(save("q_raw")))
        handles.append(attn.to_k.register_forward_hook(save("k_raw")))
        records[index] = slot
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()
        for slot in records.values():
            attn = slot["attn"]
            slot["grid"] = grid.get("grid")
            if "q_raw" in slot:
                slot["q"] = _apply_norm(getattr(attn, "norm_q", None), slot.pop("q_raw"), attn.heads)
                slot["k"] = _apply_norm(getattr(attn, "norm_k", None), slot.pop("k_raw"), attn.heads)


@torch.no_grad()
def attention_statistics(transformer: nn.Module, run: Callable[[], object], max_tokens: int = 1024,
                         rtol: float = 1e-6) -> list[dict]:
    """Run ``run()`` (one forward of ``transformer``) and return per-layer statistics.

    Each entry: ``{"layer", "kind", "tokens", "heads", "rank", "rank_fraction", "entropy",
    "max_entropy"}`` — rank and entropy (nats) averaged over batch and heads; ``max_entropy = log N`` is
    the uniform map's entropy. On an image / video token grid also ``"mirror_mass"`` (averaged over heads)
    and ``"mirror_mass_best_head"`` (the head that routes most):
    :func:`mhla_gen.metrics.attention_maps.mirror_mass`, whose uniform value is ``1 / N``; MHLA layers on such
    a grid also ``"mirror_block_share"``, the same question asked of their mixing matrix
    (:func:`mhla_gen.metrics.attention_maps.mirror_block_share`, uniform ``1 / M``).
    """
    chunks = getattr(getattr(transformer, "mhla_config", None), "chunk_frames", None)
    if chunks is not None:  # the maps below are bidirectional: they would misdescribe a block-causal model
        raise ValueError(f"attention statistics are built for bidirectional models; this one is block-causal "
                         f"(chunk_frames={chunks}, docs/streaming.md)")
    with capture_qk(transformer) as records:
        run()
    stats = []
    for index, slot in records.items():
        if "q" not in slot:
            raise ValueError(f"self-attention layer {index} was not called by run()")
        q = slot["q"]
        n = q.shape[2]
        if n > max_tokens:
            raise ValueError(f"layer {index} has {n} tokens > max_tokens={max_tokens}: the N×N maps would be "
                             "too large; use a smaller resolution or raise max_tokens")
        maps, stat = _layer_maps(slot, n)
        rank = attention_rank(maps, rtol=rtol).double().mean().item()
        stats.append({
            "layer": index, "kind": slot["kind"], "tokens": n, "heads": q.shape[1],
            "rank": rank, "rank_fraction": rank / n, "entropy": row_entropy(maps).mean().item(),
            "max_entropy": float(torch.log(torch.tensor(float(n)))), **stat,
        })
    return stats


def _layer_maps(slot: dict, n: int) -> tuple[torch.Tensor, dict]:
    """One captured layer's row-stochastic maps ``(B, H, N, N)`` and its mirror statistics (on an image
    or video grid: ``mirror_mass`` per head, mean and best; MHLA also ``mirror_block_share``)."""
    q, k, attn, grid = slot["q"], slot["k"], slot["attn"], slot["grid"]
    stat = {}
    if slot["kind"] == "mhla":
        layout, mixing = attn.processor.layout(grid, n), attn.processor.mixing().detach()
        maps = attention_matrix(q, k, "mhla", layout, mixing, attn.processor.cfg.feature_map)
        if len(layout.blocks) >= 2:
            stat["mirror_block_share"] = mirror_block_share(mixing, layout.blocks)
    else:
        maps = attention_matrix(q, k, slot["kind"])
    if grid is not None and len(grid) >= 2 and torch.Size(grid).numel() == n:
        per_head = mirror_mass(maps, tuple(grid)).mean(0)  # (H,)
        stat.update(mirror_mass=per_head.mean().item(), mirror_mass_best_head=per_head.max().item())
    return maps, stat


def save_attention_statistics(stats: list[dict], json_path: str | os.PathLike, png_path=None,
                              title: str = "") -> None:
    """Write the statistics as JSON and (``png_path``) a two-panel plot: rank and entropy per layer."""
    with open(json_path, "w") as f:
        json.dump(stats, f, indent=2)
    if png_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [s["layer"] for s in stats]
    fig, (ax_rank, ax_ent) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax_rank.plot(layers, [s["rank"] for s in stats], "o-")
    ax_rank.axhline(stats[0]["tokens"], ls="--", c="gray", label="N (full rank)")
    ax_rank.set(xlabel="layer", ylabel="rank", title="attention rank")
    ax_rank.legend()
    ax_ent.plot(layers, [s["entropy"] for s in stats], "o-")
    ax_ent.axhline(stats[0]["max_entropy"], ls="--", c="gray", label="log N (uniform)")
    ax_ent.set(xlabel="layer", ylabel="nats", title="mean row entropy")
    ax_ent.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def example_inputs(transformer: nn.Module, batch: int = 2, size: int | None = None, frames: int = 3,
                   timestep: int = 500, images: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None, seed: int = 0) -> dict:
    """Forward kwargs for a transformer of any base record: noised latents at ``timestep`` (DDPM linear
    schedule, as DiT trains) from ``images`` ``(B, C, S, S)`` in [-1, 1] when given, else pure noise, and the
    conditioning its record's test reference builds (``Base.tiny``'s ``forward_kwargs``: class labels, or
    random caption embeddings, image features where the model takes them). ``size`` defaults to the
    model's ``sample_size``; ``frames``: latent frames of video models."""
    from diffusers import DDPMScheduler

    gen = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    base = base_for_model(transformer)
    size = size or cfg.get("sample_size") or 8
    spatial = (frames, size, size) if base.video else (size, size)
    noise = torch.randn((batch, cfg.in_channels, *spatial), generator=gen)
    t = torch.full((batch,), timestep, dtype=torch.long)
    x = noise if images is None else DDPMScheduler().add_noise(images[:batch], noise, t)
    labels = None if labels is None else labels[:batch]
    return base.tiny.load().forward_kwargs(transformer, x, t, gen, labels=labels)
