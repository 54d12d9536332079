"""Block-causal MHLA (ops/streaming.py) and its streaming memories (ops/streaming_cache.py) against the
dense float64 oracle (ops/streaming_naive.py): forward and gradients of both training paths, and a
chunk-by-chunk rollout of each cache equals one pass over the whole video."""

from __future__ import annotations

import pytest
import torch

from mhla_gen import BlockLayout
from mhla_gen.ops.factorised_mixing import FactorisedMixing
from mhla_gen.ops.mixing import locality_init
from mhla_gen.ops.streaming import (
    BlockCausal,
    block_causal_mhla,
    factorised_block_causal_mhla,
    factorised_mixing_dense,
)
from mhla_gen.ops.streaming_cache import FactorisedStreamCache, GeneralStreamCache, streaming_cache_bytes
from mhla_gen.ops.streaming_naive import block_causal_dense, factorised_dense

# (grid, blocks, chunk_frames)
UNIFORM = [
    ((4, 3, 5), (2, 2, 3), 2),  # uneven spatial grid, one time block per chunk
    ((6, 5, 3), (6, 2, 2), 3),  # three time blocks per chunk, uneven spatial grid
    ((4, 2, 3), (4, 1, 1), 1),  # one spatial block: one global state per chunk
    ((3, 4, 4), (1, 2, 2), 3),  # one chunk: plain (bidirectional) MHLA
]
NON_UNIFORM = [((6, 3, 2), (4, 2, 1), 2)]  # time blocks of 2, 2, 1, 1 frames: chunks cut differently
HEADS, DECAY = 2, (0.6, 1.0)


def _inputs(layout, batch=2, dim=3, value_dim=4, grad=False):
    n = layout.num_tokens
    q, k, v = (torch.randn(batch, HEADS, n, c, dtype=torch.float64, requires_grad=grad)
               for c in (dim, dim, value_dim))
    return q, k, v


