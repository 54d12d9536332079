"""Launch checks and sharded training: what :mod:`mhla_gen.train.loop` asks before and after Accelerate
starts, so that a run is either really distributed the way it was launched or refused in one line.

- :func:`check_launcher` (before the ``Accelerator``): DeepSpeed is refused (see below).
- :func:`check_fsdp` (after): an FSDP launch that Accelerate would run unsharded is refused.
- :func:`check_world_size` (after): a launch that asked for several processes but runs one is refused:
  torchrun / ``accelerate launch --multi_gpu`` set ``WORLD_SIZE``; ``accelerate launch --num_processes N``
  without a multi-process backend (``--cpu``, a ``MULTI_CPU`` config without MPI) starts ONE process with
  only ``MASTER_ADDR`` set (its "simple launcher" exports it when ``num_processes > 1``), so
  ``MASTER_ADDR`` without ``WORLD_SIZE`` in a process Accelerate launched is that case.
- :func:`set_fsdp_units`: FSDP2 per-block wrapping. Each task names its blocks; DiT also names
  ``CombinedTimestepLabelEmbeddings``, because diffusers' ``DiTTransformer2DModel.forward`` calls
  ``transformer_blocks[0].norm1.emb`` outside block 0 (for the output modulation): with block 0 sharded on
  its own, that call meets sharded weights ("got mixed torch.Tensor and DTensor"). As its own FSDP unit
  the embedding gathers its weights wherever it is called. Stock diffusers DiT is the same model, so this
  is a wrapping choice, not a patch.
- :class:`GatheredEMA`: diffusers' ``EMAModel`` on sharded parameters keeps a sharded EMA (each rank the
  EMA of its own shard: memory 1/N of the model per rank, like the weights); its checkpoint gathers the
  full EMA one tensor at a time onto rank 0's CPU (rank 0 needs host RAM for one fp32 copy of the
  trainable parameters while saving), and resume gives every rank its shard back.

DeepSpeed: ``accelerator.save_state`` / ``get_state_dict`` under ZeRO-3 need DeepSpeed's own gather
(``zero_gather_16bit_weights_on_model_save``) and its engine owns the optimizer, LR scheduler and
gradient clipping; nothing of that is tested here (DeepSpeed does not run on CPU), so a DeepSpeed launch
is refused at start-up instead of writing a ``final/`` that might hold one rank's partition.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType
from diffusers.training_utils import EMAModel

from ..errors import ConfigError

# environment variables through which MPI launchers give the world size (Accelerate's MULTI_CPU reads them)
_MPI_WORLD = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
CPU_LAUNCH = "ACCELERATE_USE_CPU=true torchrun --nproc_per_node {n} scripts/<script>.py ..."


def check_launcher(env=os.environ) -> None:
    """Before the ``Accelerator`` exists: a DeepSpeed launch (``ACCELERATE_USE_DEEPSPEED=true``, what
    ``accelerate launch`` with a DeepSpeed config or ``--use_deepspeed`` exports) is refused."""
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(
            "DeepSpeed (ZeRO-2/3) is not supported by this training loop (its final/, EMA and resume are "
            "untested under ZeRO); launch with configs/accelerate/fsdp.yaml (FSDP2, sharded) or ddp.yaml"
        )


def launcher_precision_note(mixed_precision: str, env=os.environ) -> str | None:
    """What to warn when the launcher asked for another precision than ``train.mixed_precision``
    (``accelerate launch --mixed_precision X`` or its config file export ``ACCELERATE_MIXED_PRECISION``):
    the loop passes the run's setting to the ``Accelerator``, which then overrides the launcher's without
    a word. None when they agree or the launcher said nothing."""
    launched = env.get("ACCELERATE_MIXED_PRECISION", "").lower()
    if not launched or launched == mixed_precision:
        return None
    return (f"accelerate launch asked for mixed precision {launched!r}; this run trains with "
            f"train.mixed_precision={mixed_precision} (the run's config decides; give "
            f"train.mixed_precision={launched} to follow the launcher)")


def check_world_size(accelerator, env=os.environ, script: str = "scripts/<script>.py") -> None:
    """Fail fast when the launch asked for several processes but Accelerate runs this one alone (each
    would train or sample as rank 0 into the same output_dir, or one process would do the work of N).
    ``accelerator``: an ``Accelerator`` or a ``PartialState``; ``script``: the command the advice names."""
    if accelerator.num_processes > 1:
        return
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        launch = CPU_LAUNCH.format(n=world).replace("scripts/<script>.py", script)
        raise ConfigError(
            f"WORLD_SIZE={world} but Accelerate sees a single process ({accelerator.distributed_type}): "
            f"each process would work alone into the same output_dir. On CPU, launch with "
            f"`{launch}` (gloo); the DDP and FSDP launch configs need one GPU per process"
        )
    launched = "ACCELERATE_DYNAMO_BACKEND" in env  # exported by every `accelerate launch`
    mpi = any(k in env for k in _MPI_WORLD)
    if launched and "MASTER_ADDR" in env and "WORLD_SIZE" not in env and not mpi:
        raise ConfigError(
            "accelerate launch was asked for several processes but started only this one (e.g. "
            "`accelerate launch --cpu --num_processes 2`, or a MULTI_CPU config without MPI): on CPU use "
            f"`{CPU_LAUNCH.format(n=2)}` or `ACCELERATE_USE_CPU=true accelerate launch --multi_gpu "
            "--num_processes 2 ...`; for one process drop --num_processes (and unset MASTER_ADDR if your "
            "shell exports it)"
        )


def check_fsdp(accelerator, env=os.environ) -> None:
    """A launch that asks for FSDP (``ACCELERATE_USE_FSDP=true``: ``accelerate launch`` with an FSDP config)
    must run sharded: Accelerate turns FSDP on only for GPU-type backends and otherwise drops the plugin
    without a word (``ACCELERATE_USE_CPU=true`` keeps ``MULTI_CPU``: the run would train as DDP, each rank
    holding the whole model)."""
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or is_sharded(accelerator):
        return
    kind = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    raise ConfigError(
        f"the launch asks for FSDP (ACCELERATE_USE_FSDP=true, an FSDP accelerate config) but Accelerate runs "
        f"this as {kind} on {accelerator.device}, unsharded (FSDP through Accelerate needs one GPU per "
        f"process); on CPU launch without the FSDP config (`{CPU_LAUNCH.format(n=accelerator.num_processes)}`"
        f", DDP), or run on GPUs"
    )


def is_sharded(accelerator) -> bool:
    """FSDP: no process holds the whole model (sample grids skipped while training, final/ gathered)."""
    return accelerator.distributed_type == DistributedType.FSDP


def set_fsdp_units(accelerator, unit_classes: list[str], required: list[str]) -> list[str] | None:
    """FSDP2 with ``TRANSFORMER_BASED_WRAP``: the class names wrapped as their own units. The launch
    config's ``fsdp_transformer_layer_cls_to_wrap`` when given (plus ``required``), else the task's
    ``unit_classes``, else the model's ``_no_split_modules`` (Accelerate's default). Returns the names set
    (None: another wrap policy, or Accelerate's default)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy is not transformer_auto_wrap_policy:
        return None
    names = list(plugin.transformer_cls_names_to_wrap or unit_classes)
    if not names:  # Accelerate wraps the model's own _no_split_modules (SANA's and Wan's blocks)
        return None
    names += [name for name in required if name not in names]
    plugin.transformer_cls_names_to_wrap = names
    return names


def _full(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor of a DTensor shard (a collective: every rank calls it), on the CPU where kept."""
    if hasattr(tensor, "full_tensor"):
        full = tensor.full_tensor()
        return full.cpu() if keep else None
    return tensor


class GatheredEMA(EMAModel):
    """diffusers' ``EMAModel`` whose checkpoint holds full tensors, also when the parameters it follows
    are FSDP2 shards (DTensors): ``state_dict`` gathers (every rank calls it, as ``save_state`` does; the
    main process keeps the gathered copy), ``load_state_dict`` cuts every rank's shard back out of it."""

    def state_dict(self) -> dict:
        from accelerate.state import PartialState

        keep = PartialState().is_main_process
        return {**super().state_dict(), "shadow_params": [_full(p, keep) for p in self.shadow_params]}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = list(self.shadow_params)
        super().load_state_dict(state_dict)
        shard = lambda full, now: distribute_tensor(  # no communication: every rank read the whole file
            full.to(now.device, now.dtype), now.device_mesh, now.placements, src_data_rank=None
        )
        self.shadow_params = [
            shard(full, now) if isinstance(now, DTensor) else full.to(now.device)
            for full, now in zip(self.shadow_params, current)
        ]
