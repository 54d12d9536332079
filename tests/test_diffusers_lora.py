"""LoRA + MHLA the diffusers way (issue 41, item 2): ``pipe.load_lora_weights(final)`` of a
``train.trainable=lora`` result (``save_lora_mhla``) loads adapter AND MHLA parameters into an MHLA
transformer, with outputs equal to ``load_transformer(final)`` under diffusers' set_adapters / unload /
fuse calls; on a stock transformer it fails loudly, naming ``mhla_gen.integration.lora.load_lora_weights``,
before changing anything. Every base record with diffusers' LoRA loader (``lora`` in its capabilities;
diffusers has no DiT LoRA: test_lora checks that refusal), through its test reference."""

from __future__ import annotations

import json
import logging

import diffusers
import pytest
import torch
from diffusers.utils import logging as diffusers_logging
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_lora import LORA_BASES, TINY_SANA, Lora

from mhla_gen import MHLAConfig, install_mhla, load_transformer, mhla_parameters, save_mhla_parameters
from mhla_gen.integration.install import MHLA_MODEL_CLASSES
from mhla_gen.integration.lora import (
    ADAPTER_WEIGHTS,
    MANIFEST,
    MHLA_MARKER,
    MHLA_WEIGHTS,
    add_lora,
    load_lora_weights,
    lora_adapter_metadata,
    lora_mhla_config,
    lora_state_dict,
    lora_training_parameters,
    save_lora_mhla,
)


def pipeline_cls(name: str) -> type:
    return getattr(diffusers, Lora(name).record.pipeline_class)


def mhla_cls(name: str) -> type:
    return MHLA_MODEL_CLASSES[Lora(name).record.transformer_class]


EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", params=LORA_BASES)
def lora_run(request, tmp_path_factory):
    """``(name, root, forward)``: ``root/pretrained`` the stock pipeline, ``root/final`` a trained LoRA +
    MHLA folder, ``root/final2`` the same adapter with other MHLA parameters."""
    lora = Lora(request.param)
    cfg, forward = lora.cfg, lora.forward
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    model = lora.factory()
    lora.make_pipeline(transformer=model).save_pretrained(root / "pretrained")
    install_mhla(model, cfg)
    add_lora(model, rank=4, alpha=8, init_lora_weights=False)
    opt = torch.optim.SGD(lora_training_parameters(model), lr=0.1)
    forward(model).square().mean().backward()
    opt.step()  # LoRA and MHLA move off their inits
    save_lora_mhla(model.eval(), root / "final", base=str(root / "pretrained"))
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.mul_(0.5)
    save_lora_mhla(model, root / "final2", base=str(root / "pretrained"))
    return request.param, root, torch.no_grad()(forward)


def stock_pipe(name, root):
    return pipeline_cls(name).from_pretrained(root / "pretrained")


def test_adapter_file_is_a_diffusers_pipeline_lora_with_the_mhla_inside(lora_run):
    name, root, _ = lora_run
    with safe_open(root / "final" / ADAPTER_WEIGHTS, framework="pt") as f:
        keys, metadata = list(f.keys()), json.loads(f.metadata()["lora_adapter_metadata"])
    assert keys and all(k.startswith("transformer.") and "lora" in k for k in keys)
    mhla_keys = [k for k in keys if k.startswith("transformer.mhla_with_lora.")]
    assert len(mhla_keys) == len(mhla_parameters(load_transformer(root / "final")))
    assert metadata[f"transformer.{MHLA_MARKER}"] == Lora(name).cfg.to_dict()
    assert (metadata["transformer.r"], metadata["transformer.lora_alpha"]) == (4, 8)
    assert lora_mhla_config(root / "final") == Lora(name).cfg


def test_stock_transformer_refuses_loudly_and_stays_untouched(lora_run):
    name, root, forward = lora_run
    pipe = stock_pipe(name, root)
    before = forward(pipe.transformer)
    with pytest.raises(TypeError) as raised:
        pipe.load_lora_weights(root / "final")
    assert "mhla_gen.integration.lora.load_lora_weights(pipe, folder)" in str(raised.value.__cause__)
    assert not getattr(pipe.transformer, "peft_config", None)
    assert torch.equal(forward(pipe.transformer), before)


