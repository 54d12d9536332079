"""diffusers' own loading calls keep MHLA (issue 41, item 1): a saved MHLA transformer and a pipeline saved
with it load through ``DiffusionPipeline.from_pretrained``, the pipeline class's ``from_pretrained`` and
``AutoModel.from_pretrained(..., subfolder="transformer")`` exactly as ``load_transformer`` loads them; what
cannot carry MHLA fails loudly (issue 54: a folder re-saved by the stock class, ``from_single_file``, a
pipeline after ``uninstall_mhla``). Every base record (``mhla_gen.bases``), tiny models."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers import AutoModel, DiffusionPipeline
from safetensors.torch import load_file, save_file

from mhla_gen import MHLAConfig, install_mhla, load_transformer, mhla_parameters, uninstall_mhla
from mhla_gen.bases import BASES as RECORDS
from mhla_gen.bases import Base as Record
from mhla_gen.integration.auto_model import AUTO_MODULE, AUTO_MODULE_FILE, AUTO_MODULE_SOURCE
from mhla_gen.integration.install import MHLA_MODEL_CLASSES
from mhla_gen.models import MHLAWanTransformer3DModel
from mhla_gen.testing.video import tiny_wan_expert
from mhla_gen.testing.wan import tiny_wan_pipeline

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Base:
    """A base record and what the loading tests build from its test reference (``record.tiny``): a tiny
    transformer, its forward, the test MHLA config (CPE / gate / some layers only, to catch lost
    parameters) and a tiny stock pipeline."""

    record: Record

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def tiny(self):
        return self.record.tiny.load()

    def factory(self, seed: int = 0):
        return self.tiny.model(seed=seed)

    @torch.no_grad()
    def forward(self, model, **inputs) -> torch.Tensor:
        return self.tiny.output(model, **inputs)

    @property
    def cfg(self) -> MHLAConfig:
        return self.tiny.mhla

    def pipeline(self, transformer=None):
        return self.tiny.pipeline(transformer=transformer)

    @property
    def mhla_cls(self) -> type:
        return MHLA_MODEL_CLASSES[self.record.transformer_class]

    @property
    def pipeline_cls(self) -> type:
        return getattr(diffusers, self.record.pipeline_class)

    def load_pipeline(self, path, transformer_path, torch_dtype=torch.float32):
        """The project's loader of this base's pipeline (its record's sampler)."""
        return self.record.sampler.load().load(str(path), None, torch_dtype, None, transformer_path)


BASES = {name: Base(record) for name, record in RECORDS.items()}  # every record, through its test reference
WAN = BASES[RECORDS["wan"].name]


def trained_like(base: Base, model=None):
    """A model with MHLA (``base``'s tiny model unless ``model``) whose MHLA parameters are far from their
    init (a lost tensor shows)."""
    model = install_mhla((model if model is not None else base.factory()).eval(), base.cfg)
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
    pipe = base.load_pipeline(root / "stock", transformer_path=root / "final")
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


def test_lone_folder_loads_with_automodel_as_custom_code(saved, caplog):
    """A lone MHLA folder (no model_index.json) names its class for diffusers' AutoModel as custom code:
    ``config.json["auto_map"]`` and the module file beside it, which imports the class from mhla_gen.
    Without ``trust_remote_code`` diffusers asks for it; with it, AutoModel gives the MHLA model exactly as
    load_transformer does. The entry is no init argument: no loader warns about it or keeps it."""
    base, root, expected = saved
    final = root / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": f"{AUTO_MODULE}.{base.mhla_cls.__name__}"}
    assert (final / AUTO_MODULE_FILE).read_text() == AUTO_MODULE_SOURCE
    assert (root / "pipeline" / "transformer" / AUTO_MODULE_FILE).is_file()
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModel.from_pretrained(str(final))
    diffusers_logger = logging.getLogger("diffusers")
    diffusers_logger.addHandler(caplog.handler)  # diffusers' loggers do not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="diffusers"):
            loaded = [AutoModel.from_pretrained(str(final), trust_remote_code=True),
                      base.mhla_cls.from_pretrained(final), load_transformer(final),
                      DiffusionPipeline.from_pretrained(root / "pipeline").transformer]
    finally:
        diffusers_logger.removeHandler(caplog.handler)
    assert "auto_map" not in caplog.text
    for transformer in loaded:
        assert type(transformer) is base.mhla_cls and "auto_map" not in transformer.config
        assert torch.equal(base.forward(transformer), expected)


def test_only_the_main_process_writes_the_automodel_module(tmp_path):
    """``is_main_process=False`` (a keyword or diffusers' second positional argument): no module file, as
    diffusers then writes no config either; none where ``save_directory`` is a file, which diffusers
    refuses (it logs an error and saves nothing)."""
    base = BASES["dit"]
    model = base.factory()
    install_mhla(model, base.cfg)
    model.save_pretrained(tmp_path / "keyword", is_main_process=False)
    model.save_pretrained(tmp_path / "positional", False)
    model.save_pretrained(tmp_path / "main")
    model.save_pretrained(tmp_path / "main")  # its own file again: replaced
    users = tmp_path / "users"  # a file of that name the user wrote: kept, nothing saved
    users.mkdir()
    (users / AUTO_MODULE_FILE).write_text("mine\n")
    with pytest.raises(FileExistsError, match="is not the module file"):
        model.save_pretrained(users)
    assert sorted(p.name for p in users.iterdir()) == [AUTO_MODULE_FILE]
    assert (users / AUTO_MODULE_FILE).read_text() == "mine\n"
    a_file = tmp_path / "a_file"  # diffusers logs that a save_directory which is a file is refused
    a_file.write_text("kept\n")
    model.save_pretrained(a_file)
    assert a_file.read_text() == "kept\n"
    assert not (tmp_path / "keyword" / AUTO_MODULE_FILE).exists()
    assert not (tmp_path / "positional" / AUTO_MODULE_FILE).exists()
    assert (tmp_path / "main" / AUTO_MODULE_FILE).is_file()


def test_mhla_class_on_a_stock_folder_is_stock(saved):
    """An MHLA class asked to load a stock folder has no MHLA to install: it gives the stock model."""
    base, root, _ = saved
    stock = base.mhla_cls.from_pretrained(root / "stock", subfolder="transformer")
    reference = base.mhla_cls.stock_cls.from_pretrained(root / "stock", subfolder="transformer")
    assert type(stock) is base.mhla_cls.stock_cls and "mhla" not in stock.config
    assert torch.equal(base.forward(stock), base.forward(reference))
    assert not (root / "stock" / "transformer" / AUTO_MODULE_FILE).exists()


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
    assert config["_class_name"] == stock_cls.__name__ and "mhla" not in config and "auto_map" not in config
    assert type(AutoModel.from_pretrained(str(tmp_path))) is stock_cls


@pytest.mark.parametrize("name", list(BASES))
def test_pipeline_registered_before_an_in_place_install_saves_the_mhla_class(name, tmp_path):
    """diffusers records a component's class when it is registered, so after an in-place
    install_mhla(pipe.transformer) the pipeline's record is stale; its save_pretrained (which calls the MHLA
    model's) writes the MHLA class anyway, and DiffusionPipeline loads the folder with MHLA, not stock."""
    base = BASES[name]
    pipe = base.pipeline()
    install_mhla(pipe.transformer.eval(), base.cfg)  # eval: DiT's label dropout draws in train mode
    assert pipe.config.transformer == ("diffusers", base.record.class_name)  # stale: diffusers' record
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_gen.models", base.mhla_cls.__name__]
    loaded = DiffusionPipeline.from_pretrained(tmp_path).transformer
    assert type(loaded) is base.mhla_cls and torch.equal(base.forward(loaded), base.forward(pipe.transformer))
    pipe.transformer.save_pretrained(tmp_path / "alone")  # no pipeline saving: nothing to follow


def test_compiled_pipeline_component_saves_and_uninstalls_with_its_class(tmp_path):
    """``pipe.transformer = torch.compile(pipe.transformer)`` before an in-place install on its ``_orig_mod``
    (install_mhla refuses the wrapper itself): the pipeline's save still names the MHLA class (diffusers
    records the unwrapped class), the wrapper stays in the pipeline, and uninstall_mhla on the model
    names the stock class again."""
    base = BASES["dit"]
    pipe = base.pipeline()
    pipe.transformer = torch.compile(pipe.transformer.eval())
    model = pipe.transformer._orig_mod
    install_mhla(model, base.cfg)
    pipe.save_pretrained(tmp_path / "mhla")
    index = json.loads((tmp_path / "mhla" / "model_index.json").read_text())
    assert index["transformer"] == ["mhla_gen.models", base.mhla_cls.__name__]
    assert pipe.transformer._orig_mod is model  # the compiled wrapper is what the pipeline still holds
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "mhla").transformer
    assert type(loaded) is base.mhla_cls and torch.equal(base.forward(loaded), base.forward(model))
    uninstall_mhla(model)
    assert pipe.config.transformer == ("diffusers", base.record.transformer_class.__name__)
    assert pipe.transformer._orig_mod is model


