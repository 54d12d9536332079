"""diffusers' own loading calls keep MHLA (issue 41, item 1): a saved MHLA transformer and a pipeline saved
with it load through ``DiffusionPipeline.from_pretrained``, the pipeline class's ``from_pretrained`` and
``AutoModel.from_pretrained(..., subfolder="transformer")`` exactly as ``load_transformer`` loads them; what
cannot carry MHLA fails loudly. Tiny DiT, SANA and Wan."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from diffusers import AutoModel, DiffusionPipeline, DiTPipeline, SanaPipeline, WanPipeline

from mhla_gen import MHLAConfig, install_mhla, load_transformer, mhla_parameters, uninstall_mhla
from mhla_gen.models import MHLADiTTransformer2DModel, MHLASanaTransformer2DModel, MHLAWanTransformer3DModel
from mhla_gen.pipelines.dit import load_dit_pipeline
from mhla_gen.pipelines.sana import load_sana_pipeline
from mhla_gen.pipelines.wan import load_wan_pipeline
from mhla_gen.testing import (
    dit_forward,
    sana_forward,
    tiny_dit,
    tiny_dit_pipeline,
    tiny_sana,
    tiny_sana_pipeline,
)
from mhla_gen.testing_wan import TEXT_DIM, tiny_wan_pipeline, tiny_wan_transformer

REPO = Path(__file__).resolve().parents[1]


@torch.no_grad()
def wan_forward(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 5, TEXT_DIM, generator=g)
    return model(x.to(model.dtype), torch.tensor([300, 700]), text.to(model.dtype)).sample


@dataclass(frozen=True)
class Base:
    factory: object
    forward: object
    cfg: MHLAConfig
    mhla_cls: type
    pipeline: object  # tiny pipeline factory
    pipeline_cls: type
    load_pipeline: object  # mhla_gen.pipelines loader


BASES = {
    "dit": Base(tiny_dit, dit_forward, MHLAConfig(blocks=(2, 2), layers=[1], gate=True),
                MHLADiTTransformer2DModel, tiny_dit_pipeline, DiTPipeline, load_dit_pipeline),
    "sana": Base(tiny_sana, sana_forward, MHLAConfig(blocks=(2, 2), cpe_kernel=3, gate=True),
                 MHLASanaTransformer2DModel, tiny_sana_pipeline, SanaPipeline, load_sana_pipeline),
    "wan": Base(tiny_wan_transformer, wan_forward, MHLAConfig(blocks=(1, 2, 2), layers=[0, 2], cpe_kernel=3),
                MHLAWanTransformer3DModel, tiny_wan_pipeline, WanPipeline, load_wan_pipeline),
}


def trained_like(base: Base):
    """A model with MHLA whose MHLA parameters are far from their init (a lost tensor shows)."""
    model = install_mhla(base.factory().eval(), base.cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.copy_(torch.rand(p.shape, generator=g) / 2)
    return model


@pytest.fixture(scope="module", params=list(BASES))
def saved(request, tmp_path_factory):
    """``(base, root, expected)``: ``root/stock`` a stock pipeline, ``root/final`` an MHLA transformer saved
    like a training run's ``final/``, ``root/pipeline`` the pipeline loaded by mhla_gen.pipelines with that
    transformer and saved with diffusers' ``save_pretrained``; expected = load_transformer(final)'s output."""
    base = BASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base.pipeline(transformer=base.factory()).save_pretrained(root / "stock")
    trained_like(base).save_pretrained(root / "final")
    pipe = base.load_pipeline(root / "stock", transformer_path=root / "final", torch_dtype=torch.float32)
    pipe.save_pretrained(root / "pipeline")
    return base, root, base.forward(load_transformer(root / "final"))


def test_diffusers_loaders_rebuild_the_mhla_model_exactly(saved):
    base, root, expected = saved
    index = json.loads((root / "pipeline" / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_gen.models", base.mhla_cls.__name__]
    config = json.loads((root / "final" / "config.json").read_text())
    assert config["_class_name"] == base.mhla_cls.__name__ and config["mhla"] == base.cfg.to_dict()
    loaders = {
        "DiffusionPipeline": lambda: DiffusionPipeline.from_pretrained(root / "pipeline").transformer,
        "pipeline class": lambda: base.pipeline_cls.from_pretrained(root / "pipeline").transformer,
        "AutoModel": lambda: AutoModel.from_pretrained(str(root / "pipeline"), subfolder="transformer"),
        "MHLA class": lambda: base.mhla_cls.from_pretrained(root / "final"),
    }
    for name, load in loaders.items():
        transformer = load()
        assert type(transformer) is base.mhla_cls and transformer.mhla_config == base.cfg, name
        assert torch.equal(base.forward(transformer), expected), name


def test_half_precision_loads_equal_diffusers_own(saved):
    """``torch_dtype=bfloat16``: diffusers keeps ``_keep_in_fp32_modules`` (Wan's time embedder, norms, rope)
    and non-persistent buffers in float32; ``load_transformer`` and the pipeline loaders cast the same way,
    so every tensor has the same dtype and the outputs are equal."""
    base, root, _ = saved
    ours = load_transformer(root / "final", torch_dtype=torch.bfloat16)
    pipe = base.load_pipeline(root / "stock", transformer_path=root / "final", torch_dtype=torch.bfloat16)
    theirs = DiffusionPipeline.from_pretrained(root / "pipeline", dtype=torch.bfloat16).transformer
    expected = {k: v.dtype for k, v in theirs.state_dict().items()}
    buffers = {k: v.dtype for k, v in theirs.named_buffers()}
    assert torch.bfloat16 in expected.values()
    for model in (ours, pipe.transformer):
        assert {k: v.dtype for k, v in model.state_dict().items()} == expected
        assert {k: v.dtype for k, v in model.named_buffers()} == buffers
        assert torch.equal(base.forward(model), base.forward(theirs))


def test_project_loaders_say_what_they_load(saved, caplog):
    base, root, _ = saved
    with caplog.at_level(logging.INFO, logger="mhla_gen"):
        load_transformer(root / "final")
        load_transformer(root / "stock" / "transformer")
    assert f"loaded {base.mhla_cls.__name__} from {root / 'final'}: MHLA {base.cfg.to_dict()}" in caplog.text
    stock = base.mhla_cls.stock_cls.__name__
    assert f"loaded {stock} from {root / 'stock' / 'transformer'}: stock attention (no MHLA)" in caplog.text


def test_lone_folder_automodel_fails_loudly_and_mhla_class_on_stock_folder_is_stock(saved):
    """A lone transformer folder names a class AutoModel looks up in diffusers: it raises, naming the class.
    An MHLA class asked to load a stock folder has no MHLA to install: it gives the stock model."""
    base, root, _ = saved
    with pytest.raises(ValueError, match=f"`diffusers` has no class `{base.mhla_cls.__name__}`"):
        AutoModel.from_pretrained(str(root / "final"))
    stock = base.mhla_cls.from_pretrained(root / "stock", subfolder="transformer")
    reference = base.mhla_cls.stock_cls.from_pretrained(root / "stock", subfolder="transformer")
    assert type(stock) is base.mhla_cls.stock_cls and "mhla" not in stock.config
    assert torch.equal(base.forward(stock), base.forward(reference))


@pytest.mark.parametrize("name", list(BASES))
def test_install_turns_the_model_into_its_mhla_class_and_uninstall_back(tmp_path, name):
    base = BASES[name]
    model = base.factory().eval()
    stock_cls, stock_out = type(model), base.forward(model)
    install_mhla(model, base.cfg)
    assert type(model) is base.mhla_cls and base.mhla_cls.stock_cls is stock_cls
    uninstall_mhla(model)
    assert type(model) is stock_cls and torch.equal(base.forward(model), stock_out)
    model.save_pretrained(tmp_path)  # stock folders stay stock
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == stock_cls.__name__ and "mhla" not in config
    assert type(AutoModel.from_pretrained(str(tmp_path))) is stock_cls


def test_pipeline_registered_before_an_in_place_install_needs_register_modules(tmp_path):
    """model_index.json records the class a pipeline was given: after install_mhla(pipe.transformer)
    re-register the transformer (docs/diffusers.md), then DiffusionPipeline loads it with MHLA."""
    base = BASES["dit"]
    pipe = base.pipeline()
    install_mhla(pipe.transformer, base.cfg)
    assert pipe.config.transformer == ("diffusers", "DiTTransformer2DModel")  # stale: diffusers' record
    pipe.register_modules(transformer=pipe.transformer)
    pipe.save_pretrained(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(tmp_path).transformer
    assert type(loaded) is base.mhla_cls and torch.equal(base.forward(loaded), base.forward(pipe.transformer))


def test_converter_output_loads_through_diffusers(tmp_path):
    """scripts/convert_wan_mhla.py's model (convert_wan_checkpoint) saves as an MHLA Wan folder."""
    from mhla_gen.convert_wan import convert_wan_checkpoint, diffusers_to_original

    model = trained_like(BASES["wan"])
    release_like = MHLAConfig.preset("wan-release", blocks=(1, 2, 2), layers=[0, 2])  # any config works
    uninstall_mhla(model)
    install_mhla(model, release_like)
    state = {k: v.clone() for k, v in diffusers_to_original(model.state_dict()).items()}
    converted = convert_wan_checkpoint(state, dict(model.config), mhla=release_like)
    assert converted.mhla_config == release_like
    converted.save_pretrained(tmp_path / "converted")
    tiny_wan_pipeline(transformer=converted).save_pretrained(tmp_path / "pipeline")
    expected = wan_forward(load_transformer(tmp_path / "converted"))
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "pipeline")
    assert torch.equal(wan_forward(pipe.transformer), expected)
    direct = MHLAWanTransformer3DModel.from_pretrained(tmp_path / "converted")
    assert torch.equal(wan_forward(direct), expected)


