"""Which of a pipeline's transformers a fine-tuning run trains (``model.expert``), and what follows from it.

Wan2.2 A14B pipelines hold two experts of one architecture: ``transformer`` runs the steps with
``t >= boundary_ratio * T`` (high noise), ``transformer_2`` the rest. A run trains one of them, on its own
side of the boundary, starting from (and saving the LoRA base as) its own subfolder of ``model.pretrained``.
"""

from __future__ import annotations

import inspect

from .config import ConfigError


def check_expert(index: dict, expert: str, pretrained: str) -> None:
    """ConfigError when the pipeline's ``model_index.json`` (``index``) has no component ``expert``."""
    if expert != "transformer" and index.get(expert, [None])[0] is None:
        raise ConfigError(
            f"model.expert={expert}: model.pretrained={pretrained!r} has no {expert} "
            "(only Wan2.2 A14B pipelines have two experts)"
        )


def noise_range(boundary_ratio: float | None, expert: str) -> tuple[float, float]:
    """The σ range an expert trains on: all of ``[0, 1]`` without a boundary; ``[b, 1]`` for
    ``transformer`` (the pipeline runs it at ``t >= b T``), ``[0, b]`` for ``transformer_2``."""
    if boundary_ratio is None:
        return 0.0, 1.0
    return (boundary_ratio, 1.0) if expert == "transformer" else (0.0, boundary_ratio)


def in_expert_range(sigmas, boundary_ratio: float | None, expert: str):
    """Flow-matching σ ``(B,)`` in ``(0, 1)`` mapped affinely onto the expert's :func:`noise_range`
    (unchanged without a boundary), so the σ density keeps its shape within the range."""
    low, high = noise_range(boundary_ratio, expert)
    return low + (high - low) * sigmas


def pipeline_with(frozen, expert: str, transformer, progress: bool = False):
    """A new pipeline of ``frozen``'s class and components with ``transformer`` in the ``expert`` slot;
    ``frozen``'s settings that are ``__init__`` arguments but not components (Wan2.2: ``boundary_ratio``,
    ``expand_timesteps``) kept; a progress bar only with ``progress`` (the sample grids)."""
    cls = type(frozen)
    components = frozen.components
    accepted = inspect.signature(cls.__init__).parameters
    settings = {k: v for k, v in frozen.config.items() if k in accepted and k not in components}
    pipe = cls(**{**components, **settings, expert: transformer})
    pipe.set_progress_bar_config(disable=not progress, desc="sample grid", leave=False)
    return pipe