def test_wan22_experts_installed_in_place_save_with_their_class(tmp_path):
    """Wan2.2 built with stock experts, MHLA installed in place on both, saved through a pipeline subclass
    whose save_pretrained wraps diffusers' (a user's own): model_index.json names the MHLA class for
    ``transformer`` and ``transformer_2``."""
    from mhla_gen.testing.video import tiny_wan22_pipeline

    pipe = tiny_wan22_pipeline(transformer=tiny_wan_expert(seed=0), transformer_2=tiny_wan_expert(seed=1))

    class UsersPipeline(type(pipe)):
        def save_pretrained(self, folder, **kwargs):
            return super().save_pretrained(folder, **kwargs)

    pipe.__class__ = UsersPipeline
    for expert in (pipe.transformer, pipe.transformer_2):
        install_mhla(expert, WAN.cfg)
    pipe.save_pretrained(tmp_path / "wan22")
    index = json.loads((tmp_path / "wan22" / "model_index.json").read_text())
    assert index["transformer"] == index["transformer_2"] == ["mhla_gen.models", "MHLAWanTransformer3DModel"]


def test_converter_output_loads_through_diffusers(tmp_path):
    """scripts/convert_wan_mhla.py's model (convert_wan_checkpoint) saves as an MHLA Wan folder."""
    from mhla_gen.integration.convert_wan import convert_wan_checkpoint, diffusers_to_original

    model = trained_like(WAN)
    release_like = MHLAConfig.preset("wan-release", blocks=(1, 2, 2), layers=[0, 2])  # any config works
    uninstall_mhla(model)
    install_mhla(model, release_like)
    state = {k: v.clone() for k, v in diffusers_to_original(model.state_dict()).items()}
    converted = convert_wan_checkpoint(state, dict(model.config), mhla=release_like)
    assert converted.mhla_config == release_like
    converted.save_pretrained(tmp_path / "converted")
    tiny_wan_pipeline(transformer=converted).save_pretrained(tmp_path / "pipeline")
    expected = WAN.forward(load_transformer(tmp_path / "converted"))
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "pipeline")
    assert torch.equal(WAN.forward(pipe.transformer), expected)
    direct = MHLAWanTransformer3DModel.from_pretrained(tmp_path / "converted")
    assert torch.equal(WAN.forward(direct), expected)


