"""Converter for the released Wan-MHLA checkpoint (original Wan key names -> diffusers + MHLA).

The synthetic checkpoint is a tiny diffusers model with the ``wan-release`` MHLA installed, exported to the
original layout with the inverse mapping. An independent float64 re-implementation of the release's
self-attention (written from its code: φ = relu + eps, RoPE on φ(q), φ(k), block tiles, 1×1-conv mixing,
no normaliser, per-head RMSNorm) checks that the converted layer computes what the release computed.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mhla_gen.integration.convert_wan import (
    MIXING_KEY,
    convert_wan_checkpoint,
    diffusers_to_original,
    diffusers_to_original_key,
    original_to_diffusers_key,
)
from mhla_gen.integration.install import install_mhla, mhla_processors
from mhla_gen.integration.loading import load_transformer
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.testing.wan import TEXT_DIM, TINY_WAN_CONFIG, tiny_wan_transformer

RELEASE_BLOCKS = (3, 5, 10)
RELEASE_LAYERS = [1, 2]  # the release keeps softmax in layers i % 3 == 0
CONFIG = {**TINY_WAN_CONFIG, "rope_max_seq_len": 64}


def _release_like_model() -> torch.nn.Module:
    model = tiny_wan_transformer(**CONFIG)
    install_mhla(model, MHLAConfig.preset("wan-release", layers=RELEASE_LAYERS))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for proc in mhla_processors(model).values():
            proc.mixing.weight.copy_(torch.rand(proc.mixing.weight.shape, generator=g) / 50)
            proc.head_norm.weight.copy_(1 + torch.randn(proc.head_norm.weight.shape, generator=g) / 4)
    return model


def _original_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in diffusers_to_original(model.state_dict()).items()}


def _outputs(model, latent_hw=(12, 22)):
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 16, 3, *latent_hw, generator=g)  # grid (3, 6, 11): uneven over (3, 5, 10)
    text = torch.randn(1, 7, TEXT_DIM, generator=g)
    with torch.no_grad():
        return model(latent, torch.tensor([400]), text).sample


def test_key_mapping_matches_diffusers_converter_and_round_trips():
    # pairs as diffusers' own convert_wan_transformer_to_diffusers renames them
    pairs = {
        "blocks.0.self_attn.q.weight": "blocks.0.attn1.to_q.weight",
        "blocks.4.self_attn.o.bias": "blocks.4.attn1.to_out.0.bias",
        "blocks.2.cross_attn.norm_k.weight": "blocks.2.attn2.norm_k.weight",
        "blocks.2.cross_attn.k_img.weight": "blocks.2.attn2.add_k_proj.weight",
        "blocks.1.norm3.bias": "blocks.1.norm2.bias",
        "blocks.1.ffn.0.weight": "blocks.1.ffn.net.0.proj.weight",
        "blocks.1.modulation": "blocks.1.scale_shift_table",
        "head.modulation": "scale_shift_table",
        "head.head.weight": "proj_out.weight",
        "time_projection.1.bias": "condition_embedder.time_proj.bias",
        "text_embedding.2.weight": "condition_embedder.text_embedder.linear_2.weight",
        "img_emb.proj.3.weight": "condition_embedder.image_embedder.ff.net.2.weight",
        "blocks.7.self_attn.block_attn.conv.weight": "blocks.7.attn1.processor.mixing.weight",
        "blocks.7.self_attn.g_norm.weight": "blocks.7.attn1.processor.head_norm.weight",
    }
    for original, diffusers_name in pairs.items():
        assert original_to_diffusers_key(original) == diffusers_name
        assert diffusers_to_original_key(diffusers_name) == original
    assert original_to_diffusers_key("blocks.0.self_attn.bogus.weight") is None

    i2v = tiny_wan_transformer(image_dim=8, added_kv_proj_dim=24)
    install_mhla(i2v, MHLAConfig.preset("wan-release", blocks=(1, 2, 2), layers=None, cpe_kernel=3))
    for key in i2v.state_dict():
        assert original_to_diffusers_key(diffusers_to_original_key(key)) == key


@pytest.mark.parametrize("storage", ["dict", "safetensors", "shards", "pth"])
def test_converted_model_equals_directly_installed_model(tmp_path, storage):
    model = _release_like_model()
    state = _original_state(model)
    assert state[f"blocks.1.{MIXING_KEY}"].shape == (150, 150, 1, 1)
    assert "blocks.0.self_attn.block_attn.conv.weight" not in state  # softmax layer
    if storage == "dict":
        checkpoint = state
    elif storage == "safetensors":
        checkpoint = tmp_path / "wan_mhla.safetensors"
        save_file(state, checkpoint)
    elif storage == "shards":
        checkpoint = tmp_path / "shards"
        checkpoint.mkdir()
        names = sorted(state)
        halves = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        for shard, keys in halves.items():
            save_file({k: state[k] for k in keys}, checkpoint / shard)
        weight_map = {k: shard for shard, keys in halves.items() for k in keys}
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:  # a training checkpoint: wrapped, with a DDP prefix
        checkpoint = tmp_path / "epoch_5.pth"
        torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "step": 500}, checkpoint)

    converted = convert_wan_checkpoint(checkpoint, dict(model.config))
    assert converted.mhla_config == model.mhla_config
    assert converted.mhla_config.layers == RELEASE_LAYERS and converted.mhla_config.normalize is False
    reference = model.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in converted.state_dict().items())
    # Same weights bit for bit, in memory the model owns (copied out of the file's buffer): the same
    # operations on the same operands give the same bits, so the outputs are equal exactly. (Left in the
    # shards' buffer at 8-byte offsets, the CPU GEMMs summed in another order: 4.8e-7 apart.)
    torch.testing.assert_close(_outputs(converted), _outputs(model), rtol=0, atol=0)


def _release_self_attention(sd, index, x, grid, cos, sin, heads, eps=1e-6, phi_eps=1e-6):
    """The release's MHLA self-attention (``rope_after``, no normaliser, ``g_norm``) on a divisible grid."""
    p = f"blocks.{index}.self_attn."

    def linear(name, t):
        return t @ sd[p + name + ".weight"].T + sd[p + name + ".bias"]

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight

    b, n, c = x.shape
    d = c // heads
    q = F.relu(rms(linear("q", x), sd[p + "norm_q.weight"])) + phi_eps  # the release's φ: relu + 1e-6
    k = F.relu(rms(linear("k", x), sd[p + "norm_k.weight"])) + phi_eps
    q, k, v = (t.view(b, n, heads, d) for t in (q, k, linear("v", x)))
    rotation = torch.complex(cos[..., 0::2], sin[..., 1::2])  # (1, N, 1, d / 2)
    q_rope, k_rope = (
        torch.view_as_real(
            torch.view_as_complex(t.reshape(b, n, heads, d // 2, 2).contiguous()) * rotation
        ).flatten(-2)
        for t in (q, k)
    )
    (fb, hb, wb), (f, h, w) = RELEASE_BLOCKS, grid
    p1, p2, p3 = f // fb, h // hb, w // wb

    def tiles(t):  # "b (fb p1 hb p2 wb p3) h c -> (b h) (fb hb wb) (p1 p2 p3) c"
        t = t.reshape(b, fb, p1, hb, p2, wb, p3, heads, d).permute(0, 7, 1, 3, 5, 2, 4, 6, 8)
        return t.reshape(b * heads, fb * hb * wb, p1 * p2 * p3, d)

    kv = tiles(k_rope).transpose(-2, -1) @ tiles(v)  # (BH, M, d, d)
    kv = torch.einsum("ij,bjde->bide", sd[p + "block_attn.conv.weight"][:, :, 0, 0], kv)  # the 1x1 conv
    out = tiles(q_rope) @ kv  # (BH, M, L, d)
    out = (
        out.reshape(b, heads, fb, hb, wb, p1, p2, p3, d)
        .permute(0, 2, 5, 3, 6, 4, 7, 1, 8)
        .reshape(b, n, heads, d)
    )
    out = rms(out, sd[p + "g_norm.weight"]).reshape(b, n, c)
    return linear("o", out)


def test_converted_layer_computes_what_the_release_computed():
    model = _release_like_model().double()
    state = _original_state(model)
    converted = convert_wan_checkpoint(state, dict(model.config), torch_dtype=torch.float64)
    latent = torch.zeros(1, 16, 3, 10, 20, dtype=torch.float64)  # grid (3, 5, 10): the release's tiles fit
    grid = (3, 5, 10)
    rotary = converted.rope(latent)  # carries the token grid
    x = torch.randn(1, 150, 24, dtype=torch.float64)
    ours = converted.blocks[1].attn1(x, None, None, rotary)
    cos, sin = (t.double() for t in rotary)
    assert converted.mhla_config.feature_map == "relu+1e-6"  # the release's φ, so nothing differs
    release = _release_self_attention(state, 1, x, grid, cos, sin, heads=2)
    torch.testing.assert_close(ours, release, rtol=1e-12, atol=1e-12)
    # what φ = relu alone (this library's default) would change: small, but far above float64 noise
    relu_only = _release_self_attention(state, 1, x, grid, cos, sin, heads=2, phi_eps=0.0)
    assert (relu_only - release).abs().max() > 1e3 * (ours - release).abs().max()


def test_conversion_errors_name_the_keys(tmp_path):
    model = _release_like_model()
    config = dict(model.config)
    state = _original_state(model)

    with pytest.raises(ValueError, match=r"unknown keys .*blocks\.1\.self_attn\.extra\.weight"):
        convert_wan_checkpoint({**state, "blocks.1.self_attn.extra.weight": torch.zeros(1)}, config)
    missing = {k: v for k, v in state.items() if k != "blocks.2.ffn.0.weight"}
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.2\.ffn\.0\.weight'\]"):
        convert_wan_checkpoint(missing, config)
    wrong = {**state, "head.head.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"shape mismatches \['head\.head\.weight"):
        convert_wan_checkpoint(wrong, config)
    stock = {k: v for k, v in state.items() if "block_attn" not in k and "g_norm" not in k}
    with pytest.raises(ValueError, match="not a Wan-MHLA checkpoint"):
        convert_wan_checkpoint(stock, config)
    with pytest.raises(ValueError, match=r"\[150\] blocks but MHLA blocks \(2, 2, 2\)"):
        mismatched = MHLAConfig.preset("wan-release", blocks=(2, 2, 2), layers=None)
        convert_wan_checkpoint(state, config, mhla=mismatched)
    with pytest.raises(FileNotFoundError):
        convert_wan_checkpoint(tmp_path / "nope.safetensors", config)


def test_mixing_matrix_shapes_accepted():
    model = _release_like_model()
    state = _original_state(model)
    for shape in [(150, 150), (150, 150, 1)]:
        reshaped = {k: v.reshape(shape) if k.endswith(MIXING_KEY) else v for k, v in state.items()}
        converted = convert_wan_checkpoint(reshaped, dict(model.config))
        assert torch.equal(
            converted.blocks[1].attn1.processor.mixing.weight, model.blocks[1].attn1.processor.mixing.weight
        )
    bad = {**state, f"blocks.1.{MIXING_KEY}": torch.zeros(150, 150, 3, 1)}
    with pytest.raises(ValueError, match="must have shape"):
        convert_wan_checkpoint(bad, dict(model.config))


def test_cli_writes_a_folder_load_transformer_reads(tmp_path):
    from scripts.convert_wan_mhla import main

    model = _release_like_model()
    save_file(_original_state(model), tmp_path / "release.safetensors")
    (tmp_path / "base" / "transformer").mkdir(parents=True)
    config = {k: v for k, v in model.config.items() if k != "mhla"} | {"_class_name": "WanTransformer3DModel"}
    (tmp_path / "base" / "transformer" / "config.json").write_text(json.dumps(config))
    main(
        [
            "--checkpoint",
            str(tmp_path / "release.safetensors"),
            "--config-from",
            str(tmp_path / "base"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    loaded = load_transformer(tmp_path / "out")
    assert loaded.mhla_config == model.mhla_config
    assert torch.equal(_outputs(loaded), _outputs(model))


def test_a_truncated_checkpoint_is_named_in_one_error(tmp_path):
    """A release file cut short (a .safetensors file, a shard of a folder, a .pth): one ValueError naming
    the file, not safetensors' or torch's own error type; --out is not created."""
    from scripts.convert_wan_mhla import main

    model = _release_like_model()
    save_file(_original_state(model), tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:5000])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.safetensors").write_bytes(data[: len(data) - 100])  # header whole, data short
    torch.save(_original_state(model), tmp_path / "full.pth")
    (tmp_path / "cut.pth").write_bytes((tmp_path / "full.pth").read_bytes()[:3000])
    config = dict(model.config)
    for name in ["cut.safetensors", "shards", "cut.pth"]:
        shown = "shards/a.safetensors" if name == "shards" else name
        with pytest.raises(ValueError, match=rf"checkpoint file '.*{shown}' does not read"):
            convert_wan_checkpoint(tmp_path / name, config)
    (tmp_path / "base").mkdir()
    stock = {k: v for k, v in model.config.items() if k != "mhla"} | {"_class_name": "WanTransformer3DModel"}
    (tmp_path / "base" / "config.json").write_text(json.dumps(stock))
    with pytest.raises(ValueError, match="cut.safetensors' does not read"):
        main(["--checkpoint", str(tmp_path / "cut.safetensors"), "--config-from", str(tmp_path / "base"),
              "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_whole_checkpoint_with_other_objects_is_not_called_incomplete(tmp_path):
    """A .pth holding a state dict and a non-tensor object (an argparse.Namespace of training arguments):
    torch.load(weights_only=True) refuses it; the error says so, with torch's reason, not 'is it
    complete?'."""
    import argparse

    model = _release_like_model()
    args = argparse.Namespace(lr=1e-4)
    torch.save({"state_dict": _original_state(model), "args": args}, tmp_path / "a.pth")
    refusal = r"'.*a\.pth' holds objects besides tensors, .*argparse\.Namespace"
    with pytest.raises(ValueError, match=refusal) as e:
        convert_wan_checkpoint(tmp_path / "a.pth", dict(model.config))
    assert "is it complete" not in str(e.value) and "\x1b" not in str(e.value)