def test_diffusers_without_mhla_gen_imported_refuses_in_one_line(saved):
    """diffusers 0.42 imports no library a model_index.json names: without `import mhla_gen` the load stops
    with diffusers' message naming the module to import (never a stock model)."""
    base, root, _ = saved
    if base is not BASES["dit"]:
        pytest.skip("one base is enough for diffusers' import rule")
    folder = str(root / "pipeline")
    code = f"from diffusers import DiffusionPipeline; DiffusionPipeline.from_pretrained({folder!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode != 0
    assert "import mhla_gen.models before calling `from_pretrained`" in result.stderr


def test_every_supported_base_has_an_mhla_class():
    """A base record (mhla_gen/bases) needs its line in mhla_gen/models.py (mhla_model_class),
    else install_mhla leaves it stock-named and diffusers' loaders cannot rebuild its MHLA."""
    from mhla_gen.bases import BASES
    from mhla_gen.install import MHLA_MODEL_CLASSES

    classes = [base.transformer_class for base in BASES.values()]
    missing = [cls.__name__ for cls in classes if cls not in MHLA_MODEL_CLASSES]
    assert not missing, f"add `MHLA<Name> = mhla_model_class(<Name>)` to mhla_gen/models.py for {missing}"
    for stock, mhla in MHLA_MODEL_CLASSES.items():
        assert mhla.__module__ == "mhla_gen.models" and mhla.__name__ == f"MHLA{stock.__name__}"
        import mhla_gen.models

        assert getattr(mhla_gen.models, mhla.__name__) is mhla  # where model_index.json entries point