def test_diffusers_without_mhla_gen_imported_refuses_in_one_line(saved):
    """diffusers 0.42 imports no library a model_index.json names: without `import mhla_gen` the load stops
    with diffusers' message naming the module to import (never a stock model)."""
    base, root, _ = saved
    if base is not next(iter(BASES.values())):
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
    from mhla_gen.integration.install import MHLA_MODEL_CLASSES

    classes = [base.transformer_class for base in BASES.values()]
    missing = [cls.__name__ for cls in classes if cls not in MHLA_MODEL_CLASSES]
    assert not missing, f"add `MHLA<Name> = mhla_model_class(<Name>)` to mhla_gen/models.py for {missing}"
    for stock, mhla in MHLA_MODEL_CLASSES.items():
        assert mhla.__module__ == "mhla_gen.models" and mhla.__name__ == f"MHLA{stock.__name__}"
        import mhla_gen.models

        assert getattr(mhla_gen.models, mhla.__name__) is mhla  # where model_index.json entries point


def test_wan22_experts_load_with_mhla_through_diffusers(tmp_path):
    """Wan2.2: two Wan experts, ``transformer`` and ``transformer_2``, each resolved from model_index.json
    (SANA-Video and Wan I2V are base records: the tests above run them)."""
    from mhla_gen.testing.video import tiny_wan22_pipeline

    experts = [trained_like(WAN, tiny_wan_expert(seed=s)) for s in (0, 1)]
    tiny_wan22_pipeline(transformer=experts[0], transformer_2=experts[1]).save_pretrained(tmp_path / "wan22")
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "wan22")
    for loaded, expert in zip((pipe.transformer, pipe.transformer_2), experts):
        assert type(loaded) is MHLAWanTransformer3DModel
        assert torch.equal(WAN.forward(loaded), WAN.forward(expert))


