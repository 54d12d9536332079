"""MHLA in the Wan2.2 layouts: the two A14B experts (install, save, load, sample across the boundary),
TI2V-5B (48-channel latent, ``expand_timesteps``) and image-to-video (MHLA on ``attn1`` only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from PIL import Image

from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
from mhla_gen.pipelines.wan import load_wan_i2v_pipeline, load_wan_pipeline
from mhla_gen.processors.wan import WanMHLAProcessor
from mhla_gen.testing.video import (
    WAN22_T2V_BOUNDARY,
    tiny_ti2v_pipeline,
    tiny_wan22_pipeline,
    tiny_wan_expert,
    tiny_wan_i2v_pipeline,
)

HIGH = MHLAConfig(blocks=(2, 2, 2), layers=[1, 2])  # per-expert hybrid layers: each keeps another softmax
LOW = MHLAConfig(blocks=(2, 2, 2), layers=[0, 2], cpe_kernel=3)


def _perturb_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.copy_(0.1 + torch.rand(p.shape, generator=g))
    return model


def _a14b_pipeline():
    pipe = tiny_wan22_pipeline()
    install_mhla(pipe.transformer, HIGH)
    install_mhla(pipe.transformer_2, LOW)
    _perturb_(pipe.transformer, 1)
    _perturb_(pipe.transformer_2, 2)
    return pipe


def _sample(pipe, steps=4, **kwargs):
    args = dict(
        height=48, width=64, num_frames=5, max_sequence_length=16, guidance_scale=2.0
    )  # grid (2, 3, 4)
    return pipe(
        prompt="a red car",
        negative_prompt="blue",
        num_inference_steps=steps,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        **{**args, **kwargs},
    ).frames[0]


def _record_timesteps(pipe) -> dict[str, list[float]]:
    """The timestep of every call of each expert (a forward pre-hook on each)."""
    seen = {"transformer": [], "transformer_2": []}
    for name, calls in seen.items():
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, kw, calls=calls: calls.append(float(kw["timestep"].flatten()[0])), with_kwargs=True
        )
    return seen


def test_a14b_experts_save_load_and_sample_on_their_own_noise_ranges(tmp_path):
    """Both experts run MHLA with their own hybrid layers; the high-noise one gets every step with
    t >= boundary_ratio * 1000, the low-noise one the rest; a saved pipeline loads both back and
    samples the same video."""
    pipe = _a14b_pipeline()
    calls = _record_timesteps(pipe)
    reference = _sample(pipe)
    boundary = WAN22_T2V_BOUNDARY * 1000
    assert calls["transformer"] and calls["transformer_2"], calls
    assert min(calls["transformer"]) >= boundary > max(calls["transformer_2"])
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = load_wan_pipeline(tmp_path / "pipe", torch_dtype=torch.float32)
    assert loaded.transformer.mhla_config == HIGH and loaded.transformer_2.mhla_config == LOW
    kinds = [type(b.attn1.processor) for b in loaded.transformer_2.blocks]
    assert kinds == [WanMHLAProcessor, WanAttnProcessor, WanMHLAProcessor]
    assert loaded.config.boundary_ratio == WAN22_T2V_BOUNDARY
    # the same weights in memory of their own (copied out of the file) compute the same bits: exact
    np.testing.assert_allclose(_sample(loaded), reference, rtol=0, atol=0)


def test_experts_from_run_folders_or_installed_fresh(tmp_path):
    """Each expert from its own fine-tuning run's folder; or both from the stock pipeline with MHLA
    installed fresh (``mhla_2`` defaults to ``mhla``), or each with its own config."""
    stock = tiny_wan22_pipeline()
    stock.save_pretrained(tmp_path / "stock")
    high, low = (
        _perturb_(install_mhla(tiny_wan_expert(0), HIGH)),
        _perturb_(install_mhla(tiny_wan_expert(1), LOW)),
    )
    high.save_pretrained(tmp_path / "high")
    low.save_pretrained(tmp_path / "low")
    pipe = load_wan_pipeline(
        tmp_path / "stock",
        None,
        torch.float32,
        transformer_path=tmp_path / "high",
        transformer_2_path=tmp_path / "low",
    )
    assert pipe.transformer.mhla_config == HIGH and pipe.transformer_2.mhla_config == LOW
    low_mixing = pipe.transformer_2.blocks[0].attn1.processor.mixing.weight
    assert torch.equal(low_mixing, low.blocks[0].attn1.processor.mixing.weight)
    fresh = load_wan_pipeline(tmp_path / "stock", HIGH, torch.float32)
    assert fresh.transformer.mhla_config == fresh.transformer_2.mhla_config == HIGH
    fresh = load_wan_pipeline(tmp_path / "stock", HIGH, torch.float32, mhla_2=LOW)
    assert fresh.transformer_2.mhla_config == LOW
    with pytest.raises(ValueError, match="refusing to replace its trained MHLA"):
        load_wan_pipeline(tmp_path / "stock", HIGH, torch.float32, transformer_2_path=tmp_path / "low")


def test_ti2v_forward_with_per_token_timesteps():
    """TI2V-5B: 48 latent channels and one timestep per token (``expand_timesteps``); MHLA's grid comes
    from the latent's shape and patch size as for every Wan."""
    model = _perturb_(
        install_mhla(tiny_wan_expert(in_channels=48, out_channels=48), MHLAConfig(blocks=(2, 2, 3)))
    )
    latent = torch.randn(2, 48, 3, 6, 10)  # token grid (3, 3, 5)
    timestep = torch.full((2, 45), 700.0)
    timestep[:, :15] = 0.0  # the first latent frame kept clean, as TI2V's image conditioning does
    text = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = model(latent, timestep, text).sample
        uniform = model(latent, torch.full((2,), 700.0), text).sample
    assert out.shape == latent.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, uniform)  # per-token timesteps reach the blocks


