"""Run-wide training settings: the optimizer (from the library that provides it, a missing one named with
its extra), LoRA target modules and dropout (unknown modules refused at start-up), gradient clipping's
default and a resumed run that keeps its recorded value, and an FSDP launch that would run unsharded."""

from __future__ import annotations

import pytest
import torch
from train_helpers import REPO, run_inprocess

from mhla_gen.errors import ConfigError
from mhla_gen.train.config import DiTRunConfig, load_config

TINY_DIT = str(REPO / "mhla_gen" / "configs" / "tiny" / "dit.yaml")


@pytest.mark.parametrize("name, cls", [("adamw", "AdamW"), ("adafactor", "Adafactor"),
                                       ("prodigy", "Prodigy"), ("adamw8bit", "AdamW8bit")])
def test_optimizers_come_from_their_libraries(name, cls):
    from mhla_gen.train.optimizers import OPTIMIZER_CLASSES, make_optimizer

    module = OPTIMIZER_CLASSES[name][0]
    pytest.importorskip(module.split(".")[0])
    tc = load_config(DiTRunConfig, None, [f"train.optimizer={name}", "train.weight_decay=0.01"]).train
    params = [torch.nn.Parameter(torch.randn(80, 64))]
    optimizer = make_optimizer(tc, params)
    assert type(optimizer).__name__ == cls and type(optimizer).__module__.startswith(module.split(".")[0])
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    before = params[0].detach().clone()
    params[0].grad = torch.randn_like(params[0])
    optimizer.step()
    assert not torch.equal(before, params[0])


@pytest.mark.parametrize("name, extra", [("adamw8bit", "bnb"), ("prodigy", "prodigy")])
def test_a_missing_optimizer_package_names_its_extra_before_any_work(name, extra, tmp_path, monkeypatch):
    import importlib

    package = {"bnb": "bitsandbytes", "prodigy": "prodigyopt"}[extra]
    real_import = importlib.import_module

    def missing(module, *args, **kwargs):
        if module.split(".")[0] == package:
            raise ModuleNotFoundError(f"No module named '{package}'")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", missing)  # what mhla_gen.train.optimizers imports with
    message = rf"train.optimizer={name} needs .*pip install 'mhla_gen\[{extra}\]'"
    with pytest.raises(ConfigError, match=message):
        run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={tmp_path / 'run'}",
                      f"train.optimizer={name}")
    assert not (tmp_path / "run").exists()


def test_pyproject_offers_the_optimizer_extras():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("bitsandbytes") for r in extras["bnb"])
    assert any(r.startswith("prodigyopt") for r in extras["prodigy"])


# ---------------------------------------------------------------------------------------------- LoRA
def test_lora_targets_and_dropout_reach_the_adapter(tmp_path):
    from peft.tuners.lora import LoraLayer

    from mhla_gen.train.dit import DiTTask

    cfg = load_config(DiTRunConfig, TINY_DIT, ["train.trainable=lora", "train.lora_dropout=0.25",
                                              "train.lora_target_modules=[to_q,ff.net.2]"])
    task = DiTTask(cfg)
    task.check_lora_targets()
    model = task.build_transformer()
    layers = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    adapted = sorted({name.split(".", 2)[-1] for name in layers})
    assert adapted == ["attn1.to_q", "ff.net.2"]
    layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
    assert layer.lora_dropout["default"].p == 0.25
    assert task.lora_signature() == {"rank": 16, "alpha": 16.0, "target_modules": ["to_q", "ff.net.2"]}
    default = DiTTask(load_config(DiTRunConfig, TINY_DIT, ["train.trainable=lora"]))
    assert default.lora_signature() == {"rank": 16, "alpha": 16.0}  # checkpoints of before still match
    with pytest.raises(ConfigError, match=r"train.lora_target_modules: 'to_qq' names no module of the "
                                          r"DiTTransformer2DModel; its linear layers: .*to_out.0"):
        run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={tmp_path / 'run'}",
                      "train.trainable=lora", "train.lora_target_modules=[to_q,to_qq]")
    assert not (tmp_path / "run").exists()
    for bad, message in (("train.lora_dropout=1.0", "train.lora_dropout must be in"),
                         ("train.lora_target_modules=[]", "train.lora_target_modules must list")):
        with pytest.raises(ConfigError, match=message):
            load_config(DiTRunConfig, None, [bad])


# ------------------------------------------------------------------------------------ clipping, FSDP
def test_gradient_clipping_defaults_to_one_and_null_or_zero_turn_it_off():
    assert load_config(DiTRunConfig).train.max_grad_norm == 1.0
    assert load_config(DiTRunConfig, None, ["train.max_grad_norm=null"]).train.max_grad_norm == 0.0
    digits = REPO / "mhla_gen" / "configs" / "dit_digits.yaml"
    assert load_config(DiTRunConfig, digits).train.max_grad_norm == 0.0


def test_a_resumed_run_keeps_the_clipping_its_config_recorded(tmp_path, caplog):
    """A run made before the default changed recorded max_grad_norm 0.0 (here: given as 0): resumed with a
    command that does not give it, it keeps 0.0 (said in a warning, recorded again in config.yaml); given
    again, the given value wins."""
    import yaml

    train = lambda *o: run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={tmp_path}", *o)
    recorded = lambda: yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_grad_norm"]
    train("train.max_steps=1", "train.max_grad_norm=0")
    train("train.max_steps=2")
    assert recorded() == 0.0 and "train.max_grad_norm=0.0, as this run's config.yaml records" in caplog.text
    train("train.max_steps=3", "train.max_grad_norm=1.0")
    assert recorded() == 1.0


class _FakeAccelerator:
    def __init__(self, kind):
        from accelerate.utils import DistributedType

        self.distributed_type, self.num_processes, self.device = DistributedType[kind], 2, "cpu"


def test_an_fsdp_launch_that_would_run_unsharded_is_refused(tmp_path, monkeypatch):
    from mhla_gen.train.distributed import check_fsdp

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` exports for an FSDP config
    with pytest.raises(ConfigError, match="asks for FSDP"):
        run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()

    fsdp_env = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_CPU": "true"}
    with pytest.raises(ConfigError, match=r"asks for FSDP .* runs this as MULTI_CPU on cpu, unsharded"):
        check_fsdp(_FakeAccelerator("MULTI_CPU"), fsdp_env)
    check_fsdp(_FakeAccelerator("FSDP"), fsdp_env)  # really sharded
    check_fsdp(_FakeAccelerator("MULTI_CPU"), {"ACCELERATE_USE_CPU": "true"})  # DDP asked, DDP run


def test_a_launcher_precision_the_run_does_not_follow_is_said(tmp_path, monkeypatch, caplog):
    """``accelerate launch --mixed_precision bf16`` (ACCELERATE_MIXED_PRECISION) with a run config that says
    ``no``: the run trains as its config says (the Accelerator gets it) and a warning says so; agreeing
    settings and a launch without the variable say nothing."""
    from mhla_gen.train.distributed import launcher_precision_note

    assert launcher_precision_note("no", {}) is None
    assert launcher_precision_note("bf16", {"ACCELERATE_MIXED_PRECISION": "BF16"}) is None
    launched = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    assert "give train.mixed_precision=bf16" in launcher_precision_note("no", launched)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    run_inprocess("train_dit.py", "--config", TINY_DIT, f"output_dir={tmp_path}", "train.max_steps=1")
    said = "accelerate launch asked for mixed precision 'bf16'; this run trains with train.mixed_precision=no"
    assert said in caplog.text
