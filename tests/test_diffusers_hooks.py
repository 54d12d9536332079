"""diffusers' inference-acceleration and guidance hooks (``diffusers.hooks``) on models with MHLA installed.

For every hook and base where stock diffusers supports the hook (docs/diffusers.md has the matrix), on the
record's tiny model with its test MHLA config: the hook applies; it acts on the MHLA layers (the MHLA
processors run fewer times, or their layer's output is what the hook promises); and with the hook removed
the output is the unhooked model's, bit for bit. A denoising loop is four calls at falling timesteps.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    HookRegistry,
    LayerSkipConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    SmoothedEnergyGuidanceConfig,
    TaylorSeerCacheConfig,
    apply_faster_cache,
    apply_first_block_cache,
    apply_layer_skip,
    apply_mag_cache,
    apply_pyramid_attention_broadcast,
    apply_sea_cache,
    apply_taylorseer_cache,
)
from diffusers.hooks.hooks import CacheContext, _set_cache_context
from diffusers.hooks.layer_skip import AttentionScoreSkipFunctionMode
from diffusers.hooks.smoothed_energy_guidance_utils import _apply_smoothed_energy_guidance_hook

from mhla_gen import install_mhla
from mhla_gen.bases import BASES
from mhla_gen.integration.install import mhla_processors

TIMESTEPS = (900, 700, 500, 300)
IMAGE_BASES = ("dit", "sana", "sana-video")
WAN_BASES = ("wan", "wan-i2v")  # WanTransformer3DModel: the only class here with CacheMixin (enable_cache)


def cache_configs(clock: dict) -> dict:
    """``{name: config}`` of the caches, each set to skip MHLA work on some of the four calls: attention
    recomputed every 2nd call (PAB, FasterCache, TaylorSeer on the self-attention modules), the blocks after
    the first skipped once the model's output stops changing (threshold huge: FirstBlockCache, MagCache)."""
    now = lambda: clock["t"]  # noqa: E731
    return {
        "pab": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=now),
        "faster_cache": FasterCacheConfig(  # t=900 is outside the range: FasterCache needs a first output
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 800),
            current_timestep_callback=now, is_guidance_distilled=True,
            attention_weight_callback=lambda _: 0.5),
        "taylorseer": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1,
                                            taylor_factors_dtype=torch.float32,
                                            cache_identifiers=[r"(transformer_)?blocks\.\d+\.attn1"]),
        "first_block_cache": FirstBlockCacheConfig(threshold=1e9),
        "mag_cache": MagCacheConfig(num_inference_steps=4, mag_ratios=[1.0] * 4, threshold=1e9),
        "sea_cache": SeaCacheConfig(threshold=1e9),
    }


APPLY = {"pab": apply_pyramid_attention_broadcast, "faster_cache": apply_faster_cache,
         "taylorseer": apply_taylorseer_cache, "first_block_cache": apply_first_block_cache,
         "mag_cache": apply_mag_cache, "sea_cache": apply_sea_cache}

# (hook, bases where stock diffusers 0.42 runs it): FirstBlockCache / MagCache / SeaCache look blocks up in
# TransformerBlockRegistry (no SANA, SANA-Video blocks there); SeaCache finds no noisy latent in DiT's call
# and in Wan I2V's (it runs fail-open: nothing cached)
CACHES = [
    *[(hook, base) for hook in ("pab", "faster_cache", "taylorseer") for base in sorted(BASES)],
    *[("first_block_cache", base) for base in ("dit", *WAN_BASES)],
    *[("mag_cache", base) for base in ("dit", *WAN_BASES)],
    ("sea_cache", "wan"),
]


def build(base: str, **mhla_overrides):
    """``(tiny reference, model)``: the record's tiny model in eval mode with its test MHLA config."""
    tiny = BASES[base].tiny.load()
    model = tiny.model().eval()
    return tiny, install_mhla(model, dataclasses.replace(tiny.mhla, **mhla_overrides))