def _close(got, want):
    """float64 sums of at most N·d ~ 10³ terms round at ~1e-13 of their size; a wrong mask or a missing
    term is O(1)."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * max(1.0, want.abs().max().item()))


def _chunks(x, causal):
    return x.split(causal.chunk_tokens, dim=2)


def _rollout(cache, q, k, v, *params, causal):
    outs = []
    for qc, kc, vc in zip(_chunks(q, causal), _chunks(k, causal), _chunks(v, causal)):
        out, cache = cache.step(qc, kc, vc, *params)
        outs.append(out)
    return torch.cat(outs, dim=2), cache


def _factorised_params(causal, grad=False):
    m = causal.blocks_per_chunk
    spatial = torch.rand(m, m, dtype=torch.float64).requires_grad_(grad)
    decay = torch.tensor(DECAY, dtype=torch.float64, requires_grad=grad)
    return spatial, decay


# ---------------------------------------------------------------------------------------- BlockCausal
def test_block_causal_chunks_and_mask():
    causal = BlockCausal(BlockLayout((6, 3, 2), (4, 2, 1)), 2)  # time blocks 2, 2, 1, 1 frames
    assert causal.num_chunks == 3 and causal.chunk_tokens == 12
    assert causal.chunk_of_block.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert causal.chunk_starts == [0, 2, 4, 8] and not causal.uniform
    assert causal.chunk_layout(2) == BlockLayout((2, 3, 2), (2, 2, 1))
    mask = causal.mask
    assert mask[4, 3] and mask[2, 3] and mask[7, 4] and not mask[3, 4] and not mask[0, 2]
    assert torch.equal(mask, causal.chunk_of_block[None, :] <= causal.chunk_of_block[:, None])
    assert BlockCausal(BlockLayout((4, 3, 5), (2, 2, 3)), 2).blocks_per_chunk == 6


@pytest.mark.parametrize("grid, blocks, chunk_frames, message", [
    ((5, 4, 4), (5, 1, 1), 2, r"chunk_frames=2 does not divide the 5 latent frames of grid \(5, 4, 4\)"),
    ((6, 2, 2), (4, 1, 1), 3, r"time block 1 of blocks=\(4, 1, 1\) covers frames 2\.\.3, across a boundary "
                              r"of chunk_frames=3"),
    ((4, 2, 2), (1, 1, 1), 2, "time block 0 .* covers frames 0..3"),
    ((4, 2, 2), (2, 1, 1), 0, "chunk_frames must be a positive int, got 0"),
    ((4, 2, 2), (2, 1, 1), 1.5, "chunk_frames must be a positive int, got 1.5"),
])
def test_block_causal_refuses_chunks_that_do_not_fit(grid, blocks, chunk_frames, message):
    with pytest.raises(ValueError, match=message):
        BlockCausal(BlockLayout(grid, blocks), chunk_frames)


def test_non_uniform_chunks_refuse_the_factorised_mixing():
    causal = BlockCausal(BlockLayout(*NON_UNIFORM[0][:2]), 2)
    q, k, v = _inputs(causal.layout)
    with pytest.raises(ValueError, match=r"different time blocks \[\[2\], \[2\], \[1, 1\]\]"):
        factorised_block_causal_mhla(q, k, v, causal, torch.ones(2, 2), torch.ones(HEADS))
    with pytest.raises(ValueError, match="different time blocks"):
        FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4)


# ------------------------------------------------------------------------------ general mixing: training
@pytest.mark.parametrize("grid, blocks, chunk_frames", UNIFORM + NON_UNIFORM)
@pytest.mark.parametrize("normalize", [True, False])
def test_general_path_forward_and_gradients_match_the_oracle(grid, blocks, chunk_frames, normalize):
    layout = BlockLayout(grid, blocks)
    causal = BlockCausal(layout, chunk_frames)
    q, k, v = _inputs(layout, grad=True)
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, dtype=torch.float64, requires_grad=True)
    got = block_causal_mhla(q, k, v, causal, mixing, normalize=normalize)
    want = block_causal_dense(q, k, v, layout, chunk_frames, mixing, normalize=normalize)
    _close(got, want)
    weight = torch.randn_like(want)
    grads = torch.autograd.grad((got * weight).sum(), (q, k, v, mixing))
    expected = torch.autograd.grad((want * weight).sum(), (q, k, v, mixing))
    for g, e in zip(grads, expected):
        _close(g, e)


def test_masked_mixing_entries_get_zero_gradient():
    layout = BlockLayout((4, 3, 5), (2, 2, 3))
    causal = BlockCausal(layout, 2)
    q, k, v = _inputs(layout)
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(block_causal_mhla(q, k, v, causal, mixing).square().sum(), mixing)
    assert (grad[~causal.mask] == 0).all() and (grad[causal.mask] != 0).all()
    with torch.no_grad():  # and their values play no part
        changed = mixing + 5.0 * (~causal.mask)
    _close(block_causal_mhla(q, k, v, causal, changed), block_causal_mhla(q, k, v, causal, mixing))


# --------------------------------------------------------------------------- factorised mixing: training
@pytest.mark.parametrize("grid, blocks, chunk_frames", UNIFORM)
@pytest.mark.parametrize("normalize", [True, False])
def test_factorised_path_forward_and_gradients_match_the_oracle(grid, blocks, chunk_frames, normalize):
    layout = BlockLayout(grid, blocks)
    causal = BlockCausal(layout, chunk_frames)
    q, k, v = _inputs(layout, grad=True)
    spatial, decay = _factorised_params(causal, grad=True)
    got = factorised_block_causal_mhla(q, k, v, causal, spatial, decay, normalize=normalize)
    dense = factorised_dense(layout, chunk_frames, spatial, decay)  # (H, M, M) from the definition
    want = block_causal_dense(q, k, v, layout, chunk_frames, dense, normalize=normalize)
    _close(got, want)
    weight = torch.randn_like(want)
    inputs = (q, k, v, spatial, decay)
    grads = torch.autograd.grad((got * weight).sum(), inputs)
    expected = torch.autograd.grad((want * weight).sum(), inputs)
    for g, e in zip(grads, expected):
        _close(g, e)
    if causal.num_chunks > 1:
        assert grads[4].abs().min() > 0  # each head's decay is learnt from the earlier chunks


@pytest.mark.parametrize("grid, blocks, chunk_frames", UNIFORM)
def test_factorised_path_is_the_general_path_with_each_heads_dense_mixing(grid, blocks, chunk_frames):
    layout = BlockLayout(grid, blocks)
    causal = BlockCausal(layout, chunk_frames)
    q, k, v = _inputs(layout)
    spatial, decay = _factorised_params(causal)
    dense = factorised_mixing_dense(causal, spatial, decay)
    _close(dense, factorised_dense(layout, chunk_frames, spatial, decay))
    got = factorised_block_causal_mhla(q, k, v, causal, spatial, decay)
    for h in range(HEADS):
        one = slice(h, h + 1)
        _close(got[:, one], block_causal_mhla(q[:, one], k[:, one], v[:, one], causal, dense[h]))


# ---------------------------------------------------------------------------- streaming = one full pass
@pytest.mark.parametrize("grid, blocks, chunk_frames", UNIFORM + NON_UNIFORM)
@pytest.mark.parametrize("normalize", [True, False])
def test_general_cache_rollout_equals_the_full_pass(grid, blocks, chunk_frames, normalize):
    layout = BlockLayout(grid, blocks)
    causal = BlockCausal(layout, chunk_frames)
    q, k, v = _inputs(layout)
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, dtype=torch.float64)
    cache = GeneralStreamCache.empty(causal, 2, HEADS, 3, 4, normalize=normalize, dtype=torch.float64)
    got, cache = _rollout(cache, q, k, v, mixing, causal=causal)
    _close(got, block_causal_mhla(q, k, v, causal, mixing, normalize=normalize))
    _close(got, block_causal_dense(q, k, v, layout, chunk_frames, mixing, normalize=normalize))
    assert cache.chunks_done == causal.num_chunks and cache.summaries.shape[0] == layout.num_blocks


@pytest.mark.parametrize("grid, blocks, chunk_frames", UNIFORM)
@pytest.mark.parametrize("normalize", [True, False])
def test_factorised_cache_rollout_equals_the_full_pass(grid, blocks, chunk_frames, normalize):
    layout = BlockLayout(grid, blocks)
    causal = BlockCausal(layout, chunk_frames)
    q, k, v = _inputs(layout)
    spatial, decay = _factorised_params(causal)
    cache = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, normalize=normalize, dtype=torch.float64)
    got, cache = _rollout(cache, q, k, v, spatial, decay, causal=causal)
    _close(got, factorised_block_causal_mhla(q, k, v, causal, spatial, decay, normalize=normalize))
    dense = factorised_dense(layout, chunk_frames, spatial, decay)
    _close(got, block_causal_dense(q, k, v, layout, chunk_frames, dense, normalize=normalize))
    assert cache.chunks_done == causal.num_chunks


@pytest.mark.parametrize("normalize", [True, False])
def test_one_spatial_block_without_decay_is_a_global_linear_attention_state(normalize):
    """One block per chunk, γ = 1, W_s = [[1]]: the running sum SANA-Video-style block-causal linear
    attention keeps; both caches and the dense oracle with W = 1 agree."""
    layout = BlockLayout((6, 3, 4), (3, 1, 1))
    causal = BlockCausal(layout, 2)
    q, k, v = _inputs(layout)
    want = block_causal_dense(q, k, v, layout, 2, torch.ones(3, 3, dtype=torch.float64), normalize=normalize)
    cache = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, normalize=normalize, dtype=torch.float64)
    ones = torch.ones(1, 1, dtype=torch.float64)
    got, cache = _rollout(cache, q, k, v, ones, torch.ones(HEADS, dtype=torch.float64), causal=causal)
    _close(got, want)
    assert cache.state.shape == (1, 2, HEADS, 3, 4 + normalize)  # one global state per head
    general = GeneralStreamCache.empty(causal, 2, HEADS, 3, 4, normalize=normalize, dtype=torch.float64)
    _close(_rollout(general, q, k, v, torch.ones(3, 3, dtype=torch.float64), causal=causal)[0], want)


def test_caches_run_half_inputs_with_fp32_states():
    layout = BlockLayout((4, 3, 5), (2, 2, 3))
    causal = BlockCausal(layout, 2)
    q, k, v = (x.half() for x in _inputs(layout))
    spatial, decay = _factorised_params(causal)
    cache = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float16)
    got, cache = _rollout(cache, q, k, v, spatial.float(), decay.float(), causal=causal)
    assert got.dtype == torch.float16 and cache.state.dtype == torch.float32
    dense = factorised_dense(layout, 2, spatial, decay)
    want = block_causal_dense(q.double(), k.double(), v.double(), layout, 2, dense)
    # the inputs are the same fp16 numbers; fp32 sums, then one fp16 rounding of the output (2^-11)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


# ------------------------------------------------------------------------------------------ memory
def test_cache_sizes_factorised_constant_general_and_kv_grow():
    """From 1x to 8x the length: the factorised cache keeps its size, the general cache and a softmax KV
    cache grow linearly; the computed sizes are the caches' real ones."""
    chunk = BlockLayout((1, 4, 6), (1, 2, 2))
    causal = BlockCausal(BlockLayout((8, 4, 6), (8, 2, 2)), 1)
    q, k, v = (x.half() for x in _inputs(causal.layout, dim=8, value_dim=8))
    general = GeneralStreamCache.empty(causal, 2, HEADS, 8, 8, dtype=torch.float16)
    factorised = FactorisedStreamCache.empty(chunk, 2, HEADS, 8, 8, dtype=torch.float16)
    mixing, spatial, decay = torch.rand(32, 32), torch.rand(4, 4), torch.tensor(DECAY)
    sizes = []
    for c, (qc, kc, vc) in enumerate(zip(_chunks(q, causal), _chunks(k, causal), _chunks(v, causal)), 1):
        general = general.step(qc, kc, vc, mixing)[1]
        factorised = factorised.step(qc, kc, vc, spatial, decay)[1]
        computed = streaming_cache_bytes(chunk, c, 2, HEADS, 8, 8, dtype=torch.float16)
        assert computed["general"] == general.nbytes and computed["factorised"] == factorised.nbytes
        sizes.append(computed)
    assert sizes[0]["factorised"] == sizes[7]["factorised"] == 2 * HEADS * 4 * 8 * 9 * 4  # fp32 states
    assert sizes[7]["general"] == 8 * sizes[0]["general"] == 8 * sizes[0]["factorised"]
    assert sizes[7]["softmax_kv"] == 8 * sizes[0]["softmax_kv"] == 8 * 2 * HEADS * 24 * 16 * 2  # fp16 K, V


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("decay", [(0.0, 0.5), (0.5, 1.5), (-0.2, 0.5), (float("nan"), 0.5)])
def test_a_decay_outside_0_1_is_refused(decay):
    causal = BlockCausal(BlockLayout((4, 3, 5), (2, 2, 3)), 2)
    q, k, v = _inputs(causal.layout)
    spatial = torch.rand(6, 6, dtype=torch.float64)
    bad = torch.tensor(decay, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\] for every head"):
        factorised_block_causal_mhla(q, k, v, causal, spatial, bad)
    cache = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\]"):
        cache.step(*(x[:, :, : causal.chunk_tokens] for x in (q, k, v)), spatial, bad)
    with pytest.raises(ValueError, match=r"decay must be a tensor of shape \(2,\)"):
        cache.step(*(x[:, :, : causal.chunk_tokens] for x in (q, k, v)), spatial, torch.ones(3))
    with pytest.raises(ValueError, match=r"decay_init must lie in \(0, 1\)"):
        FactorisedMixing(causal.chunk_layout(0), HEADS, decay_init=1.0)


