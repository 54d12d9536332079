"""Run diffusers' own model test suites of every base, stock and with MHLA installed.

diffusers' tests are not part of the pip package and are not vendored here. This script copies the
few files they need out of a diffusers git checkout (or bare git dir) into ``--out``, adds a pytest
plugin that wraps ``__init__`` of every base's transformer class (``DiTTransformer2DModel``,
``SanaTransformer2DModel``, ``WanTransformer3DModel``, ...) so every model the tests build
(constructors, ``from_config``, ``from_pretrained``) gets MHLA with CPE and gate in every layer, runs
each suite twice (stock, MHLA) and prints pass / fail / skip counts plus every test whose outcome differs.

Suites: each base record's ``diffusers_tests`` (DiT, SANA, SANA-Video, Wan), plus ``wan-i2v``: diffusers'
Wan suite has no image-to-video model, so this script writes one more test module that runs the same
mixins on a Wan2.1 I2V config (``image_dim``, ``added_kv_proj_dim``, ``2 * out + 4`` input channels).

A difference is expected only for the tests in :data:`CLASS_NAME_TESTS` (they compare class names, and an
MHLA model is of the ``mhla_gen.models`` subclass); any other difference makes the exit status 1.

    python scripts/diffusers_model_tests.py --diffusers PATH/to/diffusers [--rev v0.42.1] [--out DIR]

Offline: tests that need the Hub fail for both runs alike (HF_HUB_OFFLINE=1 makes that quick).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from mhla_gen.bases import BASES
from mhla_gen.commands.cli import expand_path
from mhla_gen.commands.cli import run as run_cli
from mhla_gen.errors import ConfigError
from mhla_gen.outputs.folders import check_apart, claim

WAN_I2V_SUITE = "tests/models/transformers/test_mhla_wan_i2v.py"
WAN_I2V_SOURCE = '''"""diffusers' own model test mixins on a Wan2.1 image-to-video config (written by
mhla_gen's scripts/diffusers_model_tests.py: diffusers' Wan suite builds text-to-video models only)."""
from diffusers.utils.torch_utils import randn_tensor

from ...testing_utils import torch_device
from ..testing_utils import (
    AttentionTesterMixin,
    LoraTesterMixin,
    MemoryTesterMixin,
    ModelTesterMixin,
    TorchCompileTesterMixin,
    TrainingTesterMixin,
)
from .test_models_transformer_wan import WanTransformer3DTesterConfig

IMAGE_DIM, IMAGE_TOKENS = 8, 4
TEXT_TOKENS = 512  # diffusers' Wan I2V cross-attention takes the last 512 context tokens as text


class WanI2VTesterConfig(WanTransformer3DTesterConfig):
    @property
    def input_shape(self):
        return (2 * 4 + 4, 2, 16, 16)

    def get_init_dict(self):
        init = super().get_init_dict()
        inner = init["num_attention_heads"] * init["attention_head_dim"]
        return {**init, "in_channels": 2 * init["out_channels"] + 4, "image_dim": IMAGE_DIM,
                "added_kv_proj_dim": inner}

    def get_dummy_inputs(self):
        init, inputs = self.get_init_dict(), super().get_dummy_inputs()
        batch, _, frames, height, width = inputs["hidden_states"].shape

        def rand(*shape):
            return randn_tensor(shape, generator=self.generator, device=torch_device, dtype=self.torch_dtype)

        return {**inputs, "hidden_states": rand(batch, init["in_channels"], frames, height, width),
                "encoder_hidden_states": rand(batch, TEXT_TOKENS, init["text_dim"]),
                "encoder_hidden_states_image": rand(batch, IMAGE_TOKENS, IMAGE_DIM)}


class TestWanI2VTransformer3D(WanI2VTesterConfig, ModelTesterMixin):
    pass


class TestWanI2VTransformer3DMemory(WanI2VTesterConfig, MemoryTesterMixin):
    pass


class TestWanI2VTransformer3DTraining(WanI2VTesterConfig, TrainingTesterMixin):
    def test_gradient_checkpointing_is_applied(self):
        super().test_gradient_checkpointing_is_applied(expected_set={"WanTransformer3DModel"})


class TestWanI2VTransformer3DAttention(WanI2VTesterConfig, AttentionTesterMixin):
    pass


class TestWanI2VTransformer3DCompile(WanI2VTesterConfig, TorchCompileTesterMixin):
    pass


class TestWanI2VTransformer3DLoRA(WanI2VTesterConfig, LoraTesterMixin):
    pass
'''

# each base record's diffusers test suite (Base.diffusers_tests), and the I2V one this script writes
SUITES = {name: base.diffusers_tests for name, base in BASES.items() if base.diffusers_tests}
WRITTEN = {WAN_I2V_SUITE: WAN_I2V_SOURCE}  # the suite Wan I2V's record names

CLASS_NAME_TESTS = {
    "test_gradient_checkpointing_is_applied": "compares the class names of the modules with gradient "
    "checkpointing on with a set naming the stock class",
    "test_logs_info_when_no_lora_keys_found": "expects diffusers' log to name the stock class; it names the "
    "model's class (diffusers' own message, logged by load_lora_adapter: 'No LoRA keys associated to "
    "MHLA...')",
}
"""Tests whose outcome may differ with MHLA installed, and why: they compare class names."""
SUPPORT = [
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/testing_utils.py",
    "tests/models/__init__.py",
    "tests/models/test_modeling_common.py",
    "tests/models/transformers/__init__.py",
]

PLUGIN = '''"""Every base's transformer built in the run gets MHLA (CPE 3, gate) in every layer."""
import functools

