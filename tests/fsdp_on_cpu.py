"""A training script with Accelerate's FSDP forced onto CPU gloo ranks (test only).

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/fsdp_on_cpu.py CONFIG.yaml SCRIPT.py ARGS...

Accelerate refuses FSDP on CPU: ``AcceleratorState`` keeps ``MULTI_CPU`` and drops the FSDP plugin that
``ACCELERATE_USE_FSDP`` / ``FSDP_*`` made. FSDP2 itself (``fully_shard``) runs on a gloo CPU mesh, so this
shim does what a GPU launch does and nothing else: it exports the environment ``accelerate launch
--config_file CONFIG.yaml`` would (Accelerate's own ``prepare_multi_gpu_env``), and after
``AcceleratorState`` is set up it puts the distributed type to ``FSDP`` with that plugin (Accelerate's own
tests switch the state the same way, through its environment and ``AcceleratorState`` internals). Then the
script's ``main`` runs unchanged, with the same one-line errors, and the rank leaves without gloo's
teardown (tests/gloo_rank.py). Used by tests/test_train_fsdp.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import accelerate.state
from accelerate.utils import DistributedType
from gloo_rank import exit_without_teardown, run_script


def fsdp_env(config_file: str) -> dict[str, str]:
    """``FSDP_*`` / ``ACCELERATE_*`` variables of an accelerate config file, as ``accelerate launch`` sets
    them (through Accelerate's own launch-argument code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", config_file, "--mixed_precision", "no", "x.py"]  # CPU: fp32
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_USE_FSDP"))}


def force_fsdp_state() -> None:
    """After Accelerate's state is set up as MULTI_CPU with an FSDP plugin, make it FSDP."""
    state_cls = accelerate.state.AcceleratorState
    original = state_cls.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    state_cls.__init__ = init


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("accelerate_config")
    parser.add_argument("script")
    args, rest = parser.parse_known_args(argv)
    os.environ.update(fsdp_env(args.accelerate_config))
    force_fsdp_state()
    run_script(args.script, rest)


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_without_teardown()
