"""Loading the repository's scripts (``eval/``, ``scripts/``, ``benchmarks/``: not packages) as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """A fresh module run from the script at ``path`` (absolute, or relative to the repository), registered
    in ``sys.modules`` as ``name`` (default ``script_<stem>``) before it runs: dataclasses and pickling
    look their module up there. Each call runs the script again (monkeypatching one copy leaves the
    next alone)."""
    path = REPO / path
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