import torch

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.bases import BASES
from mhla_gen.processors.base import MHLAProcessor

CONFIGS = {
    base.transformer_class: MHLAConfig(blocks=(2,) * base.grid.ndim, cpe_kernel=3, gate=True)
    for base in BASES.values()
}
for cls, cfg in CONFIGS.items():
    def __init__(self, *args, _original=cls.__init__, _cfg=cfg, **kwargs):
        _original(self, *args, **kwargs)
        install_mhla(self, _cfg)

    cls.__init__ = functools.wraps(cls.__init__)(__init__)

CALLS = [0]
_layout = MHLAProcessor.layout  # every MHLA processor calls it once per call (its block layout)


def _counting_layout(self, *args, **kwargs):
    if not torch.compiler.is_compiling():  # a counter in the graph would make dynamo recompile
        CALLS[0] += 1
    return _layout(self, *args, **kwargs)


MHLAProcessor.layout = _counting_layout


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"mhla_plugin: MHLA attention ran {CALLS[0]} times")
'''


def git_command(diffusers: Path) -> list[str]:
    """``git`` reading the checkout (its ``.git``) or the bare git dir ``diffusers``."""
    return ["git", f"--git-dir={diffusers / '.git' if (diffusers / '.git').exists() else diffusers}"]


def check_source(diffusers: Path, rev: str) -> None:
    """``--diffusers`` is a git checkout or git dir holding the commit ``--rev``: one line naming the
    setting otherwise, before ``--out`` is claimed (git's own error would be a traceback after it)."""
    if not diffusers.is_dir():
        raise FileNotFoundError(f"--diffusers {str(diffusers)!r} is not a folder (a diffusers git checkout)")
    git = git_command(diffusers)
    if subprocess.run([*git, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                      capture_output=True).returncode == 0:
        return
    if subprocess.run([*git, "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        raise ConfigError(f"--diffusers {str(diffusers)!r} is not a git checkout or git dir (git cannot read "
                          f"it); clone https://github.com/huggingface/diffusers there")
    raise ConfigError(f"--rev {rev!r} names no commit in --diffusers {str(diffusers)!r} (fetch its tags, or "
                      f"give a commit it holds)")


def export(diffusers: Path, rev: str, out: Path) -> None:
    git = git_command(diffusers)
    listed = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", rev, "tests/models/testing_utils"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in [*SUPPORT, *listed, *(s for s in SUITES.values() if s not in WRITTEN)]:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(
            subprocess.run([*git, "show", f"{rev}:{name}"], check=True, capture_output=True).stdout
        )
    for name, source in WRITTEN.items():
        (out / name).write_text(source)
    (out / "mhla_plugin.py").write_text(PLUGIN)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        result[name] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
    return result


def differences(stock: dict[str, str], mhla: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(expected, unexpected)`` lines for the tests whose outcome differs between the two runs; expected:
    the :data:`CLASS_NAME_TESTS` that pass stock and fail with MHLA."""
    expected, unexpected = [], []
    for name in sorted(set(stock) | set(mhla)):
        before, after = stock.get(name, "-"), mhla.get(name, "-")
        if before == after:
            continue
        reason = CLASS_NAME_TESTS.get(name.split("::")[-1])
        if reason and (before, after) == ("passed", "failed"):
            expected.append(f"{name}: stock {before}, MHLA {after} (expected: {reason})")
        else:
            unexpected.append(f"{name}: stock {before}, MHLA {after}")
    return expected, unexpected


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diffusers", type=expand_path, required=True, help="diffusers git checkout or bare git dir"
    )
    parser.add_argument(
        "--rev", default="HEAD", help="diffusers revision, ideally the installed version's tag"
    )
    parser.add_argument("--out", type=expand_path, default="/tmp/difftests")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    args = parser.parse_args(argv)
    args.diffusers, args.out = Path(args.diffusers), Path(args.out)
    check_source(args.diffusers, args.rev)
    check_apart(args.out, "--out", {"--diffusers": args.diffusers})
    claim(args.out, "diffusers_tests", "--out")  # new, empty or an export of ours (mhla_gen.outputs.folders)
    export(args.diffusers, args.rev, args.out)
    # the exported tests first, then the caller's PYTHONPATH (a checkout of mhla_gen it points at)
    pythonpath = os.pathsep.join(p for p in (str(args.out), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    unexpected = []
    for suite in args.suites:
        runs = {}
        for mode in ("stock", "mhla"):
            xml = args.out / f"{mode}_{suite.replace('-', '_')}.xml"
            plugin = ["-p", "mhla_plugin"] if mode == "mhla" else []
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    SUITES[suite],
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    *plugin,
                    f"--junitxml={xml}",
                    "-o",
                    "junit_family=xunit1",
                ],
                cwd=args.out,
                env=env,
                capture_output=True,
                text=True,
            )
            runs[mode] = outcomes(xml)
            counts = {k: list(runs[mode].values()).count(k) for k in ("passed", "failed", "skipped")}
            used = [line for line in run.stdout.splitlines() if line.startswith("mhla_plugin:")]
            print(f"{suite:5s} {mode:5s} {counts}", *used)
        expected, unexpected_here = differences(runs["stock"], runs["mhla"])
        for line in expected:
            print(f"      class names: {line}")
        for line in unexpected_here:
            print(f"      differs: {line}")
        unexpected += unexpected_here
    if unexpected:
        raise SystemExit(f"{len(unexpected)} tests differ between stock and MHLA beyond the class-name tests")


if __name__ == "__main__":
    run_cli(main)
