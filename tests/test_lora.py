"""LoRA + MHLA (mhla_gen.lora): install order, parameter selection, save / load of a LoRA + MHLA folder."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from peft import LoraConfig

from mhla_gen import MHLAConfig, install_mhla, load_transformer, mhla_parameters
from mhla_gen.lora import (
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
from mhla_gen.testing import sana_forward, tiny_dit, tiny_sana, tiny_sana_pipeline
from mhla_gen.testing_wan import TEXT_DIM, tiny_wan_pipeline, tiny_wan_transformer

SANA_CFG = MHLAConfig(blocks=(2, 2), cpe_kernel=3, gate=True)
WAN_CFG = MHLAConfig(blocks=(1, 2, 2), layers=[0, 1], cpe_kernel=3, gate=True)


def wan_forward(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 5, TEXT_DIM, generator=g)
    return model(x.to(model.dtype), torch.tensor([300, 700]), text.to(model.dtype)).sample


def sana_train_forward(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 3, 16, generator=g)
    x, text = x.to(model.dtype), text.to(model.dtype)
    return model(x, encoder_hidden_states=text, timestep=torch.tensor([100.0, 700.0])).sample


BASES = {
    "sana": (tiny_sana, SANA_CFG, sana_train_forward, tiny_sana_pipeline),
    "wan": (tiny_wan_transformer, WAN_CFG, wan_forward, tiny_wan_pipeline),
}


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


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("order", ["mhla_then_add_lora", "add_adapter_then_mhla"])
def test_either_install_order_trains_mhla_and_lora(base, order):
    factory, cfg, forward, _ = BASES[base]
    model = factory()
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
    assert_lora_and_mhla_train(model, sana_train_forward)


@pytest.mark.parametrize("base", BASES)
def test_lora_mhla_folder_round_trip(tmp_path, base, caplog):
    """save_lora_mhla -> load_transformer (recorded base, or another copy of it) and the pipelines:
    outputs equal the trained model's exactly; the folder holds adapter + MHLA + manifest only."""
    factory, cfg, forward, make_pipeline = BASES[base]
    model = factory()
    make_pipeline(transformer=model).save_pretrained(tmp_path / "pretrained")  # the stock checkpoint
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
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mhla_gen.lora"):
        assert torch.equal(
            forward(load_transformer(tmp_path / "final", base=str(tmp_path / "moved"))), expected
        )
    assert [r.levelno for r in caplog.records if "was trained on" in r.getMessage()] == [logging.WARNING]

    if base == "sana":
        from mhla_gen.pipelines.sana import load_sana_pipeline as load_pipeline
    else:
        from mhla_gen.pipelines.wan import load_wan_pipeline as load_pipeline
    pipe = load_pipeline(tmp_path / "moved", transformer_path=tmp_path / "final", torch_dtype=torch.float32)
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


def test_bad_settings_and_models_raise_clear_errors():
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        add_lora(tiny_sana(), rank=0, alpha=4)
    with pytest.raises(ValueError, match="alpha must be a positive"):
        add_lora(tiny_sana(), rank=4, alpha=-1.0)
    with pytest.raises(ValueError, match="DiTTransformer2DModel has no diffusers LoRA loader"):
        save_lora_mhla(add_lora(tiny_dit(), rank=4, alpha=4), "unused", base="x")
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


def dit_train_forward(model) -> torch.Tensor:
    """mhla_gen.testing.dit_forward with gradients (it runs under no_grad)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.config.in_channels, 8, 8, generator=g)
    return model(x, timestep=torch.tensor([100, 700]), class_labels=torch.tensor([1, 3])).sample


@pytest.mark.parametrize("base", ["dit", "sana"])
def test_merged_copy_is_the_lora_model_without_adapter_layers(base):
    """DiT has no diffusers add_adapter: add_lora injects peft's layers itself, and merged_lora_copy gives
    the plain MHLA model with the same output (to float32 rounding of W + B A), leaving the original as
    it was."""
    if base == "dit":
        model, forward, cfg = tiny_dit(), dit_train_forward, MHLAConfig(blocks=(2, 2), cpe_kernel=3)
    else:
        model, forward, cfg = tiny_sana(), sana_train_forward, SANA_CFG
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