def test_load_lora_weights_and_diffusers_calls_equal_load_transformer(lora_run):
    name, root, forward = lora_run
    reference = load_transformer(root / "final")  # its adapter is named "default"
    expected = forward(reference)
    pipe = load_lora_weights(stock_pipe(name, root), root / "final")
    assert type(pipe.transformer) is mhla_cls(name)
    assert pipe.config.transformer == ("mhla_gen.models", mhla_cls(name).__name__)  # re-registered
    assert torch.equal(forward(pipe.transformer), expected)
    (adapter,) = pipe.get_active_adapters()

    pipe.set_adapters([adapter], adapter_weights=[0.5])
    reference.set_adapters(["default"], weights=[0.5])
    assert torch.equal(forward(pipe.transformer), forward(reference))
    pipe.set_adapters([adapter], adapter_weights=[1.0])
    reference.set_adapters(["default"], weights=[1.0])

    pipe.unload_lora_weights()  # the low-rank adapter goes; the MHLA parameters stay (docs/diffusers.md)
    reference.unload_lora()
    assert not getattr(pipe.transformer, "peft_config", None)
    assert torch.equal(forward(pipe.transformer), forward(reference))

    pipe.load_lora_weights(root / "final")  # diffusers' own call, now that the transformer runs MHLA
    assert torch.equal(forward(pipe.transformer), expected)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # fused: the LoRA + MHLA model without adapter layers
    # fused (W + sBA)x and unfused Wx + sB(Ax) differ by float32 rounding of short sums in a few layers
    atol = 100 * EPS * expected.abs().max()
    torch.testing.assert_close(forward(pipe.transformer), expected, rtol=0, atol=atol)


def test_half_precision_lora_load_equals_load_transformer(lora_run):
    """In bfloat16 (diffusers keeps its fp32 modules in float32) the adapter, the MHLA parameters and every
    other tensor get the same dtype either way, and the outputs are equal."""
    name, root, forward = lora_run
    reference = load_transformer(root / "final", torch_dtype=torch.bfloat16)
    pipe = pipeline_cls(name).from_pretrained(root / "pretrained", dtype=torch.bfloat16)
    pipe = load_lora_weights(pipe, root / "final")
    dtypes = {k: v.dtype for k, v in reference.state_dict().items()}
    assert torch.bfloat16 in dtypes.values()
    loaded = {k.replace(".default_0.", ".default."): v.dtype  # diffusers names the adapter default_0
              for k, v in pipe.transformer.state_dict().items()}
    # Wan I2V: diffusers' loader also puts zero LoRA layers on the image K/V projections of the cross-
    # attention (WanLoraLoaderMixin expands a text-to-video adapter), which load_transformer does not add
    new = set(loaded) - set(dtypes)
    expanded = [m for m in (".add_k_proj.", ".add_v_proj.") if any(m in k and ".lora_" in k for k in new)]

    def as_reference(key):  # peft holds an expanded projection's own weight in its base_layer
        return key.replace(".base_layer.", ".") if any(m in key for m in expanded) else key

    extra = {k for k in new if any(m in k and ".lora_" in k for m in expanded)}
    kept = {as_reference(k): v for k, v in loaded.items() if k not in extra}
    assert kept == dtypes
    assert torch.equal(forward(pipe.transformer), forward(reference))


def test_mhla_params_of_another_adapter_or_config_are_refused(lora_run):
    name, root, forward = lora_run
    pipe = stock_pipe(name, root)
    install_mhla(pipe.transformer, lora_mhla_config(root / "final"))
    pipe.load_lora_weights(root / "final", adapter_name="first")
    expected = forward(pipe.transformer)
    with pytest.raises(ValueError, match=r"\['first'\] run with: unload_lora_weights\(\) .*first"):
        pipe.load_lora_weights(root / "final2", adapter_name="second")
    assert pipe.get_list_adapters()["transformer"] == ["first"]
    assert torch.equal(forward(pipe.transformer), expected)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(root / "final2", adapter_name="second")
    assert torch.equal(forward(pipe.transformer), forward(load_transformer(root / "final2")))

    other = stock_pipe(name, root)
    cfg = lora_mhla_config(root / "final")
    install_mhla(other.transformer, MHLAConfig.from_dict({**cfg.to_dict(), "gate": not cfg.gate}))
    with pytest.raises(ValueError, match=r"this LoRA was trained with MHLA .*lora_mhla_config\(folder\)"):
        other.load_lora_weights(root / "final")
    assert not getattr(other.transformer, "peft_config", None)


def test_format_1_folder_still_loads(tmp_path):
    """Folders written before the adapter file carried the MHLA (unprefixed save_lora_adapter keys)."""
    cfg, forward = TINY_SANA.mhla, TINY_SANA.output
    model = TINY_SANA.model()
    TINY_SANA.pipeline(transformer=model).save_pretrained(tmp_path / "pretrained")
    install_mhla(model, cfg)
    add_lora(model, rank=4, alpha=8, init_lora_weights=False)
    final = tmp_path / "final"
    model.save_lora_adapter(str(final), weight_name=ADAPTER_WEIGHTS)
    save_mhla_parameters(model, final / MHLA_WEIGHTS)
    save_lora_mhla(model, tmp_path / "new", base=str(tmp_path / "pretrained"))
    manifest = json.loads((tmp_path / "new" / MANIFEST).read_text())
    manifest.pop("adapter_prefix")
    (final / MANIFEST).write_text(json.dumps({**manifest, "format": "mhla_gen.lora/1"}))
    with torch.no_grad():
        assert torch.equal(forward(load_transformer(final)), forward(model.eval()))
    assert lora_mhla_config(final) == cfg


