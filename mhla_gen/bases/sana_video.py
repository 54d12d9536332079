"""SANA-Video: text-to-video with linear attention and 3D RoPE (diffusers ``SanaVideoTransformer3DModel`` +
``SanaVideoPipeline``). Uniform mixing with eps 1e-15 / M starts exactly at the checkpoint."""

from ..processors.sana_video import SanaVideoMHLAProcessor
from .record import Base, Ref, TokenGrid

BASE = Base(
    name="sana-video",
    processor=SanaVideoMHLAProcessor,
    pipeline_class="SanaVideoPipeline",
    grid=TokenGrid(ndim=3, rope="3d rope after phi, on the numerator only (fixed, as SANA-Video)"),
    conditioning="captions",
    objective=Ref("mhla_gen.train.objectives:FlowMatching"),
    data_sources=("folder", "teacher"),
    run_config=Ref("mhla_gen.train.finetune_sana_video:SanaVideoRunConfig"),
    task=Ref("mhla_gen.train.finetune_sana_video:SanaVideoTask"),
    sampler=Ref("mhla_gen.pipelines.sana_video:SanaVideoSampler"),
    tiny=Ref("mhla_gen.testing.video:TINY_SANA_VIDEO"),
    converter_config="linearize/sana-video_2b_480p",
    text_dim="caption_channels",
    diffusers_tests="tests/models/transformers/test_models_transformer_sana_video.py",
    diffusers_pipeline_tests=(
        "tests/pipelines/sana_video/test_sana_video.py",
        "tests/pipelines/sana_video/test_sana_video_i2v.py",
    ),
)
