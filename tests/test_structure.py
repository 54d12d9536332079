"""The package's shape: base records answer every "which base" question, imports form no cycle, entry
points import only what their command needs, and the training classes stay readable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhla_gen.bases import BASES, base_for, base_for_class_name, base_for_model

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mhla_gen"


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of mhla_gen it imports`` (top-level and inside functions alike; a module's own
    parent packages, already imported when it runs, are left out)."""
    modules = dict(module_name(p) for p in PACKAGE.rglob("*.py"))
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name, is_package = module_name(path)
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t not in parents and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "mhla_gen.bases" in graph["mhla_gen.install"]  # the graph sees real edges
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_base_name_switch_outside_the_records():
    """Which base is a question for its record: no ``base == "dit"`` style test anywhere else."""
    pattern = re.compile(r"""base\s*[!=]=|\.base in |[!=]= ["'](dit|sana|wan)["']""")
    hits = []
    for folder in ("mhla_gen", "scripts", "eval"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(PACKAGE / "bases"):
                continue
            lines = enumerate(path.read_text().splitlines(), 1)
            hits += [f"{path.relative_to(ROOT)}:{i}" for i, line in lines
                     if pattern.search(line) and "saved_base" not in line and "manifest" not in line]
    assert hits == []


@pytest.mark.parametrize("name", sorted(BASES))
def test_every_record_resolves(name):
    """Every reference of every record imports, and the lookups agree with each other."""
    base = base_for(name)
    assert base.name == name and base.grid.ndim == base.processor.grid_ndim
    from mhla_gen.pipelines import PipelineSampler
    from mhla_gen.train.config import RunConfig
    from mhla_gen.train.loop import TrainTask

    assert issubclass(base.sampler.load(), PipelineSampler)
    if base.trains:
        assert issubclass(base.run_config.load(), RunConfig)
        assert issubclass(base.task.load(), TrainTask)
    if base.converter_config is not None:  # a shipped config's name
        from mhla_gen.configs import shipped_config

        assert shipped_config(base.converter_config) is not None
    assert base_for_class_name(base.transformer_class.__name__).transformer_class is base.transformer_class
    import diffusers

    assert getattr(diffusers, base.pipeline_class)


def test_every_data_source_is_a_class():
    """The ``data.source`` names a config accepts are exactly the source classes (and each base lists its)."""
    from mhla_gen.train import config
    from mhla_gen.train.caption_sources import CAPTION_SOURCES
    from mhla_gen.train.dit_sources import DIT_SOURCES

    assert tuple(DIT_SOURCES) == config.DIT_SOURCES == base_for("dit").data_sources
    assert tuple(CAPTION_SOURCES) == config.CAPTION_SOURCES == base_for("wan").data_sources


def test_a_transformer_subclass_finds_its_base():
    """A subclass of a base's transformer (e.g. one registered for diffusers loading) is that base."""
    from mhla_gen.testing import tiny_dit

    dit = type(tiny_dit())
    subclass = type("MyDiTTransformer", (dit,), {})
    assert base_for_class_name("MyDiTTransformer") is base_for("dit")
    assert base_for_model(subclass.from_config(tiny_dit().config)) is base_for("dit")


def test_lookups_name_what_is_supported():
    import torch

    supported = r"\['dit', 'sana', 'sana-video', 'wan', 'wan-i2v'\]"
    with pytest.raises(ValueError, match=rf"unknown base 'unet'; supported bases: {supported}"):
        base_for("unet")
    with pytest.raises(ValueError, match="MHLA does not support Linear"):
        base_for_model(torch.nn.Linear(2, 2))


def test_adopt_does_not_load_the_training_stack():
    """``python -m mhla_gen.adopt`` (and every entry point through mhla_gen.cli) imports the training loop
    and the pipelines only when its command trains or samples."""
    code = ("import sys, mhla_gen.adopt, mhla_gen.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('mhla_gen.train', 'mhla_gen.pipelines'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def class_lengths(folder: Path) -> dict[str, int]:
    lengths = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lengths[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_training_classes_stay_readable():
    """No class in mhla_gen/train/ over about 300 lines."""
    lengths = class_lengths(PACKAGE / "train")
    assert lengths["dit.py:DiTTask"] > 100  # the measure sees the classes
    assert {name: n for name, n in lengths.items() if n > 300} == {}


def test_adopt_knows_every_bases_transformer_without_importing_it():
    """``adopt model`` names the supported transformers as strings (it loads no model code): every
    base's transformer class must be among them."""
    from mhla_gen import adopt
    from mhla_gen.bases import BASES

    assert {base.transformer_class.__name__ for base in BASES.values()} <= set(adopt.TRANSFORMERS)