def test_damaged_mhla_entries_name_the_keys(lora_run, tmp_path):
    name, root, _ = lora_run
    with safe_open(root / "final" / ADAPTER_WEIGHTS, framework="pt") as f:
        metadata = f.metadata()
    state = load_file(root / "final" / ADAPTER_WEIGHTS)
    dropped = next(k for k in sorted(state) if k.startswith("transformer.mhla_with_lora."))
    del state[dropped]
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / ADAPTER_WEIGHTS, metadata=metadata)
    pipe = stock_pipe(name, root)
    install_mhla(pipe.transformer, lora_mhla_config(root / "final"))
    param = dropped.split("mhla_with_lora.")[1]
    with pytest.raises(ValueError, match=r"missing keys \['" + param.replace(".", r"\.")):
        pipe.load_lora_weights(tmp_path / "bad")


def test_pipeline_save_lora_weights_with_lora_state_dict_keeps_mhla(lora_run, tmp_path):
    """diffusers' pipeline-level export, called as its training examples call it but with mhla_gen's state
    dict and metadata, writes a file every LoRA + MHLA loader reads back whole; with peft's
    get_peft_model_state_dict (the examples' own) it writes the adapter only, as docs/diffusers.md says."""
    name, root, forward = lora_run
    pipeline = pipeline_cls(name)
    expected = forward(load_transformer(root / "final"))
    pipe = load_lora_weights(stock_pipe(name, root), root / "final")
    (adapter,) = pipe.get_active_adapters()
    pipeline.save_lora_weights(
        tmp_path / "kept",
        transformer_lora_layers=lora_state_dict(pipe.transformer, adapter),
        transformer_lora_adapter_metadata=lora_adapter_metadata(pipe.transformer, adapter),
    )
    assert lora_mhla_config(tmp_path / "kept") == lora_mhla_config(root / "final")
    reloaded = load_lora_weights(stock_pipe(name, root), tmp_path / "kept")
    assert torch.equal(forward(reloaded.transformer), expected)
    with pytest.raises(TypeError) as raised:  # a stock transformer refuses it, naming the right call
        stock_pipe(name, root).load_lora_weights(tmp_path / "kept")
    assert "mhla_gen.integration.lora.load_lora_weights(pipe, folder)" in str(raised.value.__cause__)

    pipeline.save_lora_weights(
        tmp_path / "dropped",
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer, adapter_name=adapter),
    )
    with safe_open(tmp_path / "dropped" / ADAPTER_WEIGHTS, framework="pt") as f:
        assert not [k for k in f.keys() if "mhla_with_lora" in k]
    assert lora_mhla_config(tmp_path / "dropped") is None


def test_model_save_lora_adapter_is_diffusers_own_and_warns(lora_run, tmp_path, caplog):
    """``transformer.save_lora_adapter`` keeps diffusers' format (adapter weights only: diffusers' own LoRA
    tests read every key back as an adapter weight) and warns, naming the calls that keep the MHLA."""
    name, root, forward = lora_run
    pipe = load_lora_weights(stock_pipe(name, root), root / "final")
    (adapter,) = pipe.get_active_adapters()
    with caplog.at_level(logging.WARNING, logger="mhla_gen"):
        pipe.transformer.save_lora_adapter(tmp_path, adapter_name=adapter)
    assert "without its MHLA parameters; mhla_gen.integration.lora.save_lora_mhla" in caplog.text
    written = set(load_file(tmp_path / ADAPTER_WEIGHTS))
    assert written == set(get_peft_model_state_dict(pipe.transformer, adapter_name=adapter))


def test_no_lora_keys_logs_diffusers_message_through_the_mhla_override(lora_run):
    """diffusers' LoRA tests expect an info log when a state dict has no keys for the model's prefix; the
    MHLA classes' load_lora_adapter hands the dict on to diffusers, which logs it (naming the model's
    class)."""
    name, root, _ = lora_run
    transformer = install_mhla(stock_pipe(name, root).transformer, lora_mhla_config(root / "final"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    peft_logger = diffusers_logging.get_logger("diffusers.loaders.peft")
    peft_logger.addHandler(handler)
    try:
        transformer.load_lora_adapter({"lora_foo": torch.tensor(2.0)}, prefix="transformer")
    finally:
        peft_logger.removeHandler(handler)
    message = f"No LoRA keys associated to {type(transformer).__name__} found with the prefix='transformer'"
    assert any(r.getMessage().startswith(message) for r in records)
    assert not getattr(transformer, "peft_config", None)
