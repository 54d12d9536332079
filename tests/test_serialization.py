"""save_pretrained -> load_transformer round trips and the MHLA-only export/import."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mhla_gen import (
    MHLAConfig,
    install_mhla,
    load_mhla_parameters,
    load_transformer,
    mhla_parameters,
    save_mhla_parameters,
)
from mhla_gen.bases import BASES
from mhla_gen.testing import sana_forward as sana_call
from mhla_gen.testing import tiny_dit, tiny_sana

CFG = MHLAConfig(blocks=(2, 2), layers=[1], cpe_kernel=3, gate=True, mixing_init="exp")


def record_case(name: str):
    """``(factory, call, cfg)`` of a base record's test reference: its tiny model, its output under
    ``no_grad`` (``call(model, size=1)``: at its second test size, another grid), its test MHLA config
    with ``mixing_init="exp"``."""
    tiny = BASES[name].tiny.load()

    @torch.no_grad()
    def call(model, size: int = 0):
        return tiny.output(model, latent=tiny.sizes[size])

    return tiny.model, call, dataclasses.replace(tiny.mhla, mixing_init="exp")


def trained_like(factory, cfg=CFG):
    """A model with MHLA whose MHLA parameters are far from their init (so a lost tensor shows)."""
    model = factory().eval()
    install_mhla(model, cfg)
    torch.manual_seed(5)
    for p in mhla_parameters(model).values():
        p.data.uniform_(0.0, 0.5)
    return model


@pytest.mark.parametrize("name", sorted(BASES))
def test_save_pretrained_load_transformer_round_trip(tmp_path, name):
    factory, call, cfg = record_case(name)
    model = trained_like(factory, cfg)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mhla"] == cfg.to_dict()
    loaded = load_transformer(tmp_path)
    assert type(loaded) is type(model) and loaded.mhla_config == cfg
    assert torch.equal(call(loaded), call(model))
    assert torch.equal(call(loaded, size=1), call(model, size=1))
    loaded_state = loaded.state_dict()
    assert all(torch.equal(loaded_state[k], v) for k, v in model.state_dict().items())


def test_load_transformer_of_stock_folder_and_dtype(tmp_path):
    model = tiny_sana().eval()
    model.save_pretrained(tmp_path)
    loaded = load_transformer(tmp_path, torch_dtype=torch.bfloat16)
    assert not hasattr(loaded, "mhla_config") and loaded.dtype == torch.bfloat16
    assert torch.equal(sana_call(load_transformer(tmp_path)), sana_call(model))


def test_load_transformer_has_one_home():
    """load_transformer lives in mhla_gen.integration.loading (above serialization and lora, which it
    dispatches to); serialization keeps no alias of it (the alias was the last import cycle)."""
    import mhla_gen
    import mhla_gen.integration.loading
    import mhla_gen.integration.serialization

    assert mhla_gen.load_transformer is mhla_gen.integration.loading.load_transformer
    assert not hasattr(mhla_gen.integration.serialization, "load_transformer")


def test_load_transformer_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_transformer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_transformer(tmp_path)
    tiny_dit().save_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_transformer(tmp_path)


def test_load_transformer_strict_keys(tmp_path):
    model = trained_like(tiny_dit)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state.pop("transformer_blocks.1.attn1.processor.mixing.weight")
    state["extra.weight"] = torch.zeros(1)
    save_file(state, weights)
    missing = r"missing keys \['transformer_blocks.1.attn1.processor.mixing.weight'\]"
    with pytest.raises(ValueError, match=missing + r", unexpected keys \['extra.weight'\]"):
        load_transformer(tmp_path)


def test_mhla_config_mismatch_in_folder_is_caught(tmp_path):
    """A folder whose weights lack MHLA but whose config asks for it fails loudly, naming the keys."""
    tiny_dit().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mhla"] = CFG.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="processor.mixing.weight"):
        load_transformer(tmp_path)


@pytest.mark.parametrize("name", sorted(BASES))
def test_weight_headers_checked_against_the_config(tmp_path, name):
    """``weights_mismatch`` reads a saved transformer's headers against the model its config.json describes:
    a whole folder fits (stock and with MHLA), a tensor dropped or cut to another shape is named, and the
    unexpected ones count where the strict loader reads the folder (MHLA recorded)."""
    from mhla_gen.integration.serialization import weights_mismatch

    factory, _, cfg = record_case(name)
    stock, with_mhla = tmp_path / "stock", tmp_path / "mhla"
    factory().save_pretrained(stock)
    trained_like(factory, cfg).save_pretrained(with_mhla)
    assert weights_mismatch(stock) is None and weights_mismatch(with_mhla) is None
    for folder in (stock, with_mhla):
        weights = folder / "diffusion_pytorch_model.safetensors"
        state = load_file(weights)
        dropped, cut = sorted(state)[0], sorted(state)[-1]
        state.pop(dropped)
        state[cut] = state[cut].reshape(-1)[:1].clone()
        state["extra.weight"] = torch.zeros(1)
        save_file(state, weights)
        found = weights_mismatch(folder)
        assert f"missing 1 ({dropped})" in found and f"of another shape 1 ({cut} (1,)" in found
        assert ("unexpected 1 (extra.weight)" in found) == (folder == with_mhla)


def test_weight_headers_of_shards_and_other_folders(tmp_path):
    """Shards listed in an index are read together; a folder that is not a transformer of a supported
    base (a VAE, no config.json) or has no default weight file is not this check's (None)."""
    from diffusers import AutoencoderKL

    from mhla_gen.integration.serialization import weights_mismatch

    model = tiny_dit()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert weights_mismatch(tmp_path / "sharded") is None
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[-1]
    lost = sorted(load_file(shard))
    save_file({}, shard)
    assert f"missing {len(lost)} (" in weights_mismatch(tmp_path / "sharded")
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    vae.save_pretrained(tmp_path / "vae")
    assert weights_mismatch(tmp_path / "vae") is None and weights_mismatch(tmp_path) is None
    model.save_config(tmp_path / "config_only")
    assert weights_mismatch(tmp_path / "config_only") is None
    for not_an_object in ("[]", '"text"'):  # the loader's to refuse
        (tmp_path / "sharded" / "config.json").write_text(not_an_object)
        assert weights_mismatch(tmp_path / "sharded") is None


