"""The objective is a component the base record names (``Base.objective``): every task builds the record's
objective from its run-config section, and a captioned base trained with DDPM (a record used only here)
needs no method of flow matching: it trains through the one captioned task with nothing overridden."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
from train_helpers import REPO, _reset_accelerate, final_weights, read_metrics

from mhla_gen.bases import BASES, Ref, base_for
from mhla_gen.train.config import (
    CaptionDataConfig,
    DiffusionConfig,
    DiTRunConfig,
    FinetuneModelConfig,
    RunConfig,
    SanaRunConfig,
    load_config,
)
from mhla_gen.train.finetune import SanaTask
from mhla_gen.train.objectives import DDPM, FlowMatching, Objective, objective_settings
from mhla_gen.train.randomness import StepRandom

TINY = REPO / "mhla_gen" / "configs" / "tiny"


@dataclass
class CaptionedDDPMRunConfig(RunConfig):
    """A captioned run trained with DDPM: the ``diffusion`` section, no ``flow`` one."""

    output_dir: str = "runs/sana_ddpm"
    model: FinetuneModelConfig = field(default_factory=FinetuneModelConfig)
    data: CaptionDataConfig = field(default_factory=CaptionDataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)


SANA_DDPM = dataclasses.replace(
    base_for("sana"), name="sana-ddpm", objective=Ref("mhla_gen.train.objectives:DDPM"),
    run_config=Ref("test_train_objectives:CaptionedDDPMRunConfig"),
    task=Ref("test_train_objectives:SanaDDPMTask"),
)
"""SANA's record with DDPM as its objective (tests only: not in ``BASES``)."""


class SanaDDPMTask(SanaTask):
    """SANA's encode, conditioning and sampling calls, trained with the record's DDPM: nothing else."""

    name = "sana-ddpm"
    base = SANA_DDPM


PIPELINE_CALLS = {"size_multiple", "token_grid", "encode_pixels", "encode_text", "conditioning",
                  "teacher_sample", "sample_images"}


def _own_methods(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("__")}


@pytest.fixture(scope="module")
def sana_setup(tmp_path_factory):
    """A tiny SANA checkpoint and two captioned images."""
    from PIL import Image

    from mhla_gen.testing import tiny_sana_pipeline

    root = tmp_path_factory.mktemp("sana_ddpm")
    tiny_sana_pipeline().save_pretrained(root / "ckpt")
    (root / "data").mkdir()
    for i in range(2):
        Image.new("RGB", (32, 32), (60 * i, 90, 200)).save(root / "data" / f"{i}.png")
        (root / "data" / f"{i}.txt").write_text(f"a square number {i}")
    return root


def _sana_task(setup, task_cls, schema, *overrides):
    from diffusers import SanaPipeline

    cfg = load_config(schema, str(TINY / "sana.yaml"), [f"model.pretrained={setup / 'ckpt'}", *overrides])
    task = task_cls(cfg)
    task.frozen = SanaPipeline.from_pretrained(setup / "ckpt")  # what setup() loads: its scheduler
    return task


def test_every_base_names_an_objective_its_run_config_configures():
    for base in BASES.values():
        objective = base.objective.load()
        assert issubclass(objective, Objective), base.name
        if base.trains:
            assert isinstance(objective_settings(objective, base.run_config.load()()), objective.settings)
    with pytest.raises(ValueError, match="SanaRunConfig has no 'diffusion' section, which the objective"):
        objective_settings(DDPM, SanaRunConfig())


def test_the_records_objective_is_the_one_the_task_trains_with(sana_setup):
    """SANA's record names flow matching, DiT's DDPM; the same captioned task with a record naming DDPM
    builds DDPM from its ``diffusion`` section and noises at integer timesteps."""
    from mhla_gen.train.dit import DiTTask

    assert type(_sana_task(sana_setup, SanaTask, SanaRunConfig).objective) is FlowMatching
    dit = DiTTask(load_config(DiTRunConfig, str(TINY / "dit.yaml"), ["diffusion.num_train_timesteps=50"]))
    assert type(dit.objective) is DDPM and dit.objective.terms.num_timesteps == 50

    task = _sana_task(sana_setup, SanaDDPMTask, CaptionedDDPMRunConfig,
                      "diffusion.num_train_timesteps=20")
    assert type(task.objective) is DDPM and task.objective.terms.num_timesteps == 20
    batch = {"latents": torch.randn(4, 4, 2, 2), "prompt_embeds": torch.randn(4, 8, 16),
             "prompt_attention_mask": torch.ones(4, 8)}
    inputs, (x0, xt, noise, t) = task.model_inputs(batch, StepRandom(0, 3, 4))
    assert t.dtype == torch.long and ((0 <= t) & (t < 20)).all() and torch.equal(inputs["timestep"], t)
    assert torch.equal(inputs["hidden_states"], task.objective.scheduler.add_noise(x0, noise, t))
    assert set(inputs) == {"hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"}


def test_a_captioned_ddpm_base_trains_with_no_flow_method(sana_setup, tmp_path, monkeypatch):
    """One training step of SANA under DDPM through the captioned task and the loop: its task class holds
    only pipeline calls, its run config no ``flow`` section, and every loss is the DDPM objective's."""
    from mhla_gen.train.loop import train

    assert _own_methods(SanaDDPMTask) == set() and _own_methods(SanaTask) <= PIPELINE_CALLS
    losses, original = [], DDPM.loss

    def spy(self, prediction, target):
        losses.append(original(self, prediction, target))
        return losses[-1]

    monkeypatch.setattr(DDPM, "loss", spy)
    schema = SANA_DDPM.run_config.load()
    cfg = load_config(schema, str(TINY / "sana.yaml"), [
        f"model.pretrained={sana_setup / 'ckpt'}", f"data.path={sana_setup / 'data'}",
        f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "log.sample_every=0"])
    assert not hasattr(cfg, "flow")
    _reset_accelerate()
    try:
        train(cfg, SANA_DDPM.task.load()(cfg))
    finally:
        _reset_accelerate()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]
    assert len(losses) == 1 and torch.isfinite(losses[0])
    assert final_weights(tmp_path / "run")
