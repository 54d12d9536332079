"""CPE (depthwise conv of V on the token grid) and output gating."""

import pytest
import torch
import torch.nn.functional as F

from mhla_gen import ConvPositionEncoding, OutputGate


@pytest.mark.parametrize("grid", [(4, 6), (3, 4, 5)])
def test_cpe_starts_at_zero(grid):
    n = torch.Size(grid).numel()
    cpe = ConvPositionEncoding(channels=8, kernel_size=3, ndim=len(grid))
    v = torch.randn(2, n, 8)
    out = cpe(v, grid)
    assert out.shape == v.shape
    assert torch.equal(out, torch.zeros_like(out))  # attention + CPE == attention at install time


@pytest.mark.parametrize("grid, kernel", [((4, 6), 3), ((5, 5), 5), ((3, 4, 5), 3)])
def test_cpe_is_a_depthwise_conv_on_the_grid(grid, kernel):
    channels, n = 6, torch.Size(grid).numel()
    cpe = ConvPositionEncoding(channels, kernel, ndim=len(grid))
    with torch.no_grad():
        cpe.conv.weight.normal_()
        cpe.conv.bias.normal_()
    v = torch.randn(2, n, channels)
    # by hand: tokens are row-major over the grid, channels last
    image = v.reshape(2, *grid, channels).movedim(-1, 1)
    conv = F.conv2d if len(grid) == 2 else F.conv3d
    expected = conv(image, cpe.conv.weight, cpe.conv.bias, padding=kernel // 2, groups=channels)
    expected = expected.movedim(1, -1).reshape(2, n, channels)
    torch.testing.assert_close(cpe(v, grid), expected)
    # depthwise: channel c of the output only depends on channel c of the input
    v2 = v.clone()
    v2[..., 0] += 1.0
    diff = (cpe(v2, grid) - cpe(v, grid)).abs().amax(dim=(0, 1))
    assert diff[0] > 0 and torch.all(diff[1:] == 0)


def test_cpe_bad_arguments_raise():
    with pytest.raises(ValueError, match="4"):
        ConvPositionEncoding(8, 4)
    with pytest.raises(ValueError, match="ndim=1"):
        ConvPositionEncoding(8, 3, ndim=1)
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        ConvPositionEncoding(8, 3, ndim=2)(torch.zeros(1, 8, 8), (2, 2, 2))


@pytest.mark.parametrize("activation, act", [("sigmoid", torch.sigmoid), ("silu", F.silu)])
def test_gate(activation, act):
    gate = OutputGate(in_dim=5, out_dim=6, activation=activation)
    out, x = torch.randn(2, 7, 6), torch.randn(2, 7, 5)
    torch.testing.assert_close(gate(out, x), out, atol=5e-3 * out.abs().max().item(), rtol=0)  # ≈ 1 at init
    with torch.no_grad():
        gate.proj.weight.normal_()
    torch.testing.assert_close(gate(out, x), out * act(x @ gate.proj.weight.T + gate.proj.bias))
    assert gate(out.half(), x).dtype == torch.float16


def test_gate_unknown_activation_raises():
    with pytest.raises(ValueError, match="'tanh'"):
        OutputGate(4, 4, activation="tanh")