def count_mhla_calls(model) -> dict:
    """A counter of MHLA processor calls (every layer's), ``{"n": calls}``."""
    counter = {"n": 0}
    for proc in mhla_processors(model).values():
        proc.register_forward_pre_hook(lambda *_: counter.__setitem__("n", counter["n"] + 1))
    return counter


@torch.no_grad()
def denoise(tiny, model, clock: dict | None = None, timesteps=TIMESTEPS) -> list[torch.Tensor]:
    """The model's outputs on one call per timestep (same latents), each in a cache context."""
    outputs = []
    for step, t in enumerate(timesteps):
        if clock is not None:
            clock["t"] = t
        inputs = tiny.inputs(model, seed=1)
        inputs["timestep"] = torch.full_like(inputs["timestep"], t)
        _set_cache_context(model, CacheContext("cond", step_index=step, num_inference_steps=4, timestep=t,
                                               sigma=t / 1000))
        outputs.append(model(**inputs, return_dict=False)[0])
        _set_cache_context(model, None)
    return outputs


def remove_hooks(model) -> None:
    """Remove every diffusers hook from ``model`` and its submodules (what ``disable_cache`` and the guiders
    do hook by hook)."""
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for name in list(registry.hooks) if registry is not None else []:
            registry.remove_hook(name, recurse=False)


@pytest.mark.parametrize("hook,base", CACHES)
def test_caches_skip_mhla_work_and_leave_no_trace(hook, base):
    tiny, model = build(base)
    reference = denoise(tiny, copy.deepcopy(model))
    calls = count_mhla_calls(model)
    clock = {"t": TIMESTEPS[0]}
    config = cache_configs(clock)[hook]
    if base in WAN_BASES:  # the model-level API (CacheMixin) where diffusers offers it
        model.enable_cache(config)
    else:
        APPLY[hook](model, config)
    unhooked_calls = len(mhla_processors(model)) * len(TIMESTEPS)
    cached = denoise(tiny, model, clock)

    assert torch.equal(cached[0], reference[0])  # the first call computes everything
    assert 0 < calls["n"] < unhooked_calls, (calls["n"], unhooked_calls)
    assert not all(torch.equal(a, b) for a, b in zip(cached, reference))  # a skipped MHLA call shows
    if base in WAN_BASES:
        model.disable_cache()
    else:
        remove_hooks(model)
    for after, before in zip(denoise(tiny, model), reference):
        assert torch.equal(after, before)


@pytest.mark.parametrize("base", ("dit", *WAN_BASES))
def test_first_block_cache_at_threshold_zero_is_the_uncached_model(base):
    tiny, model = build(base)
    reference = denoise(tiny, copy.deepcopy(model))
    calls = count_mhla_calls(model)
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.0))
    for cached, uncached in zip(denoise(tiny, model), reference):
        assert torch.equal(cached, uncached)
    assert calls["n"] == len(mhla_processors(model)) * len(TIMESTEPS)


