"""pyproject.toml installs exactly the package folders of the repo, under the one top-level name mhla_gen."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]


def test_the_package_list_names_every_package_folder():
    """The list is explicit (pipelines/ is installed as mhla_gen.pipelines, which discovery cannot do), so
    a new subpackage of mhla_gen must be added to it: otherwise wheels would ship without it."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"mhla_gen.pipelines": "pipelines"}
    inits = (REPO / "mhla_gen").rglob("__init__.py")
    found = {".".join(init.parent.relative_to(REPO).parts) for init in inits}
    assert sorted(setuptools["packages"]) == sorted(found | {"mhla_gen.pipelines"})
