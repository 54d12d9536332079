"""scripts/finetune_wan.py on a tiny Wan checkpoint (save_pretrained) and tiny captioned videos."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from train_helpers import (
    REPO,
    final_weights,
    max_abs_diff,
    read_metrics,
    run_inprocess,
    write_captioned_videos,
)

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "wan.yaml")


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan")
    tiny_wan_pipeline().save_pretrained(root / "ckpt")
    write_captioned_videos(root / "data")
    (root / "data" / "bad.mp4").write_bytes(b"\x00not a video")
    (root / "data" / "bad.txt").write_text("a bird flies")
    return root


def finetune(setup, out, *overrides):
    run_inprocess(
        "finetune_wan.py",
        "--config",
        TINY,
        f"model.pretrained={setup / 'ckpt'}",
        f"data.path={setup / 'data'}",
        f"output_dir={out}",
        *overrides,
    )


def test_finetune_hybrid_checkpoint_resume(wan_setup, tmp_path):
    """Accumulation 2: 2 steps, then resume=latest to 3, equals an uninterrupted 3-step run exactly."""
    from mhla_gen.integration.loading import load_transformer

    run = tmp_path / "run"
    common = ("train.gradient_checkpointing=true", "train.gradient_accumulation_steps=2")
    finetune(wan_setup, run, "train.max_steps=2", *common)
    meta = json.loads((run / "cache" / "meta.json").read_text())
    assert meta["count"] == 2 and meta["skipped"] == 1
    item = load_file(str(run / "cache" / "items" / "00000000.safetensors"))
    assert item["latents"].shape == (16, 2, 4, 4)  # 5 frames -> 2 latent frames, 32 px -> 4
    assert (run / "samples" / "step_0000002.png").is_file()
    finetune(wan_setup, run, "train.max_steps=3", *common)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    model = load_transformer(run / "final")
    assert model.mhla_config.blocks == (1, 2, 2) and model.mhla_config.layers == [0, 1]
    finetune(wan_setup, tmp_path / "ref", "train.max_steps=3", *common, "log.sample_every=0")
    assert max_abs_diff(final_weights(run), final_weights(tmp_path / "ref")) == 0.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.num_frames=4"], "4k"),
        (["data.height=40"], r"data\.height=40 must be a multiple of 16"),
        (["mhla.blocks=[3,2,2]"], r"mhla\.blocks=\[3, 2, 2\] does not fit the token grid \(2, 2, 2\)"),
        (["mhla.blocks=[2,2]"], r"mhla\.blocks=\[2, 2\] does not fit"),
    ],
)
def test_bad_settings_fail_before_any_work(wan_setup, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        finetune(wan_setup, tmp_path / "run", *overrides)
    assert not (tmp_path / "run").exists()


def test_missing_video_folder(wan_setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_videos"):
        run_inprocess(
            "finetune_wan.py",
            "--config",
            TINY,
            f"model.pretrained={wan_setup / 'ckpt'}",
            f"data.path={tmp_path / 'missing_videos'}",
            f"output_dir={tmp_path / 'run'}",
        )
