"""Run diffusers' own model (or pipeline) test suites of every base, stock and with MHLA installed.

diffusers' tests are not part of the pip package and are not vendored here. This script copies the
suites and the files they import (followed through their relative imports) out of a diffusers git
checkout (or bare git dir) into ``--out``, adds a pytest plugin that wraps ``__init__`` of every base's
transformer class (``DiTTransformer2DModel``, ``SanaTransformer2DModel``, ``WanTransformer3DModel``, ...) so
every model the tests build (constructors, ``from_config``, ``from_pretrained``) gets MHLA with CPE and gate
in every layer, runs each suite twice (stock, MHLA) and prints pass / fail / skip counts plus every test
whose outcome differs.

Model suites: each base record's ``diffusers_tests`` (DiT, SANA, SANA-Video, Wan), plus ``wan-i2v``:
diffusers' Wan suite has no image-to-video model, so this script writes one more test module that runs the
same mixins on a Wan2.1 I2V config (``image_dim``, ``added_kv_proj_dim``, ``2 * out + 4`` input channels).
Pipeline suites (``--pipelines``): each record's ``diffusers_pipeline_tests`` (DiT, SANA, SANA-Video T2V and
I2V, Wan2.1 / Wan2.2 T2V, I2V and FLF). Their tiny text encoders read two tiny Hub repositories; a second
plugin, loaded in both runs alike, builds stand-ins of those in-process (:data:`HUB_STANDINS`).

A difference is expected only for the tests in :data:`EXPECTED_DIFFERENCES`, as each entry allows (they
compare class names, or outputs against values recorded from the stock attention); any other difference
makes the exit status 1.

    python scripts/diffusers_model_tests.py --diffusers PATH/to/diffusers [--rev v0.42.1] [--out DIR]
        [--pipelines]

Offline: tests that need the Hub fail for both runs alike (HF_HUB_OFFLINE=1 makes that quick).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath

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

# each base record's diffusers test suites (Base.diffusers_tests, .diffusers_pipeline_tests), by base name
MODEL_SUITES = {name: (base.diffusers_tests,) for name, base in BASES.items() if base.diffusers_tests}
PIPELINE_SUITES = {name: base.diffusers_pipeline_tests for name, base in BASES.items()
                   if base.diffusers_pipeline_tests}
WRITTEN = {WAN_I2V_SUITE: WAN_I2V_SOURCE}  # the model suite Wan I2V's record names

PASS_TO_FAIL = {("passed", "failed")}
EITHER_WAY = {("passed", "failed"), ("failed", "passed")}
EXPECTED_DIFFERENCES = {
    "test_gradient_checkpointing_is_applied": (
        PASS_TO_FAIL, "compares the class names of the modules with gradient checkpointing on with a set "
        "naming the stock class"),
    "test_logs_info_when_no_lora_keys_found": (
        PASS_TO_FAIL, "expects diffusers' log to name the stock class; it names the model's class "
        "(diffusers' own message, logged by load_lora_adapter: 'No LoRA keys associated to MHLA...')"),
    "test_inference": (
        EITHER_WAY, "compares the pipeline's output with a slice recorded from the stock attention (within "
        "1e-3): MHLA is another attention, and where the stock run misses the slice (a text encoder of the "
        "Hub stand-ins) the MHLA run may land in it"),
}
"""Tests whose outcome may differ with MHLA installed: name -> (the (stock, MHLA) outcomes allowed, why)."""
CONFTEST = "tests/conftest.py"  # diffusers' markers and command-line options; nothing imports it

MODEL_BLOCKS = {2: (2, 2), 3: (2, 2, 2)}
PIPELINE_BLOCKS = {2: (2, 2), 3: (2, 1, 1)}
"""The MHLA blocks the plugin installs, per token-grid rank. diffusers' tiny Wan pipelines draw 16 px videos
of 9 frames: a (3, 1, 1) token grid (VAE 4x / 8x, patch (1, 2, 2)), and MHLA refuses more blocks than an axis
has tokens, so in the pipeline suites video blocks tile the frames only."""

PLUGIN = '''"""Every base's transformer built in the run gets MHLA (CPE 3, gate) in every layer."""
import functools

import torch

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.bases import BASES
from mhla_gen.processors.base import MHLAProcessor

