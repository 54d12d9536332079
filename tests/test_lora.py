"""LoRA + MHLA (mhla_gen.integration.lora): install order, parameter selection, save / load of a LoRA + MHLA
folder."""

from __future__ import annotations

import json
import logging
import shutil

import diffusers
import pytest
import torch
from peft import LoraConfig

from mhla_gen import install_mhla, load_transformer, mhla_parameters
from mhla_gen.bases import BASES as RECORDS
from mhla_gen.integration.lora import (
    ADAPTER_WEIGHTS,
    LORA_TARGET_MODULES,
    MANIFEST,
    MHLA_WEIGHTS,
    add_lora,
    lora_parameters,
    lora_training_parameters,
    merged_lora_copy,
    save_lora_mhla,
)
from mhla_gen.testing import TINY_SANA, sana_forward, tiny_dit, tiny_sana

SANA_CFG = TINY_SANA.mhla
LORA_BASES = [name for name, base in RECORDS.items() if "lora" in base.capabilities]
NO_LORA_BASES = [name for name in RECORDS if name not in LORA_BASES]


class Lora:
    """A record with a diffusers LoRA loader, through its test reference (``record.tiny``): a tiny model,
    its forward (with gradients), the test MHLA config and a tiny stock pipeline."""

    def __init__(self, name: str):
        self.record = RECORDS[name]
        self.tiny = self.record.tiny.load()
        self.cfg = self.tiny.mhla

    def factory(self):
        return self.tiny.model()

    def forward(self, model) -> torch.Tensor:
        return self.tiny.output(model)

    def make_pipeline(self, transformer):
        return self.tiny.pipeline(transformer=transformer)

    def load_pipeline(self, path, transformer_path):
        """The record's own pipeline loader (its sampler's)."""
        return self.record.sampler.load().load(str(path), None, torch.float32, None, str(transformer_path))


def lora_config(**kw) -> LoraConfig:
    # init_lora_weights=False: B is random too (peft's default B = 0 would leave A's first gradient 0)
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=list(LORA_TARGET_MODULES), init_lora_weights=False, **kw
    )


def assert_lora_and_mhla_train(model, forward) -> None:
    """Exactly the LoRA and MHLA parameters require grad, and one backward gives each a nonzero gradient."""
    lora, mhla = lora_parameters(model), mhla_parameters(model)
    assert lora and mhla
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora) | set(mhla)
    forward(model).square().mean().backward()
    for name, p in {**lora, **mhla}.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)


@pytest.mark.parametrize("base", LORA_BASES)
@pytest.mark.parametrize("order", ["mhla_then_add_lora", "add_adapter_then_mhla"])
def test_either_install_order_trains_mhla_and_lora(base, order):
    lora = Lora(base)
    model, cfg, forward = lora.factory(), lora.cfg, lora.forward
    if order == "mhla_then_add_lora":
        install_mhla(model, cfg)
        add_lora(model, rank=4, alpha=8, init_lora_weights=False)  # add_adapter, then MHLA unfrozen
    else:
        model.add_adapter(lora_config())  # diffusers' own call: freezes everything but the adapter...
        install_mhla(model, cfg)  # ...and MHLA installed afterwards is fresh and trainable
    names = set(lora_parameters(model))
    assert any(".attn1.to_out.0.lora_B." in n for n in names) and any(
        ".attn2.to_q.lora_A." in n for n in names
    )
    assert_lora_and_mhla_train(model, forward)


def test_plain_add_adapter_after_install_freezes_mhla_until_selected():
    """peft's add_adapter freezes every non-adapter weight, MHLA included: what add_lora and the training
    scripts' parameter selection (lora_training_parameters) undo."""
    model = install_mhla(tiny_sana(), SANA_CFG)
    model.add_adapter(lora_config())
    assert not any(p.requires_grad for p in mhla_parameters(model).values())
    params = lora_training_parameters(model)
    assert {id(p) for p in params} == {
        id(p) for p in [*lora_parameters(model).values(), *mhla_parameters(model).values()]
    }
    assert_lora_and_mhla_train(model, TINY_SANA.output)


