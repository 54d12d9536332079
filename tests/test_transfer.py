"""Stage 1 of the converter (mhla_gen.train.transfer): each MHLA layer learns from the teacher's own input."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mhla_gen import MHLAConfig, install_mhla, load_transformer
from mhla_gen.bases import BASES
from mhla_gen.processors import MHLAProcessor
from mhla_gen.testing import tiny_dit, tiny_sana
from mhla_gen.train.transfer import TransferHooks, converted_layers, finalize, hardest_layers


def _randomized(model):
    """Non-zero weights everywhere (DiT and SANA start with zeroed adaLN / output layers)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _dit():
    model = _randomized(tiny_dit(num_layers=3))
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    return model, (x,), dict(timestep=torch.tensor([10, 20]), class_labels=torch.tensor([1, 2]))


def _sana():
    model = _randomized(tiny_sana(num_layers=3))
    x = torch.randn(2, model.config.in_channels, 16, 12)
    enc = torch.randn(2, 5, model.config.caption_channels)
    return model, (x,), dict(encoder_hidden_states=enc, timestep=torch.tensor([10, 20]))


def record_case(name: str):
    """``((model, args, kwargs), MHLA config)`` of a base record, from its test reference: its tiny model
    with 3 layers and random non-zero weights, its forward inputs, its test config on every layer."""
    tiny = BASES[name].tiny.load()
    model = _randomized(tiny.model(num_layers=3))
    return (model, (), tiny.inputs(model)), dataclasses.replace(tiny.mhla, layers=None)


def _forward(model, args, kwargs):
    return model(*args, **kwargs, return_dict=False)[0]


@pytest.mark.parametrize("trainable", ["mhla", "mhla+qk", "all"])
@pytest.mark.parametrize("base", sorted(BASES))
def test_every_layer_sees_the_teachers_input(base, trainable):
    """The model computes exactly the teacher's output (every hook hands on the teacher layer's output),
    so a layer's error does not change when an earlier converted layer changes."""
    (model, args, kwargs), cfg = record_case(base)
    with torch.no_grad():
        teacher = _forward(model, args, kwargs)
    install_mhla(model, cfg)
    hooks = TransferHooks(model, trainable)
    with torch.no_grad():
        assert torch.equal(_forward(model, args, kwargs), teacher)
        errors = hooks.pop_errors()
        first, *later = sorted(errors)
        # change the first MHLA layer: random mixing (a scaled one cancels in a normaliser or head norm)
        mixing = converted_layers(model)[first].processor.mixing.weight
        mixing.copy_(torch.rand(mixing.shape, generator=torch.Generator().manual_seed(1)))
        _forward(model, args, kwargs)
        broken = hooks.pop_errors()
    assert broken[first] != errors[first] and all(broken[i] == errors[i] for i in later)
    assert set(errors) == set(converted_layers(model)) and all(0 < e < float("inf") for e in errors.values())


def test_converted_runs_the_students_and_the_end_to_end_term():
    """Within ``converted()`` the hooked model is the converted model itself (no teacher in the path, no
    error recorded); stage 1's objective adds ``output_weight`` times that model's output error against
    the teacher's, whose gradient reaches a layer through the layers after it."""
    from types import SimpleNamespace

    from mhla_gen.train.linearize import TransferConfig, TransferTask
    from mhla_gen.train.transfer import relative_error

    model, args, kwargs = _dit()
    with torch.no_grad():
        teacher = _forward(model, args, kwargs)
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    with torch.no_grad():
        plain = _forward(model, args, kwargs)
    hooks = TransferHooks(model, "mhla")
    with torch.no_grad(), hooks.converted():
        assert torch.equal(_forward(model, args, kwargs), plain) and hooks.pop_errors() == {}
    with torch.no_grad():
        assert torch.equal(_forward(model, args, kwargs), teacher)  # the teacher again outside
    hooks.pop_errors()

    inputs = dict(kwargs, hidden_states=args[0])
    first = converted_layers(model)[0].processor.mixing.weight
    losses, grads = {}, {}
    for weight in (0.0, 2.0):
        task = object.__new__(TransferTask)  # objective() reads the hooks and the transfer settings only
        task.hooks, task.cfg = hooks, SimpleNamespace(transfer=TransferConfig(output_weight=weight))
        loss = task.objective(model, inputs)
        losses[weight], grads[weight] = loss.item(), torch.autograd.grad(loss, first)[0]
    expected = 2.0 * relative_error(plain, teacher).item()
    ulp = torch.finfo(torch.float32).eps * losses[2.0]  # the difference of two fp32 sums of that size
    assert losses[2.0] - losses[0.0] == pytest.approx(expected, abs=4 * ulp)
    with hooks.converted():  # the term's own gradient, from the converted model's forward
        term = torch.autograd.grad(2.0 * relative_error(_forward(model, args, kwargs), teacher), first)[0]
    grad_ulp = torch.finfo(torch.float32).eps * grads[2.0].abs().max()
    assert term.abs().max() > 100 * grad_ulp  # it reaches the first layer
    torch.testing.assert_close(grads[2.0] - grads[0.0], term, rtol=0, atol=4 * grad_ulp)


