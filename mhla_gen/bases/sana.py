"""SANA: text-to-image with linear attention (diffusers ``SanaTransformer2DModel`` + ``SanaPipeline``)."""

from ..processors.sana import SanaMHLAProcessor
from .record import Base, Ref, TokenGrid

BASE = Base(
    name="sana",
    processor=SanaMHLAProcessor,
    pipeline_class="SanaPipeline",
    grid=TokenGrid(ndim=2),
    conditioning="captions",
    objective=Ref("mhla_gen.train.objectives:FlowMatching"),
    data_sources=("folder", "teacher", "hf", "shards"),
    run_config=Ref("mhla_gen.train.config:SanaRunConfig"),
    task=Ref("mhla_gen.train.finetune:SanaTask"),
    sampler=Ref("mhla_gen.pipelines.sana:SanaSampler"),
    tiny=Ref("mhla_gen.testing:TINY_SANA"),
    converter_config="linearize/sana_600m_1024",
    text_dim="caption_channels",
    diffusers_tests="tests/models/transformers/test_models_transformer_sana.py",
    diffusers_pipeline_tests=(
        "tests/pipelines/sana/test_sana.py",
    ),
)
