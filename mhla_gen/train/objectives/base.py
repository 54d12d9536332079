"""What a training task asks of its objective (:class:`Objective`) and what it tells it (:class:`ModelFacts`).

A task never computes a loss itself: it hands clean latents to its objective and gets back the
transformer's noised inputs and a target, then the loss of the transformer's output against that target.
Every random draw goes through the micro-step's :class:`~mhla_gen.train.randomness.StepRandom`, in the
order the objective makes them, so a resumed run draws what an uninterrupted one does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class ModelFacts:
    """What an objective is told about the model a run trains and the pipeline it comes from.

    Attributes:
        scheduler: the checkpoint's scheduler config (flow matching: its shift and timestep count); empty
            for a model trained from scratch, or before the pipeline is loaded (start-up checks).
        boundary_ratio: a Wan2.2 pipeline's expert boundary (``expert`` trains on its side of it), or None.
        expert: the pipeline slot the run trains (``model.expert``).
        chunk_frames: latent frames per chunk of a block-causal model (``mhla.chunk_frames``), or None.
        learn_sigma: the model outputs ε and a variance (2C channels: DiT's ``model.learn_sigma``); None:
            :attr:`transformer`'s output channels say it.
        transformer: reads the transformer's ``config.json`` (patch size, channels); called only by what
            needs it (per-chunk noise, a learned variance left to the config).
    """

    scheduler: Mapping[str, Any] = field(default_factory=dict)
    boundary_ratio: float | None = None
    expert: str = "transformer"
    chunk_frames: int | None = None
    learn_sigma: bool | None = None
    transformer: Callable[[], Mapping[str, Any]] = dict

    def outputs_variance(self) -> bool:
        """:attr:`learn_sigma`, else whether the transformer outputs twice its input channels."""
        if self.learn_sigma is not None:
            return self.learn_sigma
        config = self.transformer()
        return config.get("out_channels") == 2 * config["in_channels"]


class Objective:
    """One training objective, as tasks use it (a subclass per objective; :mod:`.ddpm`, :mod:`.flow`).

    Attributes:
        name: what the docs call it (``ddpm``, ``flow``).
        section: the run-config section holding its settings (``diffusion``, ``flow``): a run config has
            this section exactly when its base trains with this objective.
        settings: that section's dataclass.

    Per micro-step a task calls ``draws = draw(rnd, latents)`` (timesteps or noise levels, and the noise),
    then ``inputs, target = noised(x0, draws)`` and ``loss(prediction, target)``. Between the draw and the
    noising the task may draw its own numbers (flips, caption dropout), which keeps every earlier run's
    order of draws.
    """

    name: ClassVar[str]
    section: ClassVar[str]
    settings: ClassVar[type]

    @classmethod
    def check(cls, settings, facts: ModelFacts) -> None:
        """Start-up checks of ``settings`` against the model (before the pipeline is loaded: no
        ``facts.scheduler`` yet); ConfigError naming the setting. Nothing by default."""

    @classmethod
    def build(cls, settings, facts: ModelFacts) -> Objective:
        """The objective of a run from its config section ``settings`` and the ``facts`` of its model."""
        raise NotImplementedError

    def draw(self, rnd, latents: torch.Tensor) -> tuple:
        """This micro-step's random draws for a batch shaped like ``latents`` ``(B, C, ...)``."""
        raise NotImplementedError

    def noised(self, x0: torch.Tensor, draws: tuple) -> tuple[dict, tuple]:
        """``(inputs, target)``: the transformer's ``hidden_states`` and ``timestep`` for the clean latents
        ``x0`` at ``draws``, and what :meth:`loss` compares the transformer's output with."""
        raise NotImplementedError

    def loss(self, prediction: torch.Tensor, target: tuple) -> torch.Tensor:
        """The scalar loss of the transformer's output ``prediction`` against ``target``."""
        raise NotImplementedError


def objective_settings(objective: type[Objective], cfg) -> Any:
    """The section of the run config ``cfg`` that holds ``objective``'s settings; ValueError naming the
    section when the run config (a base's ``run_config``) has none."""
    if not hasattr(cfg, objective.section):
        raise ValueError(f"{type(cfg).__name__} has no {objective.section!r} section, which the objective "
                         f"{objective.name} reads its settings from (the base's run_config and objective "
                         f"do not match)")
    return getattr(cfg, objective.section)
