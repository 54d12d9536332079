"""Wan image-to-video (diffusers ``WanTransformer3DModel`` + ``WanImageToVideoPipeline``): Wan2.1 I2V-14B
(CLIP image features in the cross-attention: ``image_dim``, ``added_kv_proj_dim``) and Wan2.2 I2V-A14B (two
experts, no CLIP). Both take 36 input channels: 16 noise + 16 latents of the image-padded video + 4 mask.

MHLA replaces the video self-attention ``attn1`` only (the Wan processor); ``attn2`` with the image K/V stays
stock. Fine-tuning and stage-1 conversion condition on each training video's first frame
(``train/finetune_wan_i2v.py``); no teacher data (it would need an image per prompt).
Wan2.2 TI2V-5B (48 channels in and out) reads as the ``wan`` record: one transformer serves both its text and
its image pipeline, and its ``config.json`` cannot tell them apart.
"""

from dataclasses import dataclass

from ..processors.wan import WanMHLAProcessor
from .record import Base, Ref, TokenGrid

MASK_CHANNELS = 4  # WanImageToVideoPipeline: the first-frame mask, one channel per VAE temporal step


@dataclass(frozen=True)
class WanI2VBase(Base):
    def matches(self, config: dict) -> bool:
        """Wan2.1 I2V: ``image_dim`` set; Wan2.2 I2V-A14B: ``in_channels = 2 * out_channels + 4`` (noise,
        condition latents, mask) without CLIP features. T2V and TI2V-5B: ``in_channels == out_channels``."""
        if config.get("image_dim") is not None:
            return True
        in_channels = config.get("in_channels")
        out_channels = config.get("out_channels") or in_channels
        return in_channels is not None and in_channels == 2 * out_channels + MASK_CHANNELS


BASE = WanI2VBase(
    name="wan-i2v",
    processor=WanMHLAProcessor,  # the same self-attention as Wan2.1 T2V
    pipeline_class="WanImageToVideoPipeline",
    grid=TokenGrid(ndim=3, rope="3d rope: before_phi (default) | after_phi_numerator (mhla.wan_rope)"),
    conditioning="captions+image",
    objective=Ref("mhla_gen.train.objectives:FlowMatching"),
    data_sources=("folder", "hf", "shards"),
    run_config=Ref("mhla_gen.train.config:WanRunConfig"),
    task=Ref("mhla_gen.train.finetune_wan_i2v:WanI2VTask"),
    sampler=Ref("mhla_gen.pipelines.wan:WanI2VSampler"),
    tiny=Ref("mhla_gen.testing.video:TINY_WAN_I2V"),
    release_checkpoint=Ref("mhla_gen.integration.convert_wan:release_checkpoint_model"),
    converter_config="linearize/wan-i2v_14b_480p",
    text_dim="text_dim",
    # written into the diffusers checkout by scripts/diffusers_model_tests.py from diffusers' Wan suite
    diffusers_tests="tests/models/transformers/test_mhla_wan_i2v.py",
    diffusers_pipeline_tests=(
        "tests/pipelines/wan/test_wan_image_to_video.py",
        "tests/pipelines/wan/test_wan_22_image_to_video.py",
    ),
)
