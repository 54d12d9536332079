"""Fine-tuning and stage-1 conversion per expert of a tiny Wan2.2 A14B pipeline (``model.expert``): each
expert trains on its own side of ``boundary_ratio``; the two runs' folders sample together."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from train_helpers import REPO, run_inprocess, write_captioned_videos

from mhla_gen import load_transformer
from mhla_gen.errors import ConfigError
from mhla_gen.testing.video import WAN22_T2V_BOUNDARY, tiny_wan22_pipeline

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "wan.yaml")


@pytest.fixture(scope="module")
def a14b_setup(tmp_path_factory):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan22")
    tiny_wan22_pipeline().save_pretrained(root / "ckpt")
    tiny_wan_pipeline().save_pretrained(root / "wan21")
    write_captioned_videos(root / "data")
    return root


def _common(setup, out, expert, pretrained="ckpt"):
    return [
        "--config",
        TINY,
        f"model.pretrained={setup / pretrained}",
        f"data.path={setup / 'data'}",
        f"output_dir={out}",
        f"model.expert={expert}",
        "train.max_steps=2",
    ]


@pytest.fixture
def trained_sigmas(monkeypatch):
    """Every σ the fine-tuning loss noised a batch at (a spy on ``flow_matching_inputs``, which the run's
    ``FlowNoise`` calls)."""
    from mhla_gen.train.objectives import flow

    seen, original = [], flow.flow_matching_inputs

    def spy(x0, noise, sigmas, num_train_timesteps):
        seen.extend(sigmas.flatten().tolist())
        return original(x0, noise, sigmas, num_train_timesteps)

    monkeypatch.setattr(flow, "flow_matching_inputs", spy)
    return seen


@pytest.fixture
def sampling_pipelines(monkeypatch):
    """``(boundary_ratio, has transformer_2)`` of every WanPipeline call (the runs' sample grids)."""
    from diffusers import WanPipeline

    seen, original = [], WanPipeline.__call__

    def spy(self, *args, **kwargs):
        seen.append((self.config.boundary_ratio, self.transformer_2 is not None))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(WanPipeline, "__call__", spy)
    return seen


def test_each_expert_finetunes_on_its_noise_range_and_both_sample(
    a14b_setup, tmp_path, trained_sigmas, sampling_pipelines
):
    from mhla_gen.pipelines.wan import load_wan_pipeline

    boundary = WAN22_T2V_BOUNDARY
    run_inprocess("finetune_wan.py", *_common(a14b_setup, tmp_path / "high", "transformer"))
    assert trained_sigmas and min(trained_sigmas) >= boundary
    assert sampling_pipelines == [(boundary, True)]  # the run's samples use both experts
    trained_sigmas.clear()
    run_inprocess(
        "finetune_wan.py", *_common(a14b_setup, tmp_path / "low", "transformer_2"), "mhla.layers=[1, 2]"
    )  # the low-noise expert with its own hybrid layers
    assert trained_sigmas and max(trained_sigmas) < boundary
    low = load_transformer(tmp_path / "low" / "final")
    assert low.mhla_config.layers == [1, 2]
    # it started from transformer_2 (2 small steps away), not from the high-noise expert
    distance = {
        name: (
            low.blocks[0].ffn.net[2].weight
            - load_transformer(a14b_setup / "ckpt" / name).blocks[0].ffn.net[2].weight
        )
        .abs()
        .max()
        for name in ("transformer", "transformer_2")
    }
    assert 0 < distance["transformer_2"] < 0.1 * distance["transformer"], distance
    pipe = load_wan_pipeline(
        a14b_setup / "ckpt",
        torch_dtype=torch.float32,
        transformer_path=tmp_path / "high" / "final",
        transformer_2_path=tmp_path / "low" / "final",
    )
    assert pipe.transformer.mhla_config.layers == [0, 1] and pipe.transformer_2.mhla_config.layers == [1, 2]
    video = pipe(
        "a cat runs",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=3,
        max_sequence_length=8,
        output_type="np",
    ).frames[0]
    assert video.shape == (5, 32, 32, 3) and np.isfinite(video).all()


def test_stage1_conversion_of_the_low_noise_expert(a14b_setup, tmp_path):
    """linearize.py with model.expert=transformer_2: the teacher and the start are the low-noise expert."""
    run_inprocess("linearize.py", "--base", "wan", *_common(a14b_setup, tmp_path / "s1", "transformer_2"))
    converted = load_transformer(tmp_path / "s1" / "final")
    stock_low = load_transformer(a14b_setup / "ckpt" / "transformer_2")
    # stage 1 trains only the MHLA parameters: every pretrained weight is the low-noise expert's
    assert torch.equal(converted.blocks[2].ffn.net[2].weight, stock_low.blocks[2].ffn.net[2].weight)
    assert converted.mhla_config.layers == [0, 1]


def test_second_expert_of_a_one_transformer_pipeline_is_refused(a14b_setup, tmp_path):
    with pytest.raises(ConfigError, match="model.expert=transformer_2.*has no transformer_2"):
        run_inprocess("finetune_wan.py", *_common(a14b_setup, tmp_path / "run", "transformer_2", "wan21"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="model.expert must be transformer or transformer_2"):
        run_inprocess("finetune_wan.py", *_common(a14b_setup, tmp_path / "run", "transformer_3"))


def test_teacher_data_of_either_expert_comes_from_the_whole_stock_pipeline(a14b_setup, tmp_path, monkeypatch):
    """data.source=teacher in a run of one expert: the teacher videos are sampled by the stock two-expert
    pipeline (each expert in its own slot, both called on their own noise ranges), whichever expert the run
    trains; the two runs' fingerprints agree, so they may share the data."""
    from mhla_gen.train.finetune import WanTask

    stock = {name: load_transformer(a14b_setup / "ckpt" / name) for name in ("transformer", "transformer_2")}
    seen, original = [], WanTask.teacher_sample

    def spy(self, pipe, prompt, seed):
        for name, model in stock.items():  # the slot holds that expert's own stock weights
            seen.append((name, torch.equal(getattr(pipe, name).blocks[0].ffn.net[2].weight,
                                           model.blocks[0].ffn.net[2].weight)))
        assert pipe.config.boundary_ratio == WAN22_T2V_BOUNDARY
        return original(self, pipe, prompt, seed)

    monkeypatch.setattr(WanTask, "teacher_sample", spy)
    (tmp_path / "prompts.txt").write_text("a cat runs\n")
    meta = {}
    for expert in ("transformer", "transformer_2"):
        seen.clear()
        data = tmp_path / f"teacher_{expert}"
        prompts = f"data.prompts_file={tmp_path / 'prompts.txt'}"
        teacher = ["data.source=teacher", f"data.path={data}", prompts, "data.teacher_samples=2"]
        run_inprocess("finetune_wan.py", *_common(a14b_setup, tmp_path / expert, expert), *teacher,
                      "train.max_steps=1", "log.sample_every=0")
        assert seen == [("transformer", True), ("transformer_2", True)] * 2, (expert, seen)
        meta[expert] = json.loads((data / "meta.json").read_text())["fingerprint"]
    assert meta["transformer"] == meta["transformer_2"] and meta["transformer"]["experts"] == "both, stock"
