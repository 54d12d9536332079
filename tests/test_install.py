"""install_mhla / uninstall_mhla on the tiny models of every base record (its test reference), and the
cases that need one particular base (DiT, SANA, Wan)."""

import copy
import re

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from mhla_gen import MHLAConfig, install_mhla, mhla_parameters, uninstall_mhla
from mhla_gen.bases import BASES as BASE_RECORDS
from mhla_gen.bases import base_for_class_name, base_for_model
from mhla_gen.processors.base import MHLAProcessor
from mhla_gen.testing import dit_forward as dit_call
from mhla_gen.testing import tiny_dit, tiny_sana

RECORDS = sorted(BASE_RECORDS)  # every base record, through its test reference (record.tiny)


def tiny_of(name: str):
    return BASE_RECORDS[name].tiny.load()


def mhla_free(model) -> bool:
    """No MHLA processor, parameter, config entry or hook left."""
    layers = base_for_model(model).processor.self_attention(model)
    return (not any(isinstance(attn.processor, MHLAProcessor) for attn in layers)
            and not mhla_parameters(model) and "mhla" not in model.config and not model._forward_pre_hooks)


def mhla_layer_indices(model):
    return [i for i, b in enumerate(model.transformer_blocks) if isinstance(b.attn1.processor, MHLAProcessor)]


@pytest.mark.parametrize("name", RECORDS)
def test_uninstall_is_bit_exact(name):
    tiny = tiny_of(name)
    model, untouched = tiny.model().eval(), tiny.model().eval()
    install_mhla(model, tiny.mhla)
    uninstall_mhla(model)
    with torch.no_grad():
        assert torch.equal(tiny.output(model), tiny.output(untouched))
    assert mhla_free(model) and set(model.state_dict()) == set(untouched.state_dict())


def test_uninstall_restores_stock_processor_class():
    model = tiny_dit()
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    uninstall_mhla(model)
    assert all(type(b.attn1.processor) is AttnProcessor2_0 for b in model.transformer_blocks)
    with pytest.raises(ValueError, match="no MHLA installed"):
        uninstall_mhla(model)


@pytest.mark.parametrize("name", RECORDS)
def test_install_changes_output_and_records_config(name):
    tiny = tiny_of(name)
    model = tiny.model().eval()
    with torch.no_grad():
        stock = tiny.output(model)
        install_mhla(model, tiny.mhla)
        assert not torch.allclose(tiny.output(model), stock)
    assert model.mhla_config is tiny.mhla and model.config["mhla"] == tiny.mhla.to_dict()


def processors_by_layer(model) -> dict:
    return {name: m.processor for name, m in model.named_modules() if hasattr(m, "set_processor")}


def switch_off(model, switch: str) -> None:
    """diffusers' call that turns ``switch`` off on every attention layer (no hardware needed)."""
    if switch == "set_attention_slice":  # per module (the transformers have no model-level one)
        for module in model.modules():
            if hasattr(module, switch):
                module.set_attention_slice(None)
    else:
        model.disable_xformers_memory_efficient_attention() if "xformers" in switch else getattr(
            model, f"disable_{switch.removeprefix('set_use_')}")()


# diffusers' per-module attention switches, each of which its Attention answers with a processor of its own
SWITCHES = ("set_use_memory_efficient_attention_xformers", "set_use_npu_flash_attention",
            "set_use_xla_flash_attention", "set_attention_slice")


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("name", RECORDS)
def test_attention_switches_keep_mhla_and_reach_the_stock_layers(name, switch):
    """diffusers' attention switches (xformers, NPU and XLA flash attention, attention slicing) keep every
    MHLA processor in place (diffusers' ``Attention`` would set a softmax processor of its own there while
    config["mhla"] still records MHLA) and reach every other attention layer as in a never-touched model."""
    tiny = tiny_of(name)
    model, untouched = tiny.model().eval(), tiny.model().eval()
    install_mhla(model, tiny.mhla)
    installed = processors_by_layer(model)
    try:
        switch_off(untouched, switch)
    except AttributeError as err:  # Wan's set_attention_slice in diffusers 0.42 (no default_processor_cls)
        pytest.skip(f"diffusers' own switch fails on the stock model: {err}")
    switch_off(model, switch)
    now, stock = processors_by_layer(model), processors_by_layer(untouched)
    for layer, processor in now.items():
        if isinstance(installed[layer], MHLAProcessor):
            assert processor is installed[layer], layer
        else:
            assert type(processor) is type(stock[layer]), layer  # diffusers' own answer (SANA-Video's breaks)


