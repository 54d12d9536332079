"""What ``pip install`` of the wheel gives: the one package mhla_gen with every subpackage (found by
discovery), its shipped configs, the LICENSE, the ``mhla-gen`` command, one version and project URLs;
and a README whose links work on a package index page (no checkout beside it).

The wheel is built here from a copy of the sources (a few seconds, no virtualenv); installing it and
running its commands outside the checkout is ``.ci/wheel_smoke.sh``.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
URL = "https://github.com/mhla-gen/mhla_gen"


def source_version() -> str:
    """``mhla_gen.__version__`` as written in the source (what setuptools reads)."""
    tree = ast.parse((REPO / "mhla_gen" / "__init__.py").read_text())
    found = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and [getattr(t, "id", None) for t in node.targets] == ["__version__"]]
    assert len(found) == 1
    return found[0]


def test_package_discovery_finds_mhla_gen_only():
    """Discovery, not a hand-kept list: a new subpackage ships without an edit here; nothing is remapped."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"] == {"find": {"include": ["mhla_gen*"]}}
    assert setuptools["package-data"] == {"mhla_gen.configs": ["**/*.yaml"],  # the shipped configs
                                          "mhla_gen.ops": ["mhla_tiles.json"]}  # data files: listed
    assert (REPO / "mhla_gen" / "ops" / "mhla_tiles.json").is_file()
    assert (REPO / "mhla_gen" / "pipelines" / "__init__.py").is_file()
    assert not (REPO / "pipelines").exists()


def test_one_version_one_licence_and_the_project_urls():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]  # from mhla_gen.__version__
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    licence = (REPO / "LICENSE").read_text()
    assert licence.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a pointer to it
    assert set(project["urls"]) == {"Homepage", "Repository", "Documentation", "Issues"}
    assert all(url.startswith(URL) for url in project["urls"].values())
    assert project["scripts"] == {"mhla-gen": "mhla_gen.commands.cli:main"}


def test_readme_links_work_without_a_checkout():
    """A package index shows the README alone: every link is absolute (or an anchor on the page), and each
    link into this repository names a file the repository has."""
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(targets) > 10 and [t for t in targets if not t.startswith(("https://", "#"))] == []
    prefixes = (f"{URL}/blob/main/", f"{URL}/tree/main/", "https://raw.githubusercontent.com/mhla-gen/mhla_gen/main/")
    ours = [t.split("#")[0].removeprefix(p) for t in targets for p in prefixes if t.startswith(p)]
    assert ours and [path for path in ours if not (REPO / path).exists()] == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of what it is made of (the checkout is not written into)."""
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "mhla_gen", src / "mhla_gen", ignore=shutil.ignore_patterns("__pycache__"))
    out = src / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "--wheel-dir", str(out), str(src)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.glob("mhla_gen-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_package_its_configs_and_its_licence(wheel):
    from mhla_gen.commands import COMMANDS

    names = set(wheel.namelist())
    configs = {str(p.relative_to(REPO)) for p in (REPO / "mhla_gen" / "configs").rglob("*.yaml")}
    assert configs and configs <= names
    assert "mhla_gen/ops/mhla_tiles.json" in names  # the Triton tile table
    modules = {f"{c.module.replace('.', '/')}.py" for c in COMMANDS.values()}
    assert modules | {"mhla_gen/__main__.py", "mhla_gen/commands/cli.py"} <= names
    assert {name.split("/")[0] for name in names} == {"mhla_gen", f"mhla_gen-{source_version()}.dist-info"}
    info = f"mhla_gen-{source_version()}.dist-info"
    assert wheel.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert re.search(r"\[console_scripts\]\s*\nmhla-gen = mhla_gen\.commands\.cli:main", entry_points)
    metadata = wheel.read(f"{info}/METADATA").decode()
    assert f"\nVersion: {source_version()}\n" in metadata and "\nLicense-Expression: Apache-2.0\n" in metadata
    assert f"Project-URL: Issues, {URL}/issues" in metadata
