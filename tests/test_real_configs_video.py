"""The full-size Wan2.1 / SANA-Video / Wan2.2 / Wan I2V architectures on the meta device (no weights, no
compute): MHLA installs and a forward at their real 480p / 720p token grids runs through every MHLA layer."""

from __future__ import annotations

import pytest
import torch

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.integration.install import mhla_processors
from mhla_gen.testing.video import REAL_CONFIGS

META = torch.device("meta")
BLOCKS = (3, 5, 10)  # the paper's Wan2.1 480p layout; any resolution works with a fixed layout
HYBRID = [i for i in range(40) if i % 3 != 0]  # the release's pattern: every third layer keeps softmax

# name -> (latent (C, F, H, W) of the real resolution, its token grid, billions of parameters (range))
CASES = {
    # 480x832, 81 frames; Wan VAE; the architecture of benchmarks/bench_wan_step.py
    "Wan2.1-T2V-1.3B": ((16, 21, 60, 104), (21, 30, 52), (1.40, 1.44)),
    # 720x1280, 81 frames; Wan VAE 8x spatial, 4x temporal; patch (1, 2, 2)
    "Wan2.2-T2V-A14B": ((16, 21, 90, 160), (21, 45, 80), (14.2, 14.4)),
    # 704x1280, 121 frames; Wan2.2 VAE 16x spatial, 48 channels
    "Wan2.2-TI2V-5B": ((48, 31, 44, 80), (31, 22, 40), (4.9, 5.1)),
    # 480x832, 81 frames; 36 channels = 16 noise + 16 image latent + 4 mask
    "Wan2.1-I2V-14B-480P": ((36, 21, 60, 104), (21, 30, 52), (16.3, 16.5)),
    # 720x1280, 81 frames; 36 channels as Wan2.1 I2V, no CLIP image features
    "Wan2.2-I2V-A14B": ((36, 21, 90, 160), (21, 45, 80), (14.2, 14.4)),
    # 480x832, 81 frames; Wan VAE
    "SANA-Video-2B-480p": ((16, 21, 60, 104), (21, 30, 52), (2.0, 2.1)),
}


def _conditioning(name: str, cfg: dict) -> dict:
    """The forward's conditioning at the real sizes (UMT5 512 x 4096 for Wan, Gemma2 300 x 2304 for SANA)."""
    if name.startswith("SANA"):
        return dict(
            encoder_hidden_states=torch.empty(1, 300, cfg["caption_channels"], device=META),
            timestep=torch.tensor([500.0], device=META),
        )
    extra = {}
    if "image_dim" in cfg:  # CLIP ViT-H/14: 257 tokens of width 1280
        extra["encoder_hidden_states_image"] = torch.empty(1, 257, cfg["image_dim"], device=META)
    return dict(
        encoder_hidden_states=torch.empty(1, 512, cfg["text_dim"], device=META),
        timestep=torch.tensor([500], device=META),
        **extra,
    )


def _forward_on_meta(name: str, mhla: MHLAConfig, used_grids) -> torch.nn.Module:
    cls, cfg = REAL_CONFIGS[name]
    latent_shape, grid, billions = CASES[name]
    with META:
        model = cls(**cfg)
    assert billions[0] < sum(p.numel() for p in model.parameters()) / 1e9 < billions[1]
    install_mhla(model, mhla)
    latent = torch.empty(1, *latent_shape, device=META)
    used_grids.clear()
    with torch.no_grad():
        out = model(hidden_states=latent, **_conditioning(name, cfg)).sample
    assert out.shape == (1, cfg["out_channels"], *latent_shape[1:]) and out.device == META
    assert set(used_grids) == {grid} and len(used_grids) == len(mhla_processors(model))
    return model


@pytest.mark.parametrize(
    "name",
    ["Wan2.1-T2V-1.3B", "Wan2.2-TI2V-5B", "Wan2.1-I2V-14B-480P", "Wan2.2-I2V-A14B", "SANA-Video-2B-480p"],
)
def test_real_config_forward_on_meta(name, used_grids):
    model = _forward_on_meta(name, MHLAConfig(blocks=BLOCKS), used_grids)
    assert len(mhla_processors(model)) == REAL_CONFIGS[name][1]["num_layers"]
    if name.startswith("Wan"):  # the image / text cross-attention stays stock
        assert not any("attn2" in key for key in mhla_processors(model))


RECORDS = {  # the base record each full-size config reads as (mhla_gen.bases: first match wins)
    "Wan2.1-T2V-1.3B": "wan",
    "Wan2.2-T2V-A14B": "wan",
    "Wan2.2-TI2V-5B": "wan",  # one transformer for its text and image pipelines
    "Wan2.1-I2V-14B-480P": "wan-i2v",
    "Wan2.2-I2V-A14B": "wan-i2v",
    "SANA-Video-2B-480p": "sana-video",
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_real_config_reads_as_its_base_record(name):
    from mhla_gen.bases import base_for_class_name, base_for_model

    cls, cfg = REAL_CONFIGS[name]
    assert base_for_class_name(cls.__name__, cfg).name == RECORDS[name]
    with META:
        assert base_for_model(cls(**cfg)).name == RECORDS[name]


def test_a14b_experts_each_with_their_own_hybrid_layers_on_meta(used_grids):
    """Wan2.2-T2V-A14B: the high-noise expert with the release's hybrid pattern, the low-noise one all
    MHLA, each run at 720p."""
    high = _forward_on_meta("Wan2.2-T2V-A14B", MHLAConfig(blocks=BLOCKS, layers=HYBRID), used_grids)
    low = _forward_on_meta("Wan2.2-T2V-A14B", MHLAConfig(blocks=BLOCKS), used_grids)
    assert (len(mhla_processors(high)), len(mhla_processors(low))) == (26, 40)
