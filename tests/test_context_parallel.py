"""Context parallelism for Wan MHLA (mhla_gen/ops/context_parallel.py): 2 real CPU processes (gloo), every
result compared with the 1-process computation of the same model / inputs.

* Operator: ``mhla_shard`` on an odd sequence (45 tokens -> 23 + 22, so a rank boundary cuts blocks in
  the middle) against the dense float64 oracle, outputs and gradients of q, k, v and W.
* Model: a tiny hybrid Wan (layer 0 stock softmax via diffusers' Ulysses on the native backend, layers
  1-2 MHLA with CPE and gate, uneven blocks) under ``enable_parallelism(ContextParallelConfig(
  ulysses_degree=2))``: output, the input latent's gradient and every parameter gradient (summed over
  the ranks: each rank's are the partial gradients of its own tokens) equal the 1-process run within
  1e-5 in fp32 (of each tensor's largest entry where that exceeds 1: the summed gradients reach ~60 and
  differ from the 1-process ones in float rounding, stock parameters such as ``patch_embedding``
  included). Both RoPE placements; MHLA installed before and after ``enable_parallelism``. The same for
  Wan2.1 I2V (36 channels, CLIP tokens in the cross-attention, not split) and Wan2.2 TI2V-5B (48 channels,
  one timestep per token, split with the tokens); a Wan2.2 A14B expert is the T2V architecture.
* Which bases have a plan at all: diffusers 0.42 has none for DiT, SANA and SANA-Video (no sharded path);
  ``mhla_gen.ops.context_parallel.enable_context_parallelism`` refuses those in one line, before diffusers.

diffusers 0.42.1 needs an even split here: its ``*_anything`` modes (uneven sequences) gather pieces of
different sizes, which gloo does not support, and ring attention on the native backend needs an LSE it
does not return. MHLA's own uneven split is covered by the operator part.

One spawn runs all cases; the tests read its per-case errors.
"""

from __future__ import annotations

import json
from datetime import timedelta
from unittest import mock

import pytest
import torch

from mhla_gen.bases import BASES

WORLD = 2
TOL = 1e-5
OP_CASES = {  # name: (normalize, separate normaliser features as in after_phi_numerator)
    "op_normalize": (True, False),
    "op_no_normalize": (False, False),
    "op_split_normaliser": (True, True),
}
MODEL_CASES = {  # name: (MHLAConfig overrides, install MHLA after enable_parallelism, Wan variant)
    "wan_before_phi": (dict(wan_rope="before_phi"), False, "t2v"),
    "wan_after_phi_head_norm": (
        dict(wan_rope="after_phi_numerator", normalize=False, wan_head_norm=True, feature_map="relu+1e-6"),
        True,
        "t2v",
    ),
    "wan21_i2v": (dict(wan_rope="before_phi"), False, "i2v"),
    "wan22_ti2v": (dict(wan_rope="before_phi"), False, "ti2v"),
}
VARIANTS = {  # transformer overrides of tiny_wan_transformer (a Wan2.2 A14B expert is the t2v architecture)
    "t2v": {},
    # Wan2.1 I2V: 36 channels in, CLIP image tokens in the cross-attention (not split: diffusers' plan)
    "i2v": dict(in_channels=36, image_dim=8, added_kv_proj_dim=24),
    # Wan2.2 TI2V-5B: 48 channels, one timestep per token (expand_timesteps), split with the tokens
    "ti2v": dict(in_channels=48, out_channels=48),
}
LATENT_SHAPE = (2, 16, 3, 6, 12)  # token grid (3, 3, 6): 54 tokens, 27 per rank (mid-frame, mid-row)
BLOCKS = (2, 2, 4)  # uneven on every axis


