"""scripts/finetune_wan.py on a tiny Wan checkpoint (save_pretrained) and tiny captioned videos."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file
from train_helpers import REPO, read_metrics, run_inprocess

TINY = str(REPO / "configs" / "tiny" / "wan.yaml")


@pytest.fixture(scope="module")
def wan_setup(tmp_path_factory):
    import imageio.v3 as iio

    from mhla_gen.testing_wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan")
    tiny_wan_pipeline().save_pretrained(root / "ckpt")
    (root / "data").mkdir()
    rng = np.random.default_rng(0)
    for i, caption in enumerate(["a cat runs", "a dog swims"]):
        frames = rng.integers(0, 255, (6, 40, 48, 3), dtype=np.uint8)
        iio.imwrite(root / "data" / f"{i}.mp4", frames, fps=8, codec="libx264", plugin="pyav")
        (root / "data" / f"{i}.txt").write_text(caption)
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
    from mhla_gen.serialization import load_transformer

    finetune(wan_setup, tmp_path, "train.max_steps=2", "train.gradient_checkpointing=true")
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert meta["count"] == 2 and meta["skipped"] == 1
    item = load_file(str(tmp_path / "cache" / "items" / "00000000.safetensors"))
    assert item["latents"].shape == (16, 2, 4, 4)  # 5 frames -> 2 latent frames, 32 px -> 4
    assert (tmp_path / "samples" / "step_0000002.png").is_file()
    finetune(wan_setup, tmp_path, "train.max_steps=3", "train.gradient_checkpointing=true")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    model = load_transformer(tmp_path / "final")
    assert model.mhla_config.blocks == (1, 2, 2) and model.mhla_config.layers == [0, 1]


def test_frame_count_must_be_4k_plus_1(wan_setup, tmp_path):
    with pytest.raises(ValueError, match="4k"):
        finetune(wan_setup, tmp_path, "data.num_frames=4")


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