@pytest.mark.parametrize("image_to_video", [False, True], ids=["t2v", "i2v"])
def test_ti2v_pipeline_samples_with_mhla(image_to_video, tmp_path, used_grids):
    pipe = tiny_ti2v_pipeline(image_to_video=image_to_video)
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2, 2)))
    pipe.save_pretrained(tmp_path / "pipe")
    load = load_wan_i2v_pipeline if image_to_video else load_wan_pipeline
    pipe = load(tmp_path / "pipe", torch_dtype=torch.float32)
    assert pipe.config.expand_timesteps and pipe.vae.config.z_dim == 48
    extra = {"image": Image.new("RGB", (96, 64), (200, 30, 30))} if image_to_video else {}
    video = _sample(pipe, steps=2, height=64, width=96, **extra)  # 16x VAE, patch 2: grid (2, 2, 3)
    assert video.shape == (5, 64, 96, 3) and np.isfinite(video).all()
    assert set(used_grids) == {(2, 2, 3)} and len(used_grids) == 3 * 2 * 2  # layers x steps x (cond, uncond)


def test_wan21_i2v_mhla_on_video_self_attention_only(tmp_path, used_grids):
    """Wan2.1 I2V: CLIP image features enter the cross-attention (``add_k_proj``); MHLA replaces the
    video self-attention ``attn1`` only, whose tokens are the video's alone."""
    pipe = tiny_wan_i2v_pipeline()
    install_mhla(pipe.transformer, MHLAConfig(blocks=(2, 2, 2)))
    blocks = pipe.transformer.blocks
    assert all(isinstance(b.attn1.processor, WanMHLAProcessor) for b in blocks)
    assert all(type(b.attn2.processor) is WanAttnProcessor and b.attn2.add_k_proj is not None for b in blocks)
    pipe.save_pretrained(tmp_path / "pipe")
    pipe = load_wan_i2v_pipeline(tmp_path / "pipe", torch_dtype=torch.float32)
    assert pipe.image_encoder.dtype == torch.float32
    video = _sample(pipe, steps=2, image=Image.new("RGB", (64, 48), (30, 200, 30)), max_sequence_length=512)
    assert video.shape == (5, 48, 64, 3) and np.isfinite(video).all()
    assert set(used_grids) == {(2, 3, 4)} and len(used_grids) == 3 * 2 * 2
