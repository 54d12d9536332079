"""Processors changed by diffusers' own calls stay consistent with ``config["mhla"]`` (issue 41, item 3):
``set_attn_processor`` that would replace MHLA is refused naming ``uninstall_mhla`` (model untouched), and a
model whose processors were swapped behind install_mhla's back (``attn.set_processor``) refuses to save.
Tiny DiT, SANA and Wan (DiT has neither ``set_attn_processor`` nor ``set_default_attn_processor``)."""

from __future__ import annotations

import json

import pytest
from test_diffusers_loading import BASES, trained_like

from mhla_gen import uninstall_mhla
from mhla_gen.bases import base_for_model


@pytest.mark.parametrize("name", ["sana", "wan"])
def test_set_attn_processor_touching_mhla_is_refused(name):
    base = BASES[name]
    model = trained_like(base)
    before, config = base.forward(model), dict(model.config)
    stock = base_for_model(model).processor.stock_processor()
    for processor in (stock, {k: stock for k in model.attn_processors}):
        with pytest.raises(ValueError, match=r"uninstall_mhla\(transformer\) first"):
            model.set_attn_processor(processor)
    installed = model.attn_processors
    mhla_name = next(k for k, p in installed.items() if type(p).__name__.endswith("MHLAProcessor"))
    other = next(k for k, p in installed.items() if not type(p).__name__.endswith("MHLAProcessor"))
    with pytest.raises(ValueError, match=other.replace(".", r"\.")):  # an MHLA processor put elsewhere
        model.set_attn_processor({**installed, other: installed[mhla_name]})
    assert base.forward(model).equal(before) and dict(model.config) == config

    # processors other than MHLA's change as usual (here: fresh cross-attention processors)
    cross = {k: type(p)() for k, p in installed.items() if ".attn2." in k}
    model.set_attn_processor({**installed, **cross})
    assert all(model.attn_processors[k] is p for k, p in cross.items())
    assert base.forward(model).equal(before)

    uninstall_mhla(model)  # the named way out: stock attention, then any processor
    model.set_attn_processor(stock)
    assert "mhla" not in model.config


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


def test_dit_has_no_model_level_processor_calls_and_none_has_set_default():
    """diffusers 0.42.1: DiT has no AttentionMixin; no base has set_default_attn_processor. If an upgrade
    adds them, check they route through the guarded set_attn_processor."""
    models = {name: trained_like(base) for name, base in BASES.items()}
    assert not hasattr(models["dit"], "set_attn_processor")
    assert not any(hasattr(m, "set_default_attn_processor") for m in models.values())
