"""Processors changed by diffusers' own calls keep the MHLA record true (issue 54, item 5).

``set_attn_processor`` (the bases whose diffusers class has it: SANA, SANA-Video, Wan, Wan I2V) sets what it
is given, MHLA layers included, as in diffusers: the layers it replaces leave MHLA, ``mhla_config`` /
``config["mhla"]`` name the rest (none left: the stock model), a saved folder says exactly that and loads back
the same model, and a dict of the wrong size gets diffusers' own ValueError. A processor swapped behind
``install_mhla``'s back with the per-module ``attn.set_processor`` makes ``save_pretrained`` refuse.
Tiny models of every base record (``test_diffusers_loading.BASES``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.models.attention_processor import AttnProcessor
from test_diffusers_loading import BASES, trained_like

from mhla_gen import load_transformer, uninstall_mhla
from mhla_gen.bases import base_for_model
from mhla_gen.processors import MHLAProcessor

WITH_SET_ATTN_PROCESSOR = [
    name for name, base in BASES.items() if hasattr(base.record.transformer_class, "set_attn_processor")
]


def _mhla_keys(model) -> list[str]:
    return [k for k, p in model.attn_processors.items() if isinstance(p, MHLAProcessor)]


def _stock_for_mhla(model) -> dict:
    """The processors with a fresh stock one in place of every MHLA processor."""
    stock = base_for_model(model).processor.stock_processor
    return {k: stock() if isinstance(p, MHLAProcessor) else p for k, p in model.attn_processors.items()}


@pytest.mark.parametrize("name", WITH_SET_ATTN_PROCESSOR)
def test_replaced_layers_leave_mhla_and_the_saved_folder_says_so(tmp_path, name):
    base = BASES[name]
    model = trained_like(base)
    stock = base_for_model(model).processor.stock_processor
    first, *rest = _mhla_keys(model)
    layers = base_for_model(model).processor.self_attention(model)
    index = next(i for i, attn in enumerate(layers) if attn.processor is model.attn_processors[first])
    model.set_attn_processor({**model.attn_processors, first: stock()})  # diffusers' dict call

    kept = [i for i, attn in enumerate(layers) if isinstance(attn.processor, MHLAProcessor)]
    assert index not in kept and len(kept) == len(rest) and type(model) is base.mhla_cls
    switch = "set_use_memory_efficient_attention_xformers"  # diffusers' switches reach it again
    assert [i for i, attn in enumerate(layers) if switch in attn.__dict__] == kept
    assert model.mhla_config.layers == kept and model.config["mhla"]["layers"] == kept
    assert model.mhla_config == dataclasses.replace(base.cfg, layers=kept)
    expected = base.forward(model)
    model.save_pretrained(tmp_path / "some")
    for loaded in (load_transformer(tmp_path / "some"), base.mhla_cls.from_pretrained(tmp_path / "some")):
        assert loaded.mhla_config == model.mhla_config
        assert torch.equal(base.forward(loaded), expected)

    model.set_attn_processor(_stock_for_mhla(model))  # every MHLA layer: none left, the stock model
    assert type(model) is base.record.transformer_class
    assert "mhla" not in model.config and getattr(model, "mhla_config", None) is None
    expected = base.forward(model)
    assert torch.equal(expected, base.forward(base.factory()))  # trained_like moved MHLA parameters only
    model.save_pretrained(tmp_path / "none")
    config = json.loads((tmp_path / "none" / "config.json").read_text())
    assert config["_class_name"] == base.record.transformer_class.__name__ and "mhla" not in config
    loaded = load_transformer(tmp_path / "none")
    assert type(loaded) is base.record.transformer_class and torch.equal(base.forward(loaded), expected)


@pytest.mark.parametrize("name", WITH_SET_ATTN_PROCESSOR)
def test_diffusers_own_processor_calls_and_errors(name):
    """What diffusers' AttentionTesterMixin does: a dict of new processors is set (the model leaves MHLA), and
    a dict of the wrong size raises diffusers' own ValueError, before anything changes."""
    base = BASES[name]
    model = trained_like(base)
    before, processors = base.forward(model), model.attn_processors
    with pytest.raises(ValueError, match="does not match the number of attention layers"):
        model.set_attn_processor({next(iter(processors)): AttnProcessor()})
    assert model.attn_processors == processors and torch.equal(base.forward(model), before)

    model.set_attn_processor({key: AttnProcessor() for key in processors})
    assert all(type(p) is AttnProcessor for p in model.attn_processors.values())
    assert type(model) is base.record.transformer_class and "mhla" not in model.config


@pytest.mark.parametrize("name", WITH_SET_ATTN_PROCESSOR)
def test_mhla_processor_where_it_cannot_run_is_refused_untouched(name):
    base = BASES[name]
    model = trained_like(base)
    before, config, installed = base.forward(model), dict(model.config), model.attn_processors
    mhla_key = _mhla_keys(model)[0]
    mhla, attn = installed[mhla_key], model.get_submodule(mhla_key.removesuffix(".processor"))
    cross = next(k for k in installed if ".attn2." in k)
    second = next(k for k in installed if ".attn1." in k and k != mhla_key)  # another self-attention
    other_cfg = dataclasses.replace(base.cfg, blocks=(1,) * len(base.cfg.blocks))
    cases = {
        "in cross-attention": ({**installed, cross: type(mhla).for_layer(attn, base.cfg)}, "cannot run"),
        "another config": ({**installed, mhla_key: type(mhla).for_layer(attn, other_cfg)}, "config differs"),
        "in two layers": ({**installed, second: mhla}, "the processor of .* again"),
    }
    for what, (processors, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            model.set_attn_processor(processors)
        assert model.attn_processors == installed, what
    assert torch.equal(base.forward(model), before) and dict(model.config) == config


@pytest.mark.parametrize("name", list(BASES))
def test_save_refuses_processors_replaced_behind_install_mhla(tmp_path, name):
    base = BASES[name]
    model = trained_like(base)
    layers = base_for_model(model).processor.self_attention(model)
    index = base.cfg.layers[0] if base.cfg.layers else 0
    stock = base_for_model(model).processor.stock_processor()
    layers[index].set_processor(stock)  # diffusers' per-module call
    with pytest.raises(ValueError, match=rf"layers \[{index}\] .*mhla_gen.uninstall_mhla\(transformer\)"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    uninstall_mhla(model)
    model.save_pretrained(tmp_path / "out")  # consistent again: a stock folder
    assert "mhla" not in json.loads((tmp_path / "out" / "config.json").read_text())


def test_set_attn_processor_in_a_pipeline_leaving_mhla_saves_a_stock_pipeline(tmp_path):
    """Every layer replaced through diffusers: the pipeline holding the model records the stock class."""
    base = BASES[WITH_SET_ATTN_PROCESSOR[0]]
    pipe = base.pipeline(transformer=trained_like(base))
    pipe.transformer.set_attn_processor(_stock_for_mhla(pipe.transformer))
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", base.record.transformer_class.__name__]
    assert type(DiffusionPipeline.from_pretrained(tmp_path).transformer) is base.record.transformer_class


def test_dit_has_no_model_level_processor_calls_and_none_has_set_default():
    """diffusers 0.42.1: DiT has no AttentionMixin; no base has set_default_attn_processor. If an upgrade
    adds them, check they route through the record-keeping set_attn_processor."""
    models = {name: trained_like(base) for name, base in BASES.items()}
    assert not hasattr(models["dit"], "set_attn_processor")
    assert not any(hasattr(m, "set_default_attn_processor") for m in models.values())
