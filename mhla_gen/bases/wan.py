"""Wan2.1 text-to-video (diffusers ``WanTransformer3DModel`` + ``WanPipeline``): 3D tokens, 3D RoPE."""

from ..processors.wan import WanMHLAProcessor
from .record import Base, Ref, TokenGrid

BASE = Base(
    name="wan",
    processor=WanMHLAProcessor,
    pipeline_class="WanPipeline",
    grid=TokenGrid(ndim=3, rope="3d rope: before_phi (default) | after_phi_numerator (mhla.wan_rope)"),
    conditioning="captions",
    objective=Ref("mhla_gen.train.objectives:FlowMatching"),
    data_sources=("folder", "teacher", "hf", "shards", "moving_shapes"),
    run_config=Ref("mhla_gen.train.config:WanRunConfig"),
    task=Ref("mhla_gen.train.finetune:WanTask"),
    sampler=Ref("mhla_gen.pipelines.wan:WanSampler"),
    tiny=Ref("mhla_gen.testing.wan:TINY_WAN"),
    release_checkpoint=Ref("mhla_gen.integration.convert_wan:release_checkpoint_model"),
    stream_sampler=Ref("mhla_gen.pipelines.wan_stream:WanStreamSampler"),
    converter_config="linearize/wan_1_3b_480p",
    text_dim="text_dim",
    diffusers_tests="tests/models/transformers/test_models_transformer_wan.py",
    diffusers_pipeline_tests=(
        "tests/pipelines/wan/test_wan.py",
        "tests/pipelines/wan/test_wan_22.py",
    ),
)