@pytest.mark.parametrize("base", LORA_BASES)
def test_lora_mhla_folder_round_trip(tmp_path, base, caplog):
    """save_lora_mhla -> load_transformer (recorded base, or another copy of it) and the pipelines:
    outputs equal the trained model's exactly; the folder holds adapter + MHLA + manifest only."""
    lora = Lora(base)
    model, cfg, forward = lora.factory(), lora.cfg, lora.forward
    lora.make_pipeline(transformer=model).save_pretrained(tmp_path / "pretrained")  # the stock checkpoint
    install_mhla(model, cfg)
    add_lora(model, rank=4, alpha=8, init_lora_weights=False)
    opt = torch.optim.SGD(lora_training_parameters(model), lr=0.1)
    forward(model).square().mean().backward()
    opt.step()  # LoRA and MHLA move off their inits
    model.eval()
    with torch.no_grad():
        expected = forward(model)

    save_lora_mhla(model, tmp_path / "final", base=str(tmp_path / "pretrained"))
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == sorted(
        [ADAPTER_WEIGHTS, MHLA_WEIGHTS, MANIFEST]
    )
    manifest = json.loads((tmp_path / "final" / MANIFEST).read_text())
    assert (  # a local base by name and by its path from the folder: no absolute path in a shared folder
        manifest["base"] == "pretrained" and manifest["base_path"] == "../pretrained"
        and manifest["subfolder"] == "transformer"
    )

    loaded = load_transformer(tmp_path / "final")
    assert type(loaded) is type(model) and loaded.mhla_config == cfg and not loaded.training
    assert (loaded.peft_config["default"].r, loaded.peft_config["default"].lora_alpha) == (4, 8)
    with torch.no_grad():
        assert torch.equal(forward(loaded), expected)

    shutil.move(tmp_path / "pretrained", tmp_path / "moved")  # the recorded base is gone: name the new place
    with pytest.raises(OSError):
        load_transformer(tmp_path / "final")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mhla_gen.integration.lora"):
        assert torch.equal(
            forward(load_transformer(tmp_path / "final", base=str(tmp_path / "moved"))), expected
        )
    assert [r.levelno for r in caplog.records if "was trained on" in r.getMessage()] == [logging.WARNING]

    pipe = lora.load_pipeline(tmp_path / "moved", transformer_path=tmp_path / "final")
    with torch.no_grad():
        assert torch.equal(forward(pipe.transformer), expected)


def test_load_refuses_another_base_and_a_damaged_adapter(tmp_path):
    model = tiny_sana()
    model.save_pretrained(tmp_path / "pretrained" / "transformer")
    tiny_sana(num_layers=3).save_pretrained(tmp_path / "other" / "transformer")
    install_mhla(model, SANA_CFG)
    add_lora(model, rank=2, alpha=2)
    save_lora_mhla(model, tmp_path / "final", base=str(tmp_path / "pretrained"))
    with pytest.raises(ValueError, match="num_layers"):
        load_transformer(tmp_path / "final", base=str(tmp_path / "other"))

    from safetensors.torch import load_file, save_file

    adapter = load_file(tmp_path / "final" / ADAPTER_WEIGHTS)
    dropped = sorted(adapter)[0]
    del adapter[dropped]
    save_file(adapter, tmp_path / "final" / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="missing keys"):
        load_transformer(tmp_path / "final")
    (tmp_path / "final" / MHLA_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=MHLA_WEIGHTS):
        load_transformer(tmp_path / "final")