@pytest.mark.parametrize("name", RECORDS)
def test_a_pipelines_xformers_switch_skips_mhla_layers_until_uninstalled(name, monkeypatch):
    """``pipe.enable_xformers_memory_efficient_attention()`` (needs xformers on a GPU: the module switch is
    recorded instead) reaches every attention layer of the transformer but its MHLA ones; after
    ``uninstall_mhla`` it reaches them all."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    tiny = tiny_of(name)
    model = tiny.model().eval()
    install_mhla(model, tiny.mhla)
    reached = []
    for cls in (Attention, AttentionModuleMixin):
        monkeypatch.setattr(cls, "set_use_memory_efficient_attention_xformers",
                            lambda self, valid, op=None: reached.append(self))
    tiny.pipeline(transformer=model).enable_xformers_memory_efficient_attention()
    layers = {id(m) for m in model.modules() if hasattr(m, "set_processor")}
    mhla_layers = {id(m) for m in model.modules() if isinstance(getattr(m, "processor", None), MHLAProcessor)}
    assert mhla_layers and {id(m) for m in reached} & layers == layers - mhla_layers  # (and the VAE's)
    uninstall_mhla(model)
    reached.clear()
    model.enable_xformers_memory_efficient_attention()
    assert {id(m) for m in reached} == layers


def test_layers_replaces_exactly_those_layers():
    model = tiny_dit(num_layers=4)
    install_mhla(model, MHLAConfig(blocks=(2, 2), layers=[0, 2]))
    assert mhla_layer_indices(model) == [0, 2]
    assert all(type(model.transformer_blocks[i].attn1.processor) is AttnProcessor2_0 for i in (1, 3))
    assert {n.split(".")[1] for n in mhla_parameters(model)} == {"0", "2"}


def test_reinstall_replaces_config(used_grids):
    model = tiny_dit(num_layers=3).eval()
    install_mhla(model, MHLAConfig(blocks=(2, 2), layers=[0, 1], gate=True))
    second = MHLAConfig(blocks=(4, 4), layers=[2])
    install_mhla(model, second)
    assert mhla_layer_indices(model) == [2]
    assert model.mhla_config is second and model.config["mhla"]["blocks"] == [4, 4]
    assert len(model._forward_pre_hooks) == 1
    assert all(p.shape == (16, 16) for n, p in mhla_parameters(model).items())
    dit_call(model)
    assert used_grids == [(4, 4)]


def test_uneven_grid_and_any_resolution(used_grids):
    """sample_size 10, patch 2 -> 5x5 tokens with 2x2 blocks; then 7x7 (DiT's unpatchify needs squares)."""
    model = tiny_dit(sample_size=10).eval()
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    out = dit_call(model, size=10)
    assert out.shape == (2, 8, 10, 10) and torch.isfinite(out).all()
    out = dit_call(model, size=14)
    assert out.shape == (2, 8, 14, 14) and used_grids == [(5, 5)] * 2 + [(7, 7)] * 2


def test_sana_non_square_grid(used_grids):
    model = tiny_sana().eval()
    install_mhla(model, MHLAConfig(blocks=(2, 3)))
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 5, 7, generator=g), torch.randn(1, 3, 16, generator=g)
    with torch.no_grad():
        out = model(x, encoder_hidden_states=text, timestep=torch.tensor([3.0])).sample
    assert out.shape == (1, 4, 5, 7) and used_grids == [(5, 7)] * 2
    assert all(block.attn1.processor.token_grid is None for block in model.transformer_blocks)  # call-scoped


@pytest.mark.parametrize("name", RECORDS)
def test_blocks_larger_than_grid_raise(name):
    tiny = tiny_of(name)
    model = install_mhla(tiny.model(), MHLAConfig(blocks=(16,) * len(tiny.latent)))
    with pytest.raises(ValueError, match=r"blocks \(16, 16(, 16)?\) do not fit the token grid \(\d+, \d+"):
        tiny.output(model)


def test_wrong_blocks_rank_raises():
    with pytest.raises(ValueError, match=r"2D token grid but MHLA blocks \(2, 2, 2\)"):
        install_mhla(tiny_dit(), MHLAConfig(blocks=(2, 2, 2)))


def test_bad_layer_indices_raise():
    with pytest.raises(ValueError, match=r"layers \[2, -1\] out of range: the model has 2"):
        install_mhla(tiny_dit(), MHLAConfig(blocks=(2, 2), layers=[0, 2, -1]))
    with pytest.raises(ValueError, match=r"more than once: \[1\]"):
        install_mhla(tiny_dit(), MHLAConfig(blocks=(2, 2), layers=[1, 1]))


def test_unsupported_model_raises():
    with pytest.raises(ValueError, match="MHLA does not support Linear"):
        install_mhla(torch.nn.Linear(2, 2), MHLAConfig())