def test_weight_file_check_reads_the_files_the_loader_reads(tmp_path):
    """check_weight_files opens the files a model folder's loader reads: a broken stray file beside the
    weight file (another precision's copy) is not read; a shard the index lists but the folder lacks and a
    malformed index are refused in one line naming the setting; a folder without a model weight file (a
    LoRA + MHLA folder) has every safetensors file checked."""
    from mhla_gen.errors import ConfigError
    from mhla_gen.integration.loading import check_weight_files

    model = tiny_dit()
    model.save_pretrained(tmp_path / "whole")
    (tmp_path / "whole" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"cut")
    check_weight_files(tmp_path / "whole", "setting=x")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("*.safetensors"))[-1]
    shard.unlink()
    listed = rf"setting=x: .*{shard.name}' is listed in the weight index .* not exist"
    with pytest.raises(ConfigError, match=listed):
        check_weight_files(tmp_path / "sharded", "setting=x")
    (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").write_text("{")
    with pytest.raises(ConfigError, match=r"setting=x: .*index\.json' is not a weight index \(JSONDecode"):
        check_weight_files(tmp_path / "sharded", "setting=x")
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter.safetensors").write_bytes(b"cut")
    with pytest.raises(ConfigError, match=r"setting=x: .*adapter\.safetensors' is not a readable"):
        check_weight_files(tmp_path / "lora", "setting=x")


@pytest.mark.parametrize("name", sorted(BASES))
def test_mhla_only_export_import(tmp_path, name):
    factory, call, cfg = record_case(name)
    model = trained_like(factory, cfg)
    file = tmp_path / "mhla.safetensors"
    save_mhla_parameters(model, file)
    assert set(load_file(file)) == set(mhla_parameters(model))

    fresh = factory().eval()  # same pretrained weights (same seed), no MHLA
    load_mhla_parameters(fresh, file)
    assert fresh.mhla_config == cfg
    assert torch.equal(call(fresh), call(model))


def test_mhla_import_rejects_other_config_and_base(tmp_path):
    file = tmp_path / "mhla.safetensors"
    save_mhla_parameters(trained_like(tiny_dit), file)
    other = tiny_dit()
    install_mhla(other, MHLAConfig(blocks=(4, 4)))
    with pytest.raises(ValueError, match="differs from the one in"):
        load_mhla_parameters(other, file)
    with pytest.raises(ValueError, match="for 'dit', not for this 'sana'"):
        load_mhla_parameters(tiny_sana(), file)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_mhla_parameters(tiny_dit(), tmp_path / "missing.safetensors")
