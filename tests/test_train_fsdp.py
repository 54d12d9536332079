"""FSDP2 through Accelerate for DiT, SANA and Wan on 2 CPU processes, and the launches that are refused.

Accelerate refuses FSDP on CPU, so these runs force it (tests/fsdp_on_cpu.py: the shipped
configs/accelerate/fsdp.yaml exported as ``accelerate launch`` would, then Accelerate's state switched from
MULTI_CPU to FSDP, as Accelerate's own tests switch it); everything after that (per-block ``fully_shard``,
sharded checkpoints, the gathered ``final/``) is Accelerate's and torch's real code on gloo ranks. The world
size is asserted from inside the runs (each metrics record holds Accelerate's process count), and the
per-block units from the run summary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_helpers import (
    PYTHON,
    REPO,
    final_weights,
    max_abs_diff,
    one_per_kind,
    read_metrics,
    run_fsdp,
    run_inprocess,
    subprocess_env,
    tiny_config,
    training_script,
)

from mhla_gen.bases import BASES
from mhla_gen.errors import ConfigError

DIT = tiny_config("dit")  # DiT's own per-block units and the launch refusals
# fine-tuning under FSDP, two ranks against one (about a minute a base): one base of each kind of sample
# (image, video) among those fine-tuned from captions
FSDP_FINETUNES = one_per_kind(b for b in BASES.values() if b.trains and b.conditioning == "captions")
# Adam's step lr * m / (sqrt(v) + eps) turns a rounding difference in a near-zero gradient into a step of up
# to lr; with eps = 1 it is ~ lr * g, so 2-shard vs 1-tensor sums differ by rounding (~1e-7 x |g|) only, and
# an EMA or gather mistake (a change of the size of the steps, ~1e-3 here) stands out
WELL_CONDITIONED = ("train.adam_eps=1.0", "train.learning_rate=0.1")
WEIGHT_TOL = 1e-5


def _check_two_ranks(out, steps: int) -> list[dict]:
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["num_processes"] for r in records] == [2] * steps  # world size seen inside the run
    return records


def _same_losses(a: list[dict], b: list[dict]) -> None:
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in a]), torch.tensor([r["loss"] for r in b]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_dit_fsdp2_per_block_with_ema_resumes_like_one_process(tmp_path):
    """DiT per-block FSDP2 (block 0's embedder its own unit), EMA kept per shard: 2 steps, resume to 3;
    losses and final/ (EMA weights, gathered) equal a 1-process run of 3 steps."""
    args = ("--config", DIT, "train.checkpoint_every=2", "log.sample_every=0", *WELL_CONDITIONED)
    run_inprocess("train_dit.py", *args, "train.max_steps=3", f"output_dir={tmp_path / 'one'}")
    first = run_fsdp("train_dit.py", *args, "train.max_steps=2", f"output_dir={tmp_path / 'fsdp'}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "fsdp units     BasicTransformerBlock, CombinedTimestepLabelEmbeddings" in first.stderr
    assert (tmp_path / "fsdp" / "checkpoints" / "checkpoint_2" / "pytorch_model_fsdp_0").is_dir()  # sharded
    resumed = run_fsdp("train_dit.py", *args, "train.max_steps=3", f"output_dir={tmp_path / 'fsdp'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    _same_losses(_check_two_ranks(tmp_path / "fsdp", 3), read_metrics(tmp_path / "one"))
    assert max_abs_diff(final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "one")) < WEIGHT_TOL
    assert (tmp_path / "fsdp" / "samples" / "step_0000003.png").is_file()  # end grid from the gathered model


@pytest.fixture(scope="module")
def finetune_setup(tmp_path_factory):
    """Tiny checkpoints of the bases of :data:`FSDP_FINETUNES`, 4 captioned images and 2 captioned videos."""
    import imageio.v3 as iio
    from PIL import Image

    root = tmp_path_factory.mktemp("fsdp_finetune")
    for name in FSDP_FINETUNES:
        BASES[name].tiny.load().pipeline().save_pretrained(root / name)
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    (root / "videos").mkdir()
    for i, caption in enumerate(["a red cat", "a blue dog", "a small cat", "a green dog"]):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "images" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text(caption)
    for i, caption in enumerate(["a cat runs", "a dog swims"]):
        frames = rng.integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)
        iio.imwrite(root / "videos" / f"{i}.mp4", frames, fps=8, codec="libx264", plugin="pyav")
        (root / "videos" / f"{i}.txt").write_text(caption)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("base", FSDP_FINETUNES)
def test_finetune_fsdp2_with_ema_matches_one_process(finetune_setup, tmp_path, base):
    """Per-block FSDP2 (the model's own blocks), EMA on: 2 steps equal a 1-process run."""
    root, record = finetune_setup, BASES[base]
    data = root / ("videos" if record.video else "images")
    script = training_script(record)
    args = (
        "--config", record.tiny.load().tiny_config,  # a shipped config by name
        f"model.pretrained={root / base}",
        f"data.path={data}", "train.max_steps=2", "train.ema_decay=0.5", "log.sample_every=0",
        f"data.cache_dir={tmp_path / 'cache'}", *WELL_CONDITIONED,
    )
    run_inprocess(script, *args, f"output_dir={tmp_path / 'one'}")
    two = run_fsdp(script, *args, f"output_dir={tmp_path / 'fsdp'}")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "fsdp units     the model's _no_split_modules" in two.stderr
    _same_losses(_check_two_ranks(tmp_path / "fsdp", 2), read_metrics(tmp_path / "one"))
    assert max_abs_diff(final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "one")) < WEIGHT_TOL


def test_deepspeed_launch_is_refused_before_any_work(tmp_path, monkeypatch):
    """What `accelerate launch` exports for a DeepSpeed config: refused in one line, nothing written."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="DeepSpeed .* is not supported"):
        run_inprocess("train_dit.py", "--config", DIT, f"output_dir={tmp_path}", "train.max_steps=1")
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.slow
def test_accelerate_launch_cpu_two_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process (accelerate 1.15): refused, exit 2,
    one line naming the launches that work, nothing written."""
    import subprocess

    cmd = [PYTHON, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "scripts" / "train_dit.py"),
           "--config", DIT, f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]
    done = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "train_dit.py: error:" in line]
    assert len(errors) == 1 and "started only this one" in errors[0] and "torchrun" in errors[0], done.stderr
    assert not (tmp_path / "run").exists()


def test_single_process_launch_checks():
    """The launch signals, one by one (no process started)."""
    from types import SimpleNamespace

    from mhla_gen.train.distributed import check_world_size

    one = SimpleNamespace(num_processes=1, distributed_type="NO")
    check_world_size(one, {})  # plain python
    check_world_size(one, {"ACCELERATE_DYNAMO_BACKEND": "NO"})  # accelerate launch, one process
    check_world_size(SimpleNamespace(num_processes=2), {"WORLD_SIZE": "2"})  # joined
    launched_two = {"ACCELERATE_DYNAMO_BACKEND": "NO", "MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(ConfigError, match="started only this one"):
        check_world_size(one, launched_two)
    check_world_size(one, {**launched_two, "PMI_SIZE": "1"})  # an MPI launch of one process
    with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
        check_world_size(one, {"WORLD_SIZE": "2"})
