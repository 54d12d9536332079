"""DiT: class-conditional image diffusion (diffusers ``DiTTransformer2DModel`` + ``DiTPipeline``)."""

from ..processors.dit import DiTMHLAProcessor
from .record import Base, Ref, TokenGrid

BASE = Base(
    name="dit",
    processor=DiTMHLAProcessor,
    pipeline_class="DiTPipeline",
    grid=TokenGrid(ndim=2),
    conditioning="labels",
    objective=Ref("mhla_gen.train.objectives:DDPM"),
    data_sources=("folder", "latents", "digits", "shapes", "teacher", "hf"),
    run_config=Ref("mhla_gen.train.config:DiTRunConfig"),
    task=Ref("mhla_gen.train.dit:DiTTask"),
    sampler=Ref("mhla_gen.pipelines.dit:DiTSampler"),
    tiny=Ref("mhla_gen.testing:TINY_DIT"),
    converter_config="linearize/dit_xl2_256",
    diffusers_tests="tests/models/transformers/test_models_dit_transformer2d.py",
    diffusers_pipeline_tests=(
        "tests/pipelines/dit/test_dit.py",
    ),
)
