"""scripts/finetune_wan_i2v.py and linearize.py --base wan-i2v on tiny Wan I2V checkpoints (Wan2.2 I2V-A14B:
two experts, 36 channels; Wan2.1 I2V: CLIP image features): each video's first frame is its condition, built
as WanImageToVideoPipeline builds it; the run's folder samples through the record's sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import REPO, read_metrics, run_inprocess, write_captioned_videos

from mhla_gen import load_transformer
from mhla_gen.errors import ConfigError

# 5 frames 32x32: latent (2, 4, 4), tokens (2, 2, 2)
TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "wan.yaml")


@pytest.fixture(scope="module")
def i2v_setup(tmp_path_factory):
    from mhla_gen.testing.video import tiny_wan22_i2v_pipeline, tiny_wan_i2v_pipeline

    root = tmp_path_factory.mktemp("wan_i2v_train")
    tiny_wan22_i2v_pipeline().save_pretrained(root / "wan22")
    tiny_wan_i2v_pipeline().save_pretrained(root / "wan21")
    write_captioned_videos(root / "data")
    return root


def _common(setup, out, pretrained="wan22", *extra):
    return ["--config", TINY, f"model.pretrained={setup / pretrained}", f"data.path={setup / 'data'}",
            f"output_dir={out}", "train.max_steps=2", *extra]


def test_finetune_conditions_on_the_first_frame_and_samples(i2v_setup, tmp_path, monkeypatch):
    """Wan2.2 I2V (expert ``transformer_2``): the cache holds the pipeline's own condition of each video's
    first frame (4 mask channels, 1 on the first latent frame only, then the first frame's latents), which
    the model gets behind the noisy latents; two steps run; the folder loads as ``wan-i2v`` and samples with
    the stock other expert."""
    from diffusers import WanImageToVideoPipeline
    from safetensors.torch import load_file

    from mhla_gen.bases import base_for, base_for_model
    from mhla_gen.data import CaptionedVideoFolder
    from mhla_gen.pipelines import SampleSettings
    from mhla_gen.train.finetune_wan_i2v import WanI2VTask

    seen, original = [], WanI2VTask.model_inputs

    def spy(self, batch, rnd):
        inputs, target = original(self, batch, rnd)
        condition = batch["condition"].to(inputs["hidden_states"])
        seen.append(torch.equal(inputs["hidden_states"][:, 16:], condition))
        return inputs, target

    monkeypatch.setattr(WanI2VTask, "model_inputs", spy)
    out = tmp_path / "run"
    run_inprocess("finetune_wan_i2v.py", *_common(i2v_setup, out, "wan22", "model.expert=transformer_2"))
    assert seen == [True, True]
    assert all(np.isfinite(r["loss"]) for r in read_metrics(out))
    assert (out / "samples" / "step_0000002.png").is_file()
    item = load_file(str(out / "cache" / "items" / "00000000.safetensors"))
    assert item["condition"].shape == (20, 2, 4, 4) and "image_embeds" not in item
    mask = item["condition"][:4]
    assert torch.equal(mask[:, 0], torch.ones(4, 4, 4)) and torch.equal(mask[:, 1], torch.zeros(4, 4, 4))
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_setup / "wan22")
    first = CaptionedVideoFolder(i2v_setup / "data", 5, 32, 32).load(0)["pixels"][:, 0][None]
    expected = pipe.prepare_latents(first, 1, 16, 32, 32, 5, torch.float32, "cpu", torch.Generator())[1][0]
    torch.testing.assert_close(item["condition"], expected, rtol=0, atol=1e-6)
    final = load_transformer(out / "final")
    assert base_for_model(final) is base_for("wan-i2v") and final.mhla_config.layers == [0, 1]
    sampler = base_for("wan-i2v").sampler.load()
    pipe = sampler.load(i2v_setup / "wan22", None, torch.float32, None, None)
    pipe = type(pipe).from_pretrained(i2v_setup / "wan22", transformer_2=final)
    settings = SampleSettings(steps=2, height=32, width=32, frames=5, output_type="np", max_sequence_length=8)
    video = sampler.sample(pipe, [("a cat runs", Image.new("RGB", (32, 32)))], None, settings)[0]
    assert video.shape == (5, 32, 32, 3) and np.isfinite(video).all()


def test_clip_model_finetunes_and_converts_with_image_features(i2v_setup, tmp_path):
    """Wan2.1 I2V: the cache also holds the first frame's CLIP features, which reach the loss; stage 1
    (linearize.py --base wan-i2v) runs on the same inputs."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    clip = ("data.max_sequence_length=512", "train.max_steps=1", "log.sample_every=0")
    run_inprocess("finetune_wan_i2v.py", *_common(i2v_setup, out, "wan21", *clip))
    item = load_file(str(out / "cache" / "items" / "00000000.safetensors"))
    assert item["image_embeds"].shape[-1] == 8 and item["prompt_embeds"].shape[0] == 512
    run_inprocess("linearize.py", "--base", "wan-i2v", *_common(i2v_setup, tmp_path / "s1", "wan21", *clip))
    assert load_transformer(tmp_path / "s1" / "final").config.image_dim == 8


@pytest.mark.parametrize("pretrained, overrides, message", [
    ("wan22", ["data.source=teacher", "data.prompts_file=p.txt", "data.teacher_samples=2"],
     r"data.source=teacher: base wan-i2v trains on videos"),
    ("wan21", [], r"data.max_sequence_length=8: a Wan I2V model with CLIP image features takes exactly 512"),
    ("wan22", ["model.expert=transformer_3"], "model.expert must be transformer or transformer_2"),
])
def test_bad_settings_fail_before_any_work(i2v_setup, tmp_path, pretrained, overrides, message):
    with pytest.raises(ValueError, match=message):
        run_inprocess("finetune_wan_i2v.py", *_common(i2v_setup, tmp_path / "run", pretrained, *overrides))
    assert not (tmp_path / "run").exists()


def test_a_text_to_video_checkpoint_is_refused(i2v_setup, tmp_path):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "t2v")
    with pytest.raises(ConfigError, match="is a WanPipeline checkpoint, not a WanImageToVideoPipeline"):
        run_inprocess("finetune_wan_i2v.py", "--config", TINY, f"model.pretrained={tmp_path / 't2v'}",
                      f"data.path={i2v_setup / 'data'}", f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()
