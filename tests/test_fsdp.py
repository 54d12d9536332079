"""MHLA export / import on FSDP2-sharded models: 2 real CPU processes (gloo), ``fully_shard`` on a
``init_device_mesh("cpu", (2,))``. Public API only (install_mhla, mhla_parameters, save/load_mhla_parameters,
load_transformer)."""

from __future__ import annotations

import pytest
import torch

WORLD = 2
CASES = ("sana", "wan")


def _model(case: str, seed: int):
    """A tiny SANA / Wan with MHLA (uneven 3-block axes, so a 3x3 mixing matrix shards 2 + 1 rows; CPE and
    gate on) whose MHLA parameters are moved off their init by ``seed``; the rest depends on seed 0 only."""
    from mhla_gen import MHLAConfig, install_mhla, mhla_parameters
    from mhla_gen.testing import tiny_sana
    from mhla_gen.testing_wan import tiny_wan_transformer

    if case == "sana":
        model = install_mhla(tiny_sana(), MHLAConfig(blocks=(1, 3), cpe_kernel=3, gate=True))
    else:
        cfg = MHLAConfig(blocks=(1, 1, 3), layers=[0, 2], cpe_kernel=3, gate=True, wan_head_norm=True)
        model = install_mhla(tiny_wan_transformer(), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.1)
    return model.eval()


def _forward(case: str, model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if case == "sana":
            x, text = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 3, 16, generator=g)
            return model(x, encoder_hidden_states=text, timestep=torch.tensor([100.0, 700.0])).sample
        from mhla_gen.testing_wan import TEXT_DIM

        x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 5, TEXT_DIM, generator=g)
        return model(x, torch.tensor([300, 700]), text).sample


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    blocks = model.transformer_blocks if hasattr(model, "transformer_blocks") else model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(params: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in params.values())  # really sharded
    return {k: p.full_tensor().detach() for k, p in params.items()}


def _worker(rank: int, store: str, root: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from mhla_gen import load_mhla_parameters, load_transformer, mhla_parameters, save_mhla_parameters

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        assert dist.get_world_size() == WORLD and dist.get_rank() == rank
        mesh = init_device_mesh("cpu", (WORLD,))
        for case in CASES:
            file = f"{root}/{case}_mhla.safetensors"
            reference = _model(case, seed=1)  # unsharded, on every rank
            expected = {k: p.detach().clone() for k, p in mhla_parameters(reference).items()}
            expected_out = _forward(case, reference)
            if rank == 0:
                reference.save_pretrained(f"{root}/{case}_full")
            dist.barrier()

            # save from a sharded model: gathered, written once, equal to the unsharded parameters
            sharded = _shard(_model(case, seed=1), mesh)
            mixing = next(p for k, p in mhla_parameters(sharded).items() if k.endswith("mixing.weight"))
            assert mixing.to_local().shape[0] == (2 if rank == 0 else 1)  # 3 rows over 2 ranks
            save_mhla_parameters(sharded, file)  # every rank: collective gather, rank 0 writes
            saved = load_file(file)  # visible on every rank once the call returned
            assert saved.keys() == expected.keys()
            assert all(torch.equal(saved[k], expected[k]) for k in expected)

            # load into a sharded model with other MHLA values: every shard gets its part of the file
            target = _shard(_model(case, seed=2), mesh)
            assert not all(torch.equal(v, expected[k]) for k, v in _full(mhla_parameters(target)).items())
            load_mhla_parameters(target, file)
            loaded = _full(mhla_parameters(target))
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)
            assert torch.equal(_forward(case, target), expected_out)

            # load_transformer gives a full model: sharding it afterwards keeps the MHLA parameters
            resharded = _shard(load_transformer(f"{root}/{case}_full"), mesh)
            loaded = _full(mhla_parameters(resharded))
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)

            # or a save_pretrained folder straight into a sharded model: DCP's set_model_state_dict
            target = _shard(_model(case, seed=3), mesh)
            full_state = (
                load_file(f"{root}/{case}_full/diffusion_pytorch_model.safetensors") if rank == 0 else {}
            )
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(target, full_state, options=options)
            loaded = _full(mhla_parameters(target))
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)
            assert torch.equal(_forward(case, target), expected_out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_save_and_load_mhla_parameters(tmp_path):
    """save_mhla_parameters on a fully_shard-ed SANA / Wan (2 gloo ranks) writes exactly the unsharded
    model's MHLA parameters; load_mhla_parameters, load_transformer + fully_shard and DCP's
    set_model_state_dict put them back into sharded models exactly (parameters and outputs)."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