def _op_case(rank: int, normalize: bool, split_normaliser: bool) -> dict[str, float]:
    import torch.distributed as dist

    from mhla_gen.ops.context_parallel import TokenShard, mhla_shard
    from mhla_gen.ops.layout import BlockLayout, split_sizes
    from mhla_gen.ops.naive import mhla_dense

    grid, blocks = (3, 3, 5), (2, 2, 3)
    layout = BlockLayout(grid, blocks)
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, layout.num_tokens, 4
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    mixing = torch.rand(layout.num_blocks, layout.num_blocks, generator=g, dtype=torch.float64)
    weight = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)  # loss = Σ out * weight
    # separate normaliser features: the numerator's are rotated (signed), the normaliser's are φ itself
    rotate = torch.randn(d, d, generator=g, dtype=torch.float64)

    def features(x):
        fx = torch.relu(x)
        return (fx @ rotate, fx) if split_normaliser else (fx, fx)

    # 1 process: the dense oracle on the whole sequence
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mixing)]
    (fq, fq_norm), (fk, fk_norm) = features(leaves[0]), features(leaves[1])
    block_mix = leaves[3][layout.block_index][:, layout.block_index]
    expected = ((fq @ fk.mT) * block_mix) @ leaves[2]
    if normalize:
        expected = expected / (((fq_norm @ fk_norm.mT) * block_mix).sum(-1, keepdim=True) + 1e-6)
    (expected * weight).sum().backward()
    expected_grads = [t.grad for t in leaves]
    if not split_normaliser:  # the formula above is the repository's dense oracle
        torch.testing.assert_close(expected.detach(), mhla_dense(q, k, v, layout, mixing, "relu", normalize))

    # 2 processes: each holds its tensor_split piece (23 + 22 tokens)
    sizes = tuple(split_sizes(n, WORLD))
    start = sum(sizes[:rank])
    shard = TokenShard(start, start + sizes[rank], n, sizes, dist.group.WORLD)
    own = slice(shard.start, shard.end)
    local = [t[:, :, own].clone().requires_grad_() for t in (q, k, v)]
    w = mixing.clone().requires_grad_()
    (fq, fq_norm), (fk, fk_norm) = features(local[0]), features(local[1])
    extra = dict(q_norm_features=fq_norm, k_norm_features=fk_norm) if split_normaliser else {}
    out = mhla_shard(fq, fk, local[2], grid, blocks, w, normalize, 1e-6, shard=shard, **extra)
    (out * weight[:, :, own]).sum().backward()

    errors = {"out": (out - expected[:, :, own].detach()).abs().max().item()}
    for name, t, ref in zip("qkv", local, expected_grads):
        errors[f"grad_{name}"] = (t.grad - ref[:, :, own]).abs().max().item()
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w)  # each rank's W gradient covers its own queries
    errors["grad_mixing"] = (grad_w - expected_grads[3]).abs().max().item()
    return errors


def _wan(overrides: dict, install_after: bool, parallel: bool, variant: str = "t2v"):
    """Tiny hybrid Wan (3 layers, softmax in layer 0, MHLA in 1-2, CPE + gate), MHLA parameters moved off
    their init; identical on every rank and in both runs (all weights from fixed seeds)."""
    from diffusers import ContextParallelConfig

    from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
    from mhla_gen.testing.wan import tiny_wan_transformer

    cfg = MHLAConfig(blocks=BLOCKS, layers=[1, 2], cpe_kernel=3, gate=True, **overrides)
    model = tiny_wan_transformer(seed=0, **VARIANTS[variant])
    if parallel and install_after:
        _enable_parallelism(model, ContextParallelConfig(ulysses_degree=WORLD))
    install_mhla(model, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.copy_(
                torch.rand(p.shape, generator=g) * 0.5 + 0.1
                if p.dim() == 2
                else torch.randn(p.shape, generator=g)
            )
    if parallel and not install_after:
        _enable_parallelism(model, ContextParallelConfig(ulysses_degree=WORLD))
    return model


def _enable_parallelism(model, config) -> None:
    """mhla_gen's entry (the record's capability checked, then diffusers' ``enable_parallelism``)."""
    from mhla_gen.ops.context_parallel import enable_context_parallelism

    # diffusers 0.42.1 picks the rank's device as `rank % torch.accelerator.device_count()`, which is
    # 0 on a CPU-only machine (ZeroDivisionError); on GPUs nothing needs patching.
    with mock.patch("torch.accelerator.device_count", return_value=1):
        enable_context_parallelism(model, config)


def _run_wan(model, latent, conditioning: dict, weight) -> tuple[torch.Tensor, torch.Tensor, dict]:
    latent = latent.clone().requires_grad_()
    out = model(latent, **conditioning, return_dict=False)[0]  # as the pipelines call it
    (out * weight).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), latent.grad, grads


def _conditioning(variant: str, g: torch.Generator) -> dict:
    """Timestep and text (I2V: 512 text tokens, as its cross-attention assumes, and 5 CLIP tokens; TI2V: one
    timestep per token, the first latent frame clean)."""
    from mhla_gen.testing.wan import TEXT_DIM

    batch, tokens = LATENT_SHAPE[0], 54
    text = torch.randn(batch, 512 if variant == "i2v" else 7, TEXT_DIM, generator=g)
    conditioning = dict(timestep=torch.tensor([300, 700]), encoder_hidden_states=text)
    if variant == "i2v":
        conditioning["encoder_hidden_states_image"] = torch.randn(batch, 5, 8, generator=g)
    if variant == "ti2v":
        timestep = torch.tensor([[300.0], [700.0]]).expand(batch, tokens).clone()
        timestep[:, :18] = 0.0  # the first latent frame (3 x 6 tokens) kept clean
        conditioning["timestep"] = timestep
    return conditioning


