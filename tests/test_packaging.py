"""pyproject.toml installs the one top-level package mhla_gen with every subpackage (found by discovery)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]


def test_package_discovery_finds_mhla_gen_only():
    """Discovery, not a hand-kept list: a new subpackage ships without an edit here; nothing is remapped."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"] == {"find": {"include": ["mhla_gen*"]}}
    assert setuptools["package-data"] == {"mhla_gen.configs": ["**/*.yaml"]}  # the shipped configs
    assert (REPO / "mhla_gen" / "pipelines" / "__init__.py").is_file()
    assert not (REPO / "pipelines").exists()