@pytest.mark.parametrize("base", NO_LORA_BASES)
def test_a_base_without_a_diffusers_lora_loader_is_refused_in_one_line(base, tmp_path):
    """A record without diffusers' LoRA loader (diffusers 0.42: DiT) trains a LoRA (peft injects its layers)
    but cannot save one for diffusers to load: refused in one line, naming what to do instead."""
    tiny = RECORDS[base].tiny.load()
    model = add_lora(install_mhla(tiny.model(), tiny.mhla), rank=4, alpha=4)
    name = RECORDS[base].class_name
    with pytest.raises(ValueError, match=f"{name} has no diffusers LoRA loader .* merged_lora_copy") as e:
        save_lora_mhla(model, tmp_path / "final", base="x")
    assert "\n" not in str(e.value) and not (tmp_path / "final").exists()
    assert not hasattr(getattr(diffusers, RECORDS[base].pipeline_class), "load_lora_weights")


def test_bad_settings_and_models_raise_clear_errors():
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        add_lora(tiny_sana(), rank=0, alpha=4)
    with pytest.raises(ValueError, match="alpha must be a positive"):
        add_lora(tiny_sana(), rank=4, alpha=-1.0)
    with pytest.raises(ValueError, match="no LoRA adapter to merge"):
        merged_lora_copy(tiny_dit())
    with pytest.raises(ValueError, match="no LoRA adapter"):
        lora_training_parameters(install_mhla(tiny_sana(), SANA_CFG))
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        save_lora_mhla(tiny_sana(), "unused", base="x")


def test_training_config_validates_lora_settings():
    from train_helpers import REPO

    from mhla_gen.train.config import DiTRunConfig, SanaRunConfig, WanRunConfig, load_config

    sana = str(REPO / "mhla_gen" / "configs" / "tiny" / "sana.yaml")
    cfg = load_config(WanRunConfig, None, ["train.trainable=lora", "train.lora_rank=4", "train.lora_alpha=2"])
    assert (cfg.train.trainable, cfg.train.lora_rank, cfg.train.lora_alpha) == ("lora", 4, 2.0)
    for bad, key in [
        ("train.lora_rank=0", "train.lora_rank"),
        ("train.lora_rank=-3", "train.lora_rank"),
        ("train.lora_alpha=0", "train.lora_alpha"),
        ("train.lora_alpha=-0.5", "train.lora_alpha"),
        ("train.lora_rank=2.5", "lora_rank"),  # OmegaConf's own type check names the field
        ("train.trainable=loraa", "train.trainable"),
    ]:
        with pytest.raises(ValueError, match=key):
            load_config(SanaRunConfig, sana, ["train.trainable=lora", bad])
    assert load_config(DiTRunConfig, None, ["train.trainable=lora"]).train.trainable == "lora"


def test_default_adapter_starts_from_the_mhla_model_exactly():
    """peft's default init (B = 0) leaves the model's output unchanged: LoRA fine-tuning starts from the
    MHLA model exactly."""
    model = install_mhla(tiny_sana(), SANA_CFG).eval()
    before = sana_forward(model)
    add_lora(model, rank=4, alpha=8)
    assert torch.equal(sana_forward(model), before)


@pytest.mark.parametrize("base", list(RECORDS))
def test_merged_copy_is_the_lora_model_without_adapter_layers(base):
    """Every base, with or without diffusers' add_adapter (DiT: add_lora injects peft's layers itself):
    merged_lora_copy gives the plain MHLA model with the same output (to float32 rounding of W + B A),
    leaving the original as it was."""
    tiny = RECORDS[base].tiny.load()
    model, forward, cfg = tiny.model(), tiny.output, tiny.mhla
    plain_keys = set(install_mhla(model, cfg).state_dict())
    add_lora(model, rank=4, alpha=8, init_lora_weights=False).eval()  # B random: the adapter moves the output
    assert_lora_and_mhla_train(model, forward)
    with torch.no_grad():
        with_adapter = forward(model)
        merged = merged_lora_copy(model).eval()
        assert not lora_parameters(merged) and set(merged.state_dict()) == plain_keys
        assert merged.mhla_config == cfg and not hasattr(merged, "peft_config")
        torch.testing.assert_close(forward(merged), with_adapter, rtol=1e-5, atol=1e-5)
        assert lora_parameters(model)  # the original keeps its adapter
        torch.testing.assert_close(forward(model), with_adapter, rtol=0, atol=0)
