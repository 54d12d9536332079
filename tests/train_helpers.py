"""Shared by tests/test_train_*.py: run a training script in-process or as a subprocess, read results."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from script_helpers import load_script

from mhla_gen.outputs.locks import dying_with_us

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run_inprocess(script: str, *args: str) -> None:
    """``python scripts/<script> args`` in this process (Accelerate's singleton state reset around it)."""
    module = load_script(REPO / "scripts" / script, f"_script_{Path(script).stem}")
    _reset_accelerate()
    try:
        module.main(list(args))
    finally:
        _reset_accelerate()


def subprocess_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_subprocess(script: str, *args: str, timeout: int = 240):
    """Run the script in a fresh interpreter; returns the ``CompletedProcess``."""
    cmd = [PYTHON, str(REPO / "scripts" / script), *args]
    return subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def run_killed(kill: str, *args: str, timeout: int = 240):
    """scripts/train_dit.py with ``args`` in a fresh interpreter, SIGKILLed at ``kill``
    (``kill_after_step=N`` or ``kill_during_checkpoint=N``, tests/fault_injection.py)."""
    cmd = [PYTHON, str(REPO / "tests" / "fault_injection.py"), kill, *args]
    return subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def torchrun(nproc: int) -> list[str]:
    """The torchrun command up to the script: one host, ``nproc`` ranks."""
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper, which a container may lack)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def run_torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 240):
    """``ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node <nproc> scripts/<script> args``: real
    gloo processes that Accelerate joins as MULTI_CPU (``accelerate launch --cpu`` starts only one). Each
    rank runs the script's ``main`` through tests/gloo_rank.py, which skips gloo's teardown at exit."""
    cmd = [*torchrun(nproc), str(REPO / "tests" / "gloo_rank.py"), script, *args]
    env = {**subprocess_env(), "ACCELERATE_USE_CPU": "true"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=dying_with_us())  # a killed test run takes its launch with it


def final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / "final" / "diffusion_pytorch_model.safetensors"))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def read_metrics(output_dir: Path) -> list[dict]:
    from mhla_gen.train.io import read_jsonl

    return read_jsonl(Path(output_dir) / "metrics.jsonl")


def run_fsdp(script: str, *args: str, nproc: int = 2, timeout: int = 300):
    """``scripts/<script> args`` on ``nproc`` gloo ranks with Accelerate's FSDP2 forced on CPU through the
    launch config ``configs/accelerate/fsdp.yaml`` (tests/fsdp_on_cpu.py says how and why)."""
    cmd = torchrun(nproc)
    launch_config = REPO / "mhla_gen" / "configs" / "accelerate" / "fsdp.yaml"
    cmd += [str(REPO / "tests" / "fsdp_on_cpu.py"), str(launch_config), script]
    env = {**subprocess_env(), "ACCELERATE_USE_CPU": "true"}
    return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def write_captioned_videos(folder: Path, height: int = 40, width: int = 48, frames: int = 6) -> Path:
    """``folder/0.mp4``, ``1.mp4`` (random uint8 frames, seed 0, 8 fps) with ``0.txt`` / ``1.txt``
    captions "a cat runs" / "a dog swims": the captioned-video data set of the Wan / SANA-Video tests."""
    import imageio.v3 as iio
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, caption in enumerate(["a cat runs", "a dog swims"]):
        video = rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
        iio.imwrite(folder / f"{i}.mp4", video, fps=8, codec="libx264", plugin="pyav")
        (folder / f"{i}.txt").write_text(caption)
    return folder


# ------------------------------------------------------------------------------ what the records say
def tiny_config(base) -> str:
    """The file of the shipped tiny training config of ``base`` (a record or its name), its test
    reference's ``tiny_config``."""
    from mhla_gen.bases import base_for
    from mhla_gen.configs import shipped_config

    record = base_for(base) if isinstance(base, str) else base
    return str(shipped_config(record.tiny.load().tiny_config))


def training_script(base) -> str:
    """The checkout script (``scripts/<name>``, for :func:`run_inprocess` / :func:`run_fsdp`) of the command
    that trains ``base`` (a record or its name): the training command whose module's ``BASE`` it is."""
    from mhla_gen.bases import base_for
    from mhla_gen.commands import COMMANDS

    name = base if isinstance(base, str) else base.name
    for command in COMMANDS.values():
        script = command.script or ""
        if script.startswith("scripts/") and getattr(importlib.import_module(command.module), "BASE", None) \
                is base_for(name):
            return Path(script).name
    raise LookupError(f"no training command trains base {name!r}")


def one_per_kind(bases) -> list[str]:
    """The first of ``bases`` (records, in :data:`mhla_gen.bases.BASES` order) of each kind of sample and
    conditioning (``conditioning``, image or video): the end-to-end runs too slow to repeat on every base
    run on these, so a base of a new kind gets its own run."""
    chosen = {}
    for base in bases:
        chosen.setdefault((base.conditioning, base.video), base.name)
    return list(chosen.values())
