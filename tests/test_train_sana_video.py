"""scripts/finetune_sana_video.py and linearize.py --base sana-video on a tiny SANA-Video checkpoint: stage 1
starts at zero error (uniform mixing, eps / M), stage 2 continues from its folder, the pipeline samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
from train_helpers import REPO, read_metrics, run_inprocess, write_captioned_videos

from mhla_gen import load_transformer
from mhla_gen.errors import ConfigError

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "sana-video.yaml")
M = 4  # blocks (1, 2, 2)


@pytest.fixture(scope="module")
def sana_video_setup(tmp_path_factory):
    from mhla_gen.testing.video import tiny_sana_video_pipeline

    root = tmp_path_factory.mktemp("sana_video")
    tiny_sana_video_pipeline().save_pretrained(root / "ckpt")
    write_captioned_videos(root / "data", width=72)
    return root


def _common(setup, out):
    return ["--config", TINY, f"model.pretrained={setup / 'ckpt'}", f"data.path={setup / 'data'}",
            f"output_dir={out}", "train.max_steps=2"]


def test_stage1_starts_exactly_then_stage2_and_the_pipeline(sana_video_setup, tmp_path):
    from mhla_gen.pipelines.sana_video import load_sana_video_pipeline

    run_inprocess("linearize.py", "--base", "sana-video", *_common(sana_video_setup, tmp_path / "s1"),
                  "mhla.mixing_init=uniform", f"mhla.eps={1e-15 / M}")
    report = json.loads((tmp_path / "s1" / "transfer.json").read_text())
    assert max(report["errors_before"].values()) < 1e-10  # SANA-Video's own attention: nothing to learn
    run_inprocess("finetune_sana_video.py", *_common(sana_video_setup, tmp_path / "s2"),
                  f"model.init_from={tmp_path / 's1' / 'final'}", "train.trainable=mhla")
    assert all(np.isfinite(r["loss"]) for r in read_metrics(tmp_path / "s2"))
    assert (tmp_path / "s2" / "samples" / "step_0000002.png").is_file()
    pipe = load_sana_video_pipeline(sana_video_setup / "ckpt", transformer_path=tmp_path / "s2" / "final")
    assert pipe.transformer.mhla_config.mixing_init == "uniform"
    video = pipe("a cat runs", height=32, width=64, frames=5, num_inference_steps=2, max_sequence_length=8,
                 use_resolution_binning=False, complex_human_instruction=None, output_type="np").frames[0]
    assert video.shape == (5, 32, 64, 3) and np.isfinite(video).all()


def test_lora_finetune_loads_back(sana_video_setup, tmp_path):
    run_inprocess("finetune_sana_video.py", *_common(sana_video_setup, tmp_path / "run"),
                  "train.trainable=lora", "log.sample_every=0")
    model = load_transformer(tmp_path / "run" / "final")
    assert model.mhla_config.blocks == (1, 2, 2)


@pytest.mark.parametrize("overrides, message", [
    (["data.height=48"], r"data\.height=48 must be a multiple of 32"),
    (["mhla.blocks=[3,2,2]"], r"mhla\.blocks=\[3, 2, 2\] does not fit the token grid \(2, 2, 4\)"),
    (["model.expert=transformer_2"], "has no transformer_2"),
])
def test_bad_settings_fail_before_any_work(sana_video_setup, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_inprocess("finetune_sana_video.py", *_common(sana_video_setup, tmp_path / "run"), *overrides)
    assert not (tmp_path / "run").exists()


def test_converter_config_starts_exactly_at_the_checkpoint():
    """The record's stage-1 config for the real model (``configs/linearize/sana-video_2b_480p.yaml``): blocks
    that fit the 480p grid (21, 30, 52), uniform mixing and SANA-Video's eps over M, the exact start the test
    above checks at M = 4."""
    import math

    from mhla_gen.bases import base_for
    from mhla_gen.configs import resolve_config
    from mhla_gen.processors.sana_video import SANA_VIDEO_EPS
    from mhla_gen.train.config import load_config
    from mhla_gen.train.linearize import stage1_schema

    base = base_for("sana-video")
    cfg = load_config(stage1_schema(base), resolve_config(base.converter_config))
    blocks = cfg.mhla.blocks
    assert all(b <= g for b, g in zip(blocks, (21, 30, 52))) and len(blocks) == 3
    assert cfg.mhla.mixing_init == "uniform"
    assert cfg.mhla.eps == SANA_VIDEO_EPS / math.prod(blocks)
    assert (cfg.data.height, cfg.data.width, cfg.data.num_frames) == (480, 832, 81)
