"""DiT / SANA MHLA processors against diffusers' own processors and the dense MHLA oracle."""

import pytest
import torch
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

from mhla_gen import BlockLayout, MHLAConfig, install_mhla, mhla_parameters
from mhla_gen.ops.naive import mhla_dense
from mhla_gen.processors.dit import DiTMHLAProcessor
from mhla_gen.processors.grid import image_token_grid
from mhla_gen.processors.sana import SanaMHLAProcessor
from mhla_gen.testing import tiny_dit, tiny_sana


def dit_inputs(batch=2, size=8):
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(batch, 4, size, size, generator=g),
        timestep=torch.tensor([10, 700][:batch]),
        class_labels=torch.tensor([3, 7][:batch]),
    )


def sana_inputs(batch=2, size=8):
    g = torch.Generator().manual_seed(2)
    return dict(
        hidden_states=torch.randn(batch, 4, size, size, generator=g),
        encoder_hidden_states=torch.randn(batch, 5, 16, generator=g),
        timestep=torch.tensor([10.0, 700.0][:batch]),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sana_single_block_equals_stock_linear_attention(dtype):
    """One block, no extras, eps 1e-15: diffusers' SanaLinearAttnProcessor2_0 with SANA's q/k RMSNorm across
    heads, equal up to the rounding of the same sums taken in another memory order. fp32: SANA takes
    ``[V 1]ᵀ φ(K)`` from its channels-first value, MHLA from its block-major copy, so the attention output
    differs in the last bit. fp16: the attention runs in fp32 in both and agrees exactly, but SANA hands
    ``to_out`` a transposed (channels-first) operand and MHLA a heads-interleaved one, so the fp16 GEMMs
    round differently. Measured (torch 2.15): two fp32 ulps, one fp16 ulp, at the scale of the largest
    outputs; the tolerance is four ulps."""
    model = tiny_sana(qk_norm="rms_norm_across_heads").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights of both signs: with all ones, dropping norm_q changes nothing
        for block in model.transformer_blocks:  # (the normalised output ignores a per-token scale of q)
            for norm in (block.attn1.norm_q, block.attn1.norm_k):
                norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen))
    model = model.to(dtype)
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sana_inputs().items()}
    assert all(isinstance(b.attn1.processor, SanaLinearAttnProcessor2_0) for b in model.transformer_blocks)
    with torch.no_grad():
        stock = model(**x).sample
        install_mhla(model, MHLAConfig(blocks=(1, 1), eps=1e-15))
        assert all(isinstance(b.attn1.processor, SanaMHLAProcessor) for b in model.transformer_blocks)
        ours = model(**x).sample
    assert ours.dtype == dtype
    scale = 2 ** stock.abs().max().log2().floor()  # the power of two below the largest output
    ulp = float(torch.finfo(dtype).eps * scale)
    torch.testing.assert_close(ours, stock, rtol=0, atol=4 * ulp)


def test_sana_cross_attention_stays_stock():
    model = tiny_sana()
    stock_cross = [type(b.attn2.processor) for b in model.transformer_blocks]
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    assert [type(b.attn2.processor) for b in model.transformer_blocks] == stock_cross


def _capture_attn1_io(model, inputs):
    """Inputs and outputs of the first attn1 call (its processor's kernel input and result)."""
    seen = {}
    attn = model.transformer_blocks[0].attn1
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return attn, seen["x"], seen["out"]


@pytest.mark.parametrize("factory, inputs", [(tiny_dit, dit_inputs), (tiny_sana, sana_inputs)])
def test_processor_matches_dense_oracle(factory, inputs):
    """attn1 output == to_out(dense MHLA(to_q x, to_k x, to_v x)) on an uneven 5x5-ish grid."""
    model = factory().eval()
    install_mhla(model, MHLAConfig(blocks=(2, 3)))
    for p in mhla_parameters(model).values():  # a non-init mixing matrix
        p.data.uniform_(0.0, 1.0)
    x_in = inputs(size=10)
    attn, x, out = _capture_attn1_io(model, x_in)
    grid = image_token_grid(model, x_in["hidden_states"])
    b, n, _ = x.shape
    q, k, v = (p(x).view(b, n, attn.heads, -1).transpose(1, 2) for p in (attn.to_q, attn.to_k, attn.to_v))
    layout = BlockLayout(grid, (2, 3))
    dense = mhla_dense(q.double(), k.double(), v.double(), layout, attn.processor.mixing.weight.double())
    expected = attn.to_out[0](dense.transpose(1, 2).reshape(b, n, -1).float())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_dit_processor_keeps_stock_conventions():
    """residual_connection and rescale_output_factor are applied exactly as AttnProcessor2_0 does."""
    model = tiny_dit().eval()
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    attn, x, out = _capture_attn1_io(model, dit_inputs())
    attn.residual_connection, attn.rescale_output_factor = True, 2.0
    with torch.no_grad():
        rescaled = attn(x)
    torch.testing.assert_close(rescaled, (out + x) / 2.0)


@pytest.mark.parametrize("factory, inputs", [(tiny_dit, dit_inputs), (tiny_sana, sana_inputs)])
def test_gradients_reach_every_mhla_parameter(factory, inputs):
    model = factory()
    install_mhla(model, MHLAConfig(blocks=(2, 2), cpe_kernel=3, gate=True))
    params = mhla_parameters(model)
    assert any(".cpe." in n for n in params) and any(".gate." in n for n in params)
    # CPE starts at zero and the gate's projection at zero: perturb so every path carries gradient
    for p in params.values():
        p.data.add_(0.05 * torch.rand_like(p))
    model(**inputs()).sample.square().mean().backward()
    for name, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_processor_rejects_masks_and_cross_attention():
    model = tiny_dit()
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    attn = model.transformer_blocks[0].attn1
    assert isinstance(attn.processor, DiTMHLAProcessor)
    x = torch.randn(2, 16, 16)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(x, attention_mask=torch.ones(2, 16))
    with pytest.raises(ValueError, match="cross-attention"):
        attn(x, encoder_hidden_states=x)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision_forward_is_finite(dtype):
    model = tiny_sana().to(dtype)
    install_mhla(model, MHLAConfig(blocks=(2, 2), gate=True, cpe_kernel=3))
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sana_inputs().items()}
    with torch.no_grad():
        out = model(**x).sample
    assert out.dtype == dtype and torch.isfinite(out).all()