def _model_case(rank: int, overrides: dict, install_after: bool, variant: str) -> dict[str, float]:
    import torch.distributed as dist

    from mhla_gen.integration.install import mhla_processors

    g = torch.Generator().manual_seed(2)
    channels = dict(t2v=16, i2v=36, ti2v=48)[variant]
    latent = torch.randn(LATENT_SHAPE[0], channels, *LATENT_SHAPE[2:], generator=g)
    conditioning = _conditioning(variant, g)
    out_shape = (LATENT_SHAPE[0], 48 if variant == "ti2v" else 16, *LATENT_SHAPE[2:])
    weight = torch.randn(out_shape, generator=g)

    expected, expected_latent_grad, expected_grads = _run_wan(
        _wan(overrides, install_after, False, variant), latent, conditioning, weight
    )

    model = _wan(overrides, install_after, True, variant)
    processors = list(mhla_processors(model).values())
    assert len(processors) == 2 and all(p._parallel_config is not None for p in processors)
    seen = []  # the sequence length an MHLA layer really gets: half of the 54 tokens
    model.blocks[1].attn1.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    out, latent_grad, grads = _run_wan(model, latent, conditioning, weight)
    assert seen == [27], seen

    def error(x, ref):  # max |x - ref|, relative to ref's largest entry once that exceeds 1
        return ((x - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()

    errors = {"out": error(out, expected)}
    dist.all_reduce(latent_grad)  # each rank's covers its own tokens: the sum is the whole gradient
    errors["grad_latent"] = error(latent_grad, expected_latent_grad)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        grad = grad.clone()
        dist.all_reduce(grad)  # the partial gradients of each rank's own tokens add up
        errors[f"grad_{name}"] = error(grad, expected_grads[name])
    errors["grad_scale"] = max(t.abs().max().item() for t in expected_grads.values())
    return errors


def _worker(rank: int, store: str, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    try:
        assert dist.get_world_size() == WORLD and dist.get_rank() == rank
        results = {name: _op_case(rank, *case) for name, case in OP_CASES.items()}
        results.update({name: _model_case(rank, *case) for name, case in MODEL_CASES.items()})
        with open(f"{root}/errors_{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict[str, dict[str, float]]:
    """Per case and quantity, the largest deviation from the 1-process result over both ranks."""
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("context_parallel")
    mp.spawn(_worker, args=(str(root / "store"), str(root)), nprocs=WORLD, join=True)
    per_rank = [json.loads((root / f"errors_{rank}.json").read_text()) for rank in range(WORLD)]
    return {
        case: {key: max(r[case][key] for r in per_rank) for key in per_rank[0][case]} for case in per_rank[0]
    }


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_sharded_operator_matches_whole_sequence(errors, case):
    """Uneven split (23 + 22 tokens): outputs and gradients of q, k, v, W equal the dense oracle."""
    assert set(errors[case]) == {"out", "grad_q", "grad_k", "grad_v", "grad_mixing"}
    assert all(err < 1e-12 for err in errors[case].values()), errors[case]


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_wan_context_parallel_matches_one_process(errors, case):
    """Hybrid tiny Wan on 2 ranks == 1 process: output, latent gradient, every parameter gradient."""
    result = errors[case]
    assert result["grad_scale"] > 1e-2  # the gradients compared are not trivially small
    assert sum(key.endswith("processor.mixing.weight") for key in result) == 2  # both MHLA layers
    assert len(result) > 100  # every parameter of the model
    for key, err in result.items():
        if key != "grad_scale":
            assert err < TOL, (key, err, result)


def test_communication_formulas_for_the_readme_table():
    """The README's per-layer volumes for Wan2.1-1.3B at 480x832x81 (grid (21, 30, 52), blocks (3, 5, 10))."""
    from mhla_gen.ops.context_parallel import communication_per_layer

    mb = {p: communication_per_layer(2, 12, 128, (21, 30, 52), (3, 5, 10), p) for p in (2, 4, 8)}
    assert mb[2]["summary_buffer"] == 2 * 12 * 150 * 128 * 129 * 4  # B H M d (d+1) fp32
    table = {p: [round(v[k] / 1e6) for k in ("mhla", "mhla_cpe", "ulysses", "ring")] for p, v in mb.items()}
    assert table == {2: [238, 101, 201, 201], 4: [357, 151, 151, 302], 8: [416, 176, 88, 352]}


@pytest.mark.parametrize("name", sorted(BASES))
def test_context_parallelism_is_refused_in_one_line_where_diffusers_has_no_plan(name):
    """A base without the capability: mhla_gen's one-line refusal naming the diffusers class, before
    diffusers is reached (no process group is needed for it, and the model is untouched).
    A base with it goes on to diffusers (whose own check asks for the process group the 2-rank runs
    above set up)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    base, tiny = BASES[name], BASES[name].tiny.load()
    model = tiny.model()
    assert not dist.is_initialized()
    with pytest.raises((ValueError, RuntimeError)) as refused:
        _enable_parallelism(model, ContextParallelConfig(ulysses_degree=WORLD))
    message = str(refused.value)
    ours = f"context parallelism: {base.class_name} has no diffusers context-parallel plan (_cp_plan)"
    if "context_parallel" in base.capabilities:
        assert "context parallelism:" not in message, message  # diffusers' own error, past ours
    else:
        assert message.startswith(ours) and "\n" not in message, message
        assert model._parallel_config is None


def test_which_bases_have_a_context_parallel_plan():
    """The record answers from diffusers' ``_cp_plan``: Wan (T2V, Wan2.2 experts, TI2V) and Wan I2V have
    one; DiT, SANA and SANA-Video (diffusers 0.42) have none, so they run unsharded."""
    assert {name for name, base in BASES.items() if base.context_parallel} == {"wan", "wan-i2v"}