def with_attention_replaced(model, index: int, base: str, output):
    """A forward hook making self-attention layer ``index`` return ``output(attn, hidden_states)`` (the
    reference for what a layer-skip hook promises, independent of diffusers' machinery)."""
    attn = BASES[base].processor.self_attention(model)[index]
    attn.register_forward_hook(
        lambda m, args, kwargs, out: output(m, kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True)
    return model


SKIPS = {  # LayerSkipConfig overrides -> what the skipped layer returns
    "skip_attention": ({"skip_ff": False}, lambda attn, x: x),
    # identity attention (out = V) on a layer without CPE / gate / head norm: to_out(to_v(x))
    "skip_attention_scores": ({"skip_attention": False, "skip_attention_scores": True, "skip_ff": False},
                              lambda attn, x: attn.to_out[1](attn.to_out[0](attn.to_v(x)))),
}


# (base, wan_rope): Wan with the release RoPE placement too (its own path to the attention core)
LAYER_SKIP_CASES = [*((base, None) for base in sorted(BASES)), ("wan", "after_phi_numerator")]


@pytest.mark.parametrize("skip", sorted(SKIPS))
@pytest.mark.parametrize("base,rope", LAYER_SKIP_CASES)
def test_layer_skip_acts_on_mhla_attention(base, rope, skip):
    """``apply_layer_skip`` (SkipLayerGuidance; ``skip_attention_scores``: PerturbedAttentionGuidance) on an
    MHLA layer: the attention returns its input, or V through ``to_out``, as the guiders expect."""
    plain = {"cpe_kernel": 0, "gate": False, "wan_head_norm": False}  # to_out(V) is then the whole layer
    plain.update({"wan_rope": rope} if rope else {})
    tiny, model = build(base, **plain)
    index = (tiny.mhla.layers or [0])[0]
    overrides, output = SKIPS[skip]
    expected = with_attention_replaced(copy.deepcopy(model), index, base, output)
    apply_layer_skip(model, LayerSkipConfig(indices=[index], **overrides))
    calls = count_mhla_calls(model)
    one_call = TIMESTEPS[:1]
    hooked, reference = denoise(tiny, model, timesteps=one_call), denoise(tiny, expected, timesteps=one_call)
    torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)  # fp32 round-off of one to_out
    assert calls["n"] == (len(mhla_processors(model)) - (skip == "skip_attention"))  # skipped: not called
    remove_hooks(model)
    unhooked = build(base, **plain)[1]
    assert torch.equal(*(denoise(tiny, m, timesteps=one_call)[0] for m in (model, unhooked)))


@pytest.mark.parametrize("base", ("dit", *WAN_BASES))  # stock SANA / SANA-Video blocks are not registered
def test_layer_skip_of_whole_blocks_skips_their_mhla(base):
    """``apply_layer_skip`` of attention and feed-forward: the MHLA layer's block returns its input."""
    tiny, model = build(base)
    index = (tiny.mhla.layers or [0])[0]
    expected = copy.deepcopy(model)
    block = (expected.blocks if base in WAN_BASES else expected.transformer_blocks)[index]
    block.register_forward_hook(
        lambda m, args, kwargs, out: kwargs.get("hidden_states", args[0] if args else None), with_kwargs=True)
    apply_layer_skip(model, LayerSkipConfig(indices=[index]))
    calls = count_mhla_calls(model)
    one_call = TIMESTEPS[:1]
    assert torch.equal(*(denoise(tiny, m, timesteps=one_call)[0] for m in (model, expected)))
    assert calls["n"] == len(mhla_processors(model)) - 1


def test_attention_scores_skipped_under_the_mode_only():
    from mhla_gen.processors.skip import attention_scores_skipped

    assert not attention_scores_skipped()
    with AttentionScoreSkipFunctionMode():
        assert attention_scores_skipped()


@pytest.mark.parametrize("base", sorted(BASES))
def test_smoothed_energy_guidance_blurs_mhla_queries(base):
    """SEG's hook on ``to_q`` reaches the MHLA layers (they call ``attn.to_q``); removed, no trace."""
    tiny, model = build(base)
    index = (tiny.mhla.layers or [0])[0]
    one_call = TIMESTEPS[:1]
    reference = denoise(tiny, copy.deepcopy(model), timesteps=one_call)[0]
    seen = []
    mhla_attn = BASES[base].processor.self_attention(model)[index]
    mhla_attn.processor.register_forward_pre_hook(lambda *_: seen.append(True))
    _apply_smoothed_energy_guidance_hook(model, SmoothedEnergyGuidanceConfig(indices=[index]), blur_sigma=1e4)
    assert HookRegistry.check_if_exists_or_initialize(mhla_attn.to_q).hooks  # on the MHLA layer's to_q
    assert not torch.equal(denoise(tiny, model, timesteps=one_call)[0], reference)
    assert seen  # the MHLA processor ran on the blurred queries
    remove_hooks(model)
    assert torch.equal(denoise(tiny, model, timesteps=one_call)[0], reference)