@pytest.mark.parametrize("name", RECORDS)
def test_registry_maps_each_base_to_its_processor_class(name):
    record = BASE_RECORDS[name]
    model, processor_cls = tiny_of(name).model(), record.processor
    assert base_for_model(model) is record
    assert base_for_class_name(type(model).__name__).processor is processor_cls
    stock = type(processor_cls.stock_processor())  # what a fresh model's self-attention layers run
    layers = processor_cls.self_attention(model)
    assert [type(attn.processor) for attn in layers] == [stock] * model.config.num_layers


def test_unsupported_class_name_raises():
    supported = re.escape(str(sorted({base.class_name for base in BASE_RECORDS.values()})))
    with pytest.raises(ValueError, match=rf"model class 'UNet2DModel'; supported models: {supported}"):
        base_for_class_name("UNet2DModel")


@pytest.mark.parametrize("name", RECORDS)
@torch.no_grad()
def test_deepcopy_keeps_its_own_hooks(name, used_grids):
    """An EMA-style deepcopy runs its own grids and hooks; uninstalling it leaves the original intact."""
    tiny = tiny_of(name)
    model = install_mhla(tiny.model().eval(), tiny.mhla)
    small, large = tiny.sizes[:2]
    tiny.output(model, latent=small)
    ema = copy.deepcopy(model)
    tiny.output(ema, latent=large)
    assert used_grids[-1] != used_grids[0]  # the copy ran its own grid
    expected = tiny.output(model, latent=small)
    torch.testing.assert_close(tiny.output(ema, latent=small), expected, rtol=0, atol=0)
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    uninstall_mhla(ema)
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    torch.testing.assert_close(tiny.output(ema, latent=small), tiny.output(tiny.model().eval(), latent=small),
                               rtol=0, atol=0)


def test_processor_follows_model_dtype():
    model = tiny_sana().to(torch.bfloat16)
    install_mhla(model, MHLAConfig(blocks=(2, 2), gate=True))
    assert {p.dtype for p in mhla_parameters(model).values()} == {torch.bfloat16}


@pytest.mark.parametrize("name", RECORDS)
def test_gradient_checkpointing_gives_same_gradients(name):
    """Recomputation in backward must see the same token grid as the forward (an uneven one here)."""
    tiny = tiny_of(name)
    grads = []
    for checkpointing in (False, True):
        model = install_mhla(tiny.model().eval(), tiny.mhla)
        if checkpointing:
            model.enable_gradient_checkpointing()
        tiny.output(model, latent=tiny.sizes[-1]).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in mhla_parameters(model).items()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        # the recompute runs the same operations on the same inputs in the same order: exact
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def _grid_case(base):
    """The record's tiny model with its test MHLA (CPE and gate on; parameters moved off their init) and
    its inputs on two token grids of the same size: its second test latent, and that latent with the first
    axis halved and the last doubled (SANA 8x12 and 4x24 tokens, Wan 4x4x6 and 2x4x12: mixed aspect
    buckets)."""
    tiny = BASE_RECORDS[base].tiny.load()
    model = install_mhla(tiny.model().eval(), tiny.mhla)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.add_(0.1 * torch.rand_like(p))
    first = tiny.sizes[1]
    second = (first[0] // 2, *first[1:-1], first[-1] * 2)
    return model, [tiny.inputs(model, latent=latent, seed=i) for i, latent in enumerate((first, second))]


# one base per processor class (where the grid is read; BASES lists the more specific records first, so
# the plainer one of a class stays); not DiT, whose processor reads a square grid (DiTPipeline samples
# square images only)
GRID_BASES = list({base.processor: name for name, base in BASE_RECORDS.items() if name != "dit"}.values())


def _loss(model, inputs):
    return model(**inputs).sample.square().mean()


@pytest.mark.parametrize("base", GRID_BASES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_grids_then_one_backward(base, checkpointing, used_grids):
    """Two forwards at different grids, then one backward: the gradients of two separate backward
    passes, with and without gradient checkpointing (the recompute uses its own call's grid)."""
    model, inputs = _grid_case(base)
    separate = []
    for x in inputs:
        alone = copy.deepcopy(model)
        _loss(alone, x).backward()
        separate.append({n: p.grad for n, p in alone.named_parameters() if p.grad is not None})
    grids_alone = list(used_grids)
    if checkpointing:
        model.enable_gradient_checkpointing()
    used_grids.clear()
    (_loss(model, inputs[0]) + _loss(model, inputs[1])).backward()
    assert len(set(grids_alone)) == 2
    if checkpointing:  # forwards, then the recomputes in backward (last block first), each at its grid
        assert set(used_grids) == set(grids_alone) and len(used_grids) == 2 * len(grids_alone)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, separate[0][name] + separate[1][name], rtol=1e-5, atol=1e-7)
