"""``data.source=moving_shapes``: Wan fine-tunes on clips drawn in code (no data folder), and the source's
sizes are checked before any work."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from train_helpers import REPO, read_metrics, run_inprocess

from mhla_gen.errors import ConfigError
from mhla_gen.train.caption_data import Items
from mhla_gen.train.caption_sources import CAPTION_SOURCES
from mhla_gen.train.config import CaptionDataConfig

TINY = str(REPO / "mhla_gen" / "configs" / "tiny" / "wan.yaml")


@pytest.fixture(scope="module")
def wan_checkpoint(tmp_path_factory):
    from mhla_gen.testing.wan import tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan_moving")
    tiny_wan_pipeline().save_pretrained(root / "ckpt")
    return root / "ckpt"


def _finetune(checkpoint, out, *overrides):
    run_inprocess("finetune_wan.py", "--config", TINY, f"model.pretrained={checkpoint}", f"output_dir={out}",
                  "data.source=moving_shapes", "data.clips=4", *overrides)


def test_wan_trains_on_drawn_clips(wan_checkpoint, tmp_path):
    run = tmp_path / "run"
    _finetune(wan_checkpoint, run, "train.max_steps=2", "log.sample_every=0")
    meta = json.loads((run / "cache" / "meta.json").read_text())
    assert meta["count"] == 4 and meta["skipped"] == 0
    item = load_file(str(run / "cache" / "items" / "00000003.safetensors"))
    assert item["latents"].shape == (16, 2, 4, 4)  # 5 frames of 32x32 -> 2 latent frames of 4x4
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_bad_moving_shapes_settings_fail_before_any_work(wan_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"data.num_frames must be >= 2 for moving shapes \(.*\), got 1"):
        _finetune(wan_checkpoint, tmp_path / "run", "data.num_frames=1")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="data.clips must be >= 1, got 0"):
        CaptionDataConfig(source="moving_shapes", clips=0)


def test_image_models_refuse_moving_shapes():
    data = CaptionDataConfig(source="moving_shapes")
    items = Items.of("sana", False, data, 0, lambda: 32)  # images
    with pytest.raises(ConfigError, match="moving_shapes draws videos; the sana model makes images"):
        CAPTION_SOURCES["moving_shapes"](data, items).validate()