def _bad_chunk(kind, q, k, v):
    if kind == "tokens":
        return q[:, :, :-1], k[:, :, :-1], v[:, :, :-1]
    if kind == "heads":
        return q[:, :1], k[:, :1], v[:, :1]
    if kind == "batch":
        return q[:1], k[:1], v[:1]
    if kind == "key_dim":
        return q[..., :2], k[..., :2], v
    return q, k, v[..., :3]  # value_dim


@pytest.mark.parametrize("kind", ["tokens", "heads", "batch", "key_dim", "value_dim"])
def test_caches_refuse_chunks_of_another_shape(kind):
    causal = BlockCausal(BlockLayout((4, 3, 5), (2, 2, 3)), 2)
    q, k, v = (x[:, :, : causal.chunk_tokens] for x in _inputs(causal.layout))
    bad = _bad_chunk(kind, q, k, v)
    general = GeneralStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    factorised = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    spatial, decay = _factorised_params(causal)
    message = r"but this cache was made for chunks of shape \(2, 2, 30, [34]\)"
    with pytest.raises(ValueError, match=message):
        general.step(*bad, torch.rand(12, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match=message):
        factorised.step(*bad, spatial, decay)


def test_caches_refuse_another_models_parameters_dtype_or_layout():
    causal = BlockCausal(BlockLayout((4, 3, 5), (2, 2, 3)), 2)
    q, k, v = (x[:, :, : causal.chunk_tokens] for x in _inputs(causal.layout))
    general = GeneralStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    factorised = FactorisedStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mixing must have shape \(12, 12\)"):
        general.step(q, k, v, torch.rand(6, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"spatial_mixing must have shape \(6, 6\)"):
        factorised.step(q, k, v, torch.rand(12, 12, dtype=torch.float64), torch.tensor(DECAY))
    with pytest.raises(ValueError, match="this cache holds torch.float64 states; q is torch.float32"):
        general.step(q.float(), k.float(), v.float(), torch.rand(12, 12))
    other = BlockCausal(BlockLayout((4, 3, 5), (2, 3, 2)), 2)  # same sizes, other blocks
    with pytest.raises(ValueError, match="this cache was made for BlockCausal"):
        general.check_model(other)
    with pytest.raises(ValueError, match="this cache was made for chunks"):
        factorised.check_model(other)
    general.check_model(causal), factorised.check_model(causal)


def test_general_cache_refuses_a_chunk_past_the_end():
    causal = BlockCausal(BlockLayout((4, 3, 5), (2, 2, 3)), 2)
    q, k, v = _inputs(causal.layout)
    mixing = torch.rand(12, 12, dtype=torch.float64)
    cache = GeneralStreamCache.empty(causal, 2, HEADS, 3, 4, dtype=torch.float64)
    _, cache = _rollout(cache, q, k, v, mixing, causal=causal)
    with pytest.raises(ValueError, match="stepped all 2 chunks"):
        cache.step(*(x[:, :, : causal.chunk_tokens] for x in (q, k, v)), mixing)


# ------------------------------------------------------------------------------- the learnable mixing
def test_factorised_mixing_stays_non_negative_and_decays_in_range():
    chunk = BlockLayout((1, 3, 5), (1, 2, 3))
    module = FactorisedMixing(chunk, HEADS, decay_init=0.8)
    spatial, decay = module()
    torch.testing.assert_close(spatial, locality_init(chunk).clamp_min(1e-4), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(decay, torch.full((HEADS,), 0.8))
    causal = BlockCausal(BlockLayout((4, 3, 5), (4, 2, 3)), 1)
    q, k, v = (x.float() for x in _inputs(causal.layout))
    out = factorised_block_causal_mhla(q, k, v, causal, *module())
    out.square().sum().backward()
    assert module.spatial_raw.grad.abs().sum() > 0 and (module.decay_logit.grad != 0).all()
    with torch.no_grad():  # a step far past the constraints
        module.spatial_raw.sub_(1e3)
        module.decay_logit.add_(1e3)
    spatial, decay = module()
    assert (spatial >= 0).all() and ((decay > 0) & (decay <= 1)).all()
    with torch.no_grad():
        module.decay_logit.sub_(1e4)
    assert (module()[1] > 0).all()