def test_what_trains_per_setting():
    model, args, kwargs = _dit()
    install_mhla(model, MHLAConfig(blocks=(2, 2), layers=[0, 2]))
    layers = converted_layers(model)
    expected = {
        "mhla": [p for a in layers.values() for p in a.processor.parameters()],
        "mhla+qk": [p for a in layers.values() for m in (a.processor, a.to_q, a.to_k)
                    for p in m.parameters()],
        "all": [p for a in layers.values() for p in a.parameters()],
    }
    for trainable, params in expected.items():
        hooks = TransferHooks(model, trainable)
        assert {id(p) for p in hooks.parameters()} == {id(p) for p in params}
        hooks.remove()
    assert not any(p is q for p in expected["all"] for q in model.transformer_blocks[1].attn1.parameters())


STEPS_CASES = list(zip(sorted(BASES), itertools.cycle(("mhla+qk", "mhla", "all"))))  # a setting per base


@pytest.mark.parametrize("base, trainable", STEPS_CASES)
def test_a_few_steps_lower_every_layers_error(base, trainable):
    (model, args, kwargs), cfg = record_case(base)
    install_mhla(model, cfg)
    hooks = TransferHooks(model, trainable)
    opt = torch.optim.Adam(hooks.parameters(), lr=1e-3)
    history = []
    for _ in range(8):
        _forward(model, args, kwargs)
        errors = hooks.pop_errors()
        history.append({i: e.item() for i, e in errors.items()})
        sum(errors.values()).backward()
        opt.step()
        opt.zero_grad()
    assert all(history[-1][i] < 0.95 * history[0][i] for i in history[0]), history


def test_sana_with_uniform_mixing_starts_exactly_where_it_was():
    """SANA's attention is global ReLU linear attention; MHLA with uniform mixing (rows 1/M) and the
    normaliser computes the same function (eps / M for SANA's 1e-15), so conversion starts at zero error."""
    model, args, kwargs = _sana()
    with torch.no_grad():
        stock = _forward(model, args, kwargs)
        install_mhla(model, MHLAConfig(blocks=(2, 2), mixing_init="uniform", eps=1e-15 / 4))
        converted = _forward(model, args, kwargs)
    torch.testing.assert_close(converted, stock, rtol=2e-6, atol=2e-6)
    hooks = TransferHooks(model)
    with torch.no_grad():
        _forward(model, args, kwargs)
    assert max(e.item() for e in hooks.pop_errors().values()) < 1e-12  # (rel. RMS < 1e-6)


def test_hardest_layers_and_finalize_keep_trained_weights(tmp_path):
    assert hardest_layers({0: 0.1, 1: 0.5, 2: 0.3, 3: 0.05}, 2) == [1, 2]
    for k in (4, -1):
        with pytest.raises(ValueError, match="must leave at least one"):
            hardest_layers({0: 0.1, 1: 0.5, 2: 0.3, 3: 0.05}, k)
    model, args, kwargs = _dit()
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    hooks = TransferHooks(model)
    with torch.no_grad():
        for attn in converted_layers(model).values():
            attn.processor.mixing.weight.mul_(0.5)
    trained = {i: a.processor.mixing.weight.clone() for i, a in converted_layers(model).items()}
    hooks.remove()
    finalize(model, softmax_layers=[1])
    assert model.mhla_config.layers == [0, 2]
    assert not isinstance(model.transformer_blocks[1].attn1.processor, MHLAProcessor)
    model.save_pretrained(tmp_path)
    loaded = load_transformer(tmp_path)
    for i in (0, 2):
        assert torch.equal(loaded.transformer_blocks[i].attn1.processor.mixing.weight, trained[i])