BLOCKS = __BLOCKS__  # per token-grid rank, written by scripts/diffusers_model_tests.py
CONFIGS = {
    base.transformer_class: MHLAConfig(blocks=BLOCKS[base.grid.ndim], cpe_kernel=3, gate=True)
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


HUB_STANDINS = '''"""In-process stand-ins for the tiny Hub repositories diffusers' pipeline tests read
(no Hub here): the same classes and the widths the tests' tiny models take. Loaded in the stock and the MHLA
run alike; any other name goes to the Hub (and fails offline)."""
from transformers import AutoConfig, AutoTokenizer, GemmaTokenizer, T5Config, T5Tokenizer

T5_WORDS = ["<pad>", "</s>", "<unk>", *(f"\u2581{w}" for w in "dance monkey negative a photo of cat".split())]


def tiny_random_t5_config():
    """A T5 of width 32: the ``text_dim`` of diffusers' tiny Wan pipelines."""
    return T5Config(vocab_size=len(T5_WORDS), d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2)


def tiny_random_t5_tokenizer():
    return T5Tokenizer(vocab=[(word, 0.0) for word in T5_WORDS], extra_ids=0)


def dummy_gemma_tokenizer():
    """Ids below 8, the vocabulary of diffusers' tiny Gemma2 text encoders; ``<bos>`` first, as Gemma's."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "a": 5, "b": 6, "c": 7}
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True)


STANDINS = {
    (AutoConfig, "hf-internal-testing/tiny-random-t5"): tiny_random_t5_config,
    (AutoTokenizer, "hf-internal-testing/tiny-random-t5"): tiny_random_t5_tokenizer,
    (GemmaTokenizer, "hf-internal-testing/dummy-gemma"): dummy_gemma_tokenizer,
}


def _standing_in(cls):
    original = cls.from_pretrained.__func__

    def from_pretrained(klass, name, *args, **kwargs):
        make = STANDINS.get((cls, str(name)))
        return make() if make else original(klass, name, *args, **kwargs)

    return classmethod(from_pretrained)


def pytest_configure(config):
    for cls in {cls for cls, _ in STANDINS}:
        cls.from_pretrained = _standing_in(cls)
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


def _imports(path: str, source: bytes, listed: set[str]) -> set[str]:
    """The files of ``listed`` that ``path`` imports relatively: ``from ..x import y`` names ``x`` and, when
    it is a package, each module ``y`` of it; every package above a file comes with it (its ``__init__``)."""
    found = {f"{parent}/__init__.py" for parent in PurePosixPath(path).parents if str(parent) != "."}
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.ImportFrom) and node.level:
            package = PurePosixPath(path).parents[node.level - 1]
            module = package.joinpath(*node.module.split(".")) if node.module else package
            for name in [module, *(module / alias.name for alias in node.names)]:
                found |= {f"{name}.py", f"{name}/__init__.py"}
    return found & listed


def exported_files(git: list[str], rev: str, suites: list[str]) -> dict[str, bytes]:
    """``suites`` and every file they import, transitively (path -> content at ``rev``; the files this
    script writes, :data:`WRITTEN`, from their source); ConfigError naming the suites ``rev`` lacks."""
    listed = set(subprocess.run([*git, "ls-tree", "-r", "--name-only", rev, "tests"], check=True,
                                capture_output=True, text=True).stdout.split()) | set(WRITTEN)
    if missing := [suite for suite in suites if suite not in listed]:
        raise ConfigError(f"--rev {rev} has no {', '.join(missing)} (a diffusers older than these suites?)")
    files, todo = {}, [*suites, *({CONFTEST} & listed)]
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files[path] = WRITTEN[path].encode() if path in WRITTEN else subprocess.run(
            [*git, "show", f"{rev}:{path}"], check=True, capture_output=True).stdout
        todo += _imports(path, files[path], listed) - set(files)
    return files


def missing_modules(files: dict[str, bytes]) -> list[str]:
    """Top-level modules that ``files`` import unconditionally (at module level, absolute) and that are not
    installed: diffusers' test requirements (``parameterized``, ``requests_mock``), not diffusers' own."""
    names = set()
    for path, source in files.items():
        for node in ast.parse(source, path).body:
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names.add(node.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def export(files: dict[str, bytes], out: Path, blocks: dict[int, tuple[int, ...]]) -> None:
    """``files`` under ``out`` and the two plugins; the MHLA one installs ``blocks`` (per grid rank)."""
    for name, content in files.items():
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    (out / "mhla_plugin.py").write_text(PLUGIN.replace("__BLOCKS__", repr(blocks)))
    (out / "hub_standins.py").write_text(HUB_STANDINS)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        result[name] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
    return result


def differences(stock: dict[str, str], mhla: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(expected, unexpected)`` lines for the tests whose outcome differs between the two runs; expected:
    the :data:`EXPECTED_DIFFERENCES` whose outcomes changed as their entry allows."""
    expected, unexpected = [], []
    for name in sorted(set(stock) | set(mhla)):
        before, after = stock.get(name, "-"), mhla.get(name, "-")
        if before == after:
            continue
        allowed, reason = EXPECTED_DIFFERENCES.get(name.split("::")[-1], (set(), ""))
        if (before, after) in allowed:
            expected.append(f"{name}: stock {before}, MHLA {after} (expected: {reason})")
        else:
            unexpected.append(f"{name}: stock {before}, MHLA {after}")
    return expected, unexpected


def run_suite(path: str, mode: str, out: Path, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Outcomes of one suite file in ``out`` (``mode``: stock, or mhla with the MHLA plugin), and the plugin's
    summary lines."""
    xml = out / f"{mode}_{PurePosixPath(path).stem}.xml"
    plugins = ["-p", "hub_standins", *(["-p", "mhla_plugin"] if mode == "mhla" else [])]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider", *plugins, f"--junitxml={xml}",
         "-o", "junit_family=xunit1"],
        cwd=out, env=env, capture_output=True, text=True,
    )
    return outcomes(xml), [line for line in run.stdout.splitlines() if line.startswith("mhla_plugin:")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diffusers", type=expand_path, required=True, help="diffusers git checkout or bare git dir"
    )
    parser.add_argument(
        "--rev", default="HEAD", help="diffusers revision, ideally the installed version's tag"
    )
    parser.add_argument("--out", type=expand_path, default="/tmp/difftests")
    parser.add_argument("--pipelines", action="store_true",
                        help="the pipeline suites (Base.diffusers_pipeline_tests), not the model suites")
    parser.add_argument("--suites", nargs="+", choices=sorted(set(MODEL_SUITES) | set(PIPELINE_SUITES)),
                        help="base names (default: every base with a suite)")
    args = parser.parse_args(argv)
    suites = PIPELINE_SUITES if args.pipelines else MODEL_SUITES
    names = args.suites or list(suites)
    if missing := [name for name in names if name not in suites]:
        raise ConfigError(f"--suites {' '.join(missing)}: no {'pipeline' if args.pipelines else 'model'} "
                          f"suite (those with one: {' '.join(suites)})")
    args.diffusers, args.out = Path(args.diffusers), Path(args.out)
    check_source(args.diffusers, args.rev)
    check_apart(args.out, "--out", {"--diffusers": args.diffusers})
    paths = [path for name in names for path in suites[name]]
    files = exported_files(git_command(args.diffusers), args.rev, paths)
    if missing := missing_modules(files):
        raise ConfigError(f"diffusers' tests at --rev {args.rev} import {', '.join(missing)}, not installed "
                          f"here (pip install {' '.join(missing)})")
    claim(args.out, "diffusers_tests", "--out")  # new, empty or an export of ours (mhla_gen.outputs.folders)
    export(files, args.out, PIPELINE_BLOCKS if args.pipelines else MODEL_BLOCKS)
    # the exported tests first, then the caller's PYTHONPATH (a checkout of mhla_gen it points at)
    pythonpath = os.pathsep.join(p for p in (str(args.out), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    unexpected = []
    for path in paths:
        runs = {}
        for mode in ("stock", "mhla"):
            runs[mode], used = run_suite(path, mode, args.out, env)
            counts = {k: list(runs[mode].values()).count(k) for k in ("passed", "failed", "skipped")}
            print(f"{PurePosixPath(path).stem} {mode:5s} {counts}", *used)
        expected, unexpected_here = differences(runs["stock"], runs["mhla"])
        for line in expected:
            print(f"      expected: {line}")
        for line in unexpected_here:
            print(f"      differs: {line}")
        unexpected += unexpected_here
    if unexpected:
        raise SystemExit(f"{len(unexpected)} tests differ between stock and MHLA beyond the expected ones")


if __name__ == "__main__":
    run_cli(main)