def test_sana_video_and_wan22_experts_load_with_mhla_through_diffusers(tmp_path):
    """The bases added beside DiT / SANA / Wan: SANA-Video (its own class) and Wan2.2 (two Wan experts,
    ``transformer`` and ``transformer_2``, each resolved from model_index.json)."""
    from mhla_gen.models import MHLASanaVideoTransformer3DModel
    from mhla_gen.testing_video import (
        tiny_sana_video,
        tiny_sana_video_pipeline,
        tiny_wan22_pipeline,
        tiny_wan_expert,
    )

    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 16, 3, 6, 10, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
                  timestep=torch.tensor([10.0, 700.0]))
    video = trained_like(Base(tiny_sana_video, None, MHLAConfig(blocks=(2, 2, 3), cpe_kernel=3), *[None] * 4))
    tiny_sana_video_pipeline(transformer=video).save_pretrained(tmp_path / "sana_video")
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "sana_video").transformer
    assert type(loaded) is MHLASanaVideoTransformer3DModel
    with torch.no_grad():
        assert torch.equal(loaded(**inputs, return_dict=False)[0], video(**inputs, return_dict=False)[0])

    wan = BASES["wan"]
    experts = [trained_like(Base(lambda s=s: tiny_wan_expert(seed=s), None, wan.cfg, *[None] * 4))
               for s in (0, 1)]
    tiny_wan22_pipeline(transformer=experts[0], transformer_2=experts[1]).save_pretrained(tmp_path / "wan22")
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "wan22")
    for loaded, expert in zip((pipe.transformer, pipe.transformer_2), experts):
        assert type(loaded) is MHLAWanTransformer3DModel
        assert torch.equal(wan_forward(loaded), wan_forward(expert))