def _resaved_by_stock_class(base: Base, root: Path, out: Path) -> Path:
    """``out/transformer``: ``root/final`` loaded and saved again by the stock class; ``out/pipeline``:
    ``root/pipeline`` (model_index.json naming the MHLA class) with that folder as its transformer."""
    stock_cls = base.record.transformer_class
    stock = stock_cls.from_pretrained(root / "final")  # diffusers: stock attention, MHLA weights unused
    assert type(stock) is stock_cls and not list(mhla_parameters(stock)) and "mhla" in stock.config
    assert torch.equal(base.forward(stock), base.forward(base.factory()))  # trained_like moved MHLA only
    stock.save_pretrained(out / "transformer")  # diffusers' stock save: succeeds, keeps the "mhla" entry
    config = json.loads((out / "transformer" / "config.json").read_text())
    assert config["_class_name"] == stock_cls.__name__ and config["mhla"] == base.cfg.to_dict()
    shutil.copytree(root / "pipeline", out / "pipeline")
    shutil.rmtree(out / "pipeline" / "transformer")
    shutil.copytree(out / "transformer", out / "pipeline" / "transformer")
    return out


def test_folder_resaved_by_the_stock_class_is_refused_by_every_mhla_loader(saved, tmp_path):
    """A stock class's from_pretrained / save_pretrained round trip writes a config claiming MHLA and no MHLA
    weights: every loader that would build MHLA from it stops in one line saying so (no meta tensors)."""
    base, root, _ = saved
    out = _resaved_by_stock_class(base, root, tmp_path)
    stock_name = base.record.transformer_class.__name__
    loaders = {
        "load_transformer": lambda: load_transformer(out / "transformer"),
        "MHLA class": lambda: base.mhla_cls.from_pretrained(out / "transformer"),
        "AutoModel": lambda: AutoModel.from_pretrained(str(out / "pipeline"), subfolder="transformer"),
        "DiffusionPipeline": lambda: DiffusionPipeline.from_pretrained(out / "pipeline"),
        "pipeline class": lambda: base.pipeline_cls.from_pretrained(out / "pipeline"),
        "mhla_gen pipeline loader": lambda: base.load_pipeline(root / "stock", out / "transformer"),
    }
    refusal = f"weights hold none of its .* saved by the stock {stock_name}"
    for name, load in loaders.items():
        with pytest.raises(ValueError, match=refusal) as e:
            load()
        assert "\n" not in str(e.value), name
    # the way out it names: the stock model it holds
    stock = base.record.transformer_class.from_pretrained(out / "transformer")
    assert torch.equal(base.forward(stock), base.forward(base.factory()))


def test_mhla_class_names_missing_mhla_weights(saved, tmp_path):
    """Some MHLA weights gone (a damaged folder): named, not left on the meta device."""
    base, root, _ = saved
    shutil.copytree(root / "final", tmp_path / "damaged")
    weights = tmp_path / "damaged" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    lost = sorted(k for k in state if ".processor." in k)[-1]
    save_file({k: v for k, v in state.items() if k != lost}, weights)
    for load in (base.mhla_cls.from_pretrained, load_transformer):
        with pytest.raises(ValueError, match=re.escape(lost)):
            load(tmp_path / "damaged")


