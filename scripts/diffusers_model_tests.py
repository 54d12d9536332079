"""Run diffusers' own model test suites of every base (DiT, SANA, Wan), stock and with MHLA installed.

diffusers' tests are not part of the pip package and are not vendored here. This script copies the
few files they need out of a diffusers git checkout (or bare git dir) into ``--out``, adds a pytest
plugin that wraps ``__init__`` of every base's transformer class (``DiTTransformer2DModel``,
``SanaTransformer2DModel``, ``WanTransformer3DModel``, ...) so every model the tests build
(constructors, ``from_config``, ``from_pretrained``) gets MHLA with CPE and gate in every layer, runs
each suite twice (stock, MHLA) and prints pass / fail / skip counts plus every test whose outcome differs.

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
from mhla_gen.cli import expand_path
from mhla_gen.cli import run as run_cli
from mhla_gen.folders import check_apart, claim

# each base record's diffusers test suite (Base.diffusers_tests)
SUITES = {name: base.diffusers_tests for name, base in BASES.items() if base.diffusers_tests}
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


def export(diffusers: Path, rev: str, out: Path) -> None:
    git = ["git", f"--git-dir={diffusers / '.git' if (diffusers / '.git').exists() else diffusers}"]
    listed = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", rev, "tests/models/testing_utils"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in [*SUPPORT, *listed, *SUITES.values()]:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(
            subprocess.run([*git, "show", f"{rev}:{name}"], check=True, capture_output=True).stdout
        )
    (out / "mhla_plugin.py").write_text(PLUGIN)


def outcomes(xml: Path) -> dict[str, str]:
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        result[name] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--diffusers", type=expand_path, required=True, help="diffusers git checkout or bare git dir"
    )
    parser.add_argument(
        "--rev", default="HEAD", help="diffusers revision, ideally the installed version's tag"
    )
    parser.add_argument("--out", type=expand_path, default="/tmp/difftests")
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    args = parser.parse_args()
    args.diffusers, args.out = Path(args.diffusers), Path(args.out)
    check_apart(args.out, "--out", {"--diffusers": args.diffusers})
    claim(args.out, "diffusers_tests", "--out")  # new, empty or an export of ours (mhla_gen.folders)
    export(args.diffusers, args.rev, args.out)
    # the exported tests first, then the caller's PYTHONPATH (a checkout of mhla_gen it points at)
    pythonpath = os.pathsep.join(p for p in (str(args.out), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}
    for suite in args.suites:
        runs = {}
        for mode in ("stock", "mhla"):
            xml = args.out / f"{mode}_{suite}.xml"
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
        for name in sorted(set(runs["stock"]) | set(runs["mhla"])):
            stock, mhla = runs["stock"].get(name, "-"), runs["mhla"].get(name, "-")
            if stock != mhla:
                print(f"      differs: {name}: stock {stock}, MHLA {mhla}")


if __name__ == "__main__":
    run_cli(main)
