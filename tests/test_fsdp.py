"""MHLA export / import on FSDP2-sharded models: 2 real CPU processes (gloo), ``fully_shard`` on a
``init_device_mesh("cpu", (2,))``. Public API only (install_mhla, mhla_parameters, save/load_mhla_parameters,
load_transformer)."""

from __future__ import annotations

import pytest
import torch

WORLD = 2


def _cases() -> list[str]:
    from mhla_gen.bases import BASES

    return sorted(BASES)  # every base record, through its test reference (record.tiny)


def _model(case: str, seed: int):
    """The record's tiny model with its test MHLA config on blocks ``(1, ..., 1, 3)`` (a 3x3 mixing matrix
    shards 2 + 1 rows; CPE and gate on), MHLA parameters moved off their init by ``seed``; the rest
    depends on seed 0 only."""
    import dataclasses

    from mhla_gen import install_mhla, mhla_parameters
    from mhla_gen.bases import BASES

    tiny = BASES[case].tiny.load()
    cfg = dataclasses.replace(tiny.mhla, blocks=(1,) * (len(tiny.latent) - 1) + (3,))
    model = install_mhla(tiny.model(), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mhla_parameters(model).values():
            p.copy_(torch.rand(p.shape, generator=g) * 0.5 + 0.1)
    return model.eval()


def _forward(case: str, model) -> torch.Tensor:
    from mhla_gen.bases import BASES

    with torch.no_grad():
        return BASES[case].tiny.load().output(model)


def _shard(case: str, model, mesh):
    """FSDP2 units as the record's training task names them (DiT: its blocks and the label embedder its
    forward calls outside block 0), else the transformer blocks; inner units first, then the model."""
    from torch.distributed.fsdp import fully_shard

    from mhla_gen.bases import BASES

    record = BASES[case]
    units = set(record.task.load().fsdp_units) if record.trains else set()
    named = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in units]
    if not named:
        blocks = model.transformer_blocks if hasattr(model, "transformer_blocks") else model.blocks
        named = [(str(i), block) for i, block in enumerate(blocks)]
    for _, module in sorted(named, key=lambda item: -item[0].count(".")):
        fully_shard(module, mesh=mesh)
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
        for case in _cases():
            file = f"{root}/{case}_mhla.safetensors"
            reference = _model(case, seed=1)  # unsharded, on every rank
            expected = {k: p.detach().clone() for k, p in mhla_parameters(reference).items()}
            expected_out = _forward(case, reference)
            if rank == 0:
                reference.save_pretrained(f"{root}/{case}_full")
            dist.barrier()

            # save from a sharded model: gathered, written once, equal to the unsharded parameters
            sharded = _shard(case, _model(case, seed=1), mesh)
            mixing = next(p for k, p in mhla_parameters(sharded).items() if k.endswith("mixing.weight"))
            assert mixing.to_local().shape[0] == (2 if rank == 0 else 1)  # 3 rows over 2 ranks
            save_mhla_parameters(sharded, file)  # every rank: collective gather, rank 0 writes
            saved = load_file(file)  # visible on every rank once the call returned
            assert saved.keys() == expected.keys()
            assert all(torch.equal(saved[k], expected[k]) for k in expected)

            # load into a sharded model with other MHLA values: every shard gets its part of the file
            target = _shard(case, _model(case, seed=2), mesh)
            assert not all(torch.equal(v, expected[k]) for k, v in _full(mhla_parameters(target)).items())
            load_mhla_parameters(target, file)
            loaded = _full(mhla_parameters(target))
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)
            assert torch.equal(_forward(case, target), expected_out)

            # load_transformer gives a full model: sharding it afterwards keeps the MHLA parameters
            resharded = _shard(case, load_transformer(f"{root}/{case}_full"), mesh)
            loaded = _full(mhla_parameters(resharded))
            assert all(torch.equal(loaded[k], expected[k]) for k in expected)

            # or a save_pretrained folder straight into a sharded model: DCP's set_model_state_dict
            target = _shard(case, _model(case, seed=3), mesh)
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
    """save_mhla_parameters on a fully_shard-ed model of every base record (2 gloo ranks) writes exactly
    the unsharded model's MHLA parameters; load_mhla_parameters, load_transformer + fully_shard and DCP's
    set_model_state_dict put them back into sharded models exactly (parameters and outputs)."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