def _release_like(base: Base):
    """A model of ``base`` with the wan-release preset on layers 1-2, perturbed: the release's keys."""
    from mhla_gen.integration.install import mhla_processors

    model = base.factory()
    install_mhla(model, MHLAConfig.preset("wan-release", layers=[1, 2]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for proc in mhla_processors(model).values():
            proc.mixing.weight.copy_(torch.rand(proc.mixing.weight.shape, generator=g) / 50)
            proc.head_norm.weight.copy_(1 + torch.randn(proc.head_norm.weight.shape, generator=g) / 4)
    return model


def test_from_single_file_converts_a_release_checkpoint_or_refuses(saved, tmp_path):
    """``from_single_file`` of the MHLA classes (those with diffusers' FromOriginalModelMixin): a checkpoint
    of the release (Wan, T2V and I2V) loads through the converter, exactly; MHLA parameters it cannot place
    are refused in one line; a stock file gives the stock model, as diffusers' own call does."""
    from mhla_gen.integration.convert_wan import diffusers_to_original

    base, root, _ = saved
    if "single_file" not in base.record.capabilities:  # DiT: diffusers has no single-file loader
        with pytest.raises(AttributeError, match="from_single_file"):
            base.mhla_cls.from_single_file(str(tmp_path / "any.safetensors"))
        return
    where = dict(config=str(root / "stock"), subfolder="transformer")
    if base.record.release_checkpoint is not None:
        release = _release_like(base)
        file = tmp_path / "release.safetensors"
        save_file({f"model.diffusion_model.{k}": v.clone() for k, v in
                   diffusers_to_original(release.state_dict()).items()}, file)  # ComfyUI-style prefix
        loaded = base.mhla_cls.from_single_file(str(file), **where)
        assert type(loaded) is base.mhla_cls and loaded.mhla_config == release.mhla_config
        reference = release.state_dict()
        assert all(torch.equal(v, reference[k]) for k, v in loaded.state_dict().items())
        latent = (3, 10, 20)  # grid (3, 5, 10): the release's blocks
        assert torch.equal(base.forward(loaded, latent=latent), base.forward(release, latent=latent))
        half = base.mhla_cls.from_single_file(str(file), dtype=torch.bfloat16, **where)
        assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
        # diffusers' stock class on the same file: the stock model (documented; MHLA keys unused)
        assert type(base.record.transformer_class.from_single_file(str(file), **where)) is \
            base.record.transformer_class
    mhla_state = {k: v.clone() for k, v in trained_like(base).state_dict().items()}  # diffusers layout
    with pytest.raises(ValueError, match=r"holds MHLA parameters .* save_pretrained .* from_pretrained"):
        base.mhla_cls.from_single_file(mhla_state, **where)
    stock_state = {k: v.clone() for k, v in base.factory().state_dict().items()}
    try:
        expected = base.record.transformer_class.from_single_file(dict(stock_state), **where)
    except ValueError as refused:  # SANA-Video: diffusers 0.42 has no single-file mapping for its class
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            base.mhla_cls.from_single_file(stock_state, **where)
        return
    stock = base.mhla_cls.from_single_file(stock_state, **where)
    assert type(stock) is base.record.transformer_class
    assert torch.equal(base.forward(stock), base.forward(expected))


def test_uninstall_makes_a_pipeline_save_as_stock(saved, tmp_path):
    """``uninstall_mhla(pipe.transformer)``: the pipeline records diffusers' class again, so it saves and
    loads as the stock pipeline (no mhla_gen needed)."""
    base, root, _ = saved
    pipe = DiffusionPipeline.from_pretrained(root / "pipeline")
    assert pipe.config.transformer == ("mhla_gen.models", base.mhla_cls.__name__)
    uninstall_mhla(pipe.transformer)
    stock_name = base.record.transformer_class.__name__
    assert pipe.config.transformer == ("diffusers", stock_name)
    pipe.save_pretrained(tmp_path / "stock_again")
    assert json.loads((tmp_path / "stock_again" / "model_index.json").read_text())["transformer"] == [
        "diffusers", stock_name]
    loaded = DiffusionPipeline.from_pretrained(tmp_path / "stock_again").transformer
    assert type(loaded) is base.record.transformer_class
    assert torch.equal(base.forward(loaded), base.forward(pipe.transformer))
