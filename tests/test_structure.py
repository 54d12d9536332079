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
from mhla_gen.bases.record import CAPABILITIES

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
    assert "mhla_gen.bases" in graph["mhla_gen.integration.install"]  # the graph sees real edges
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def unit(module: str) -> str:
    """The room a module lives in: its subpackage of ``mhla_gen`` (``ops``, ``train``, ...) or its top-level
    module (``models``); the package's own ``__init__`` is ``mhla_gen``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_packages_import_downward_only():
    """The subpackages (and top-level modules) form layers: no two import each other, directly or round a
    loop, so ``mhla_gen/`` reads bottom up (``docs/extending.md``, "Where things live")."""
    units: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        units.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    assert {"ops", "processors", "bases", "integration", "train", "commands"} <= set(units)
    assert cycles(units) == [], "a package imports one above it"


def is_own_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").startswith("mhla_gen")
    return isinstance(node, ast.Import) and any(alias.name.startswith("mhla_gen") for alias in node.names)


def inner_own_imports(path: Path) -> list[tuple[int, bool]]:
    """``(line, explained)`` for every import of mhla_gen inside a function of ``path``: explained when a
    comment stands on its line, its last line or the line above its group of imports."""
    lines = path.read_text().split("\n")
    found = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in filter(is_own_import, imports):
            first = node
            while (prev := next((n for n in imports if n.end_lineno == first.lineno - 1), None)) is not None:
                first = prev  # the top of a contiguous group of imports
            explained = any("#" in lines[i - 1] for i in (node.lineno, node.end_lineno)) or lines[
                first.lineno - 2].strip().startswith("#")
            found[node.lineno] = explained
    return sorted(found.items())


def test_imports_inside_functions_say_why():
    """Own-module imports sit at the top of a file; one inside a function (a cycle, or a heavy stack the
    caller may not need) carries a comment saying which."""
    bare = [f"{p.relative_to(ROOT)}:{line}" for p in PACKAGE.rglob("*.py")
            for line, explained in inner_own_imports(p) if not explained]
    assert bare == []


def test_inner_import_scan_sees_a_bare_import(tmp_path):
    code = "def f():\n    from .a import b\n    # heavy\n    from .c import d\n    from .e import g\n"
    (tmp_path / "m.py").write_text(code)
    assert inner_own_imports(tmp_path / "m.py") == [(2, False), (4, True), (5, True)]


def test_no_base_name_switch_outside_the_records():
    """Which base is a question for its record: no ``base == ...`` style test anywhere else (a record's
    name as a literal is test_no_record_name_literal_outside_the_records's)."""
    pattern = re.compile(r"""base\s*[!=]=|\.base in """)
    hits = []
    for folder in ("mhla_gen", "scripts", "eval"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(PACKAGE / "bases"):
                continue
            lines = enumerate(path.read_text().splitlines(), 1)
            hits += [f"{path.relative_to(ROOT)}:{i}" for i, line in lines
                     if pattern.search(line) and "saved_base" not in line and "manifest" not in line]
    assert hits == []


def record_strings() -> set[str]:
    """Every record's name and its transformer class's name."""
    return set(BASES) | {base.transformer_class.__name__ for base in BASES.values()}


def code_literals(source: str, wanted: set[str]) -> list[tuple[int, str]]:
    """``(line, value)`` of every string constant in ``source`` whose value is in ``wanted``, docstrings
    left out (a string expression standing alone as a statement: module, class, function and attribute
    docstrings)."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in wanted
                  and id(node) not in docstrings)


# (file, literal): why that literal, equal to a record's name, is not a copy of what the record knows.
# Anything else fails test_no_record_name_literal_outside_the_records; an entry no longer found fails too.
_FILE_TAG = ("the processor's tag in saved MHLA parameter files (save_mhla_parameters metadata): a file "
             "format, written by processors, which sit below the records and cannot import them")
_PRESET = "the MHLAConfig preset tuned for SANA (MHLAConfig.preset names), not the record"
REVIEWED = {
    ("mhla_gen/processors/dit.py", "dit"): _FILE_TAG,
    ("mhla_gen/processors/sana.py", "sana"): _FILE_TAG,
    ("mhla_gen/processors/sana_video.py", "sana-video"): _FILE_TAG,
    ("mhla_gen/processors/wan.py", "wan"): _FILE_TAG,
    ("mhla_gen/processors/config.py", "sana"): _PRESET,
    ("benchmarks/bench_sana_step.py", "sana"): _PRESET,
    ("benchmarks/conversion_budget.py", "sana"): _PRESET,
}


def test_no_record_name_literal_outside_the_records():
    """What a record knows (its name, its transformer class) is written in ``mhla_gen/bases/`` only: no code
    literal equal to a record's name or class name elsewhere in the package, scripts, eval or benchmarks
    (docstrings may name them; tests may too). A tuple of names beside the records drifts: ``adopt``
    refused every SANA-Video and Wan I2V sample set that way."""
    wanted, found = record_strings(), set()
    hits = []
    for folder in ("mhla_gen", "scripts", "eval", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(PACKAGE / "bases"):
                continue
            name = str(path.relative_to(ROOT))
            for line, value in code_literals(path.read_text(), wanted):
                found.add((name, value))
                if (name, value) not in REVIEWED:
                    hits.append(f"{name}:{line}: {value!r}")
    assert hits == [], "ask the record (mhla_gen.bases) instead of naming it"
    assert set(REVIEWED) <= found, f"stale entries: {sorted(set(REVIEWED) - found)}"


def test_record_literal_scan_sees_code_and_skips_docstrings():
    source = '''"""The dit base."""
def f(base):
    """Wan only."""
    x = "sana"  # a literal
    """wan: an attribute docstring"""
    return base in ("dit", f"{base}") or g(name="wan-i2v")
'''
    found = code_literals(source, {"dit", "sana", "wan", "wan-i2v"})
    assert found == [(4, "sana"), (6, "dit"), (6, "wan-i2v")]


@pytest.mark.parametrize("name", sorted(BASES))
def test_every_record_resolves(name):
    """Every reference of every record imports, and the lookups agree with each other."""
    base = base_for(name)
    assert base.name == name and base.grid.ndim == base.processor.grid_ndim
    from mhla_gen.pipelines import PipelineSampler
    from mhla_gen.train.config import RunConfig
    from mhla_gen.train.task import TrainTask

    assert issubclass(base.sampler.load(), PipelineSampler)
    if base.trains:
        assert issubclass(base.run_config.load(), RunConfig)
        assert issubclass(base.task.load(), TrainTask)
    if base.converter_config is not None:  # a shipped config's name
        from mhla_gen.configs import shipped_config

        assert shipped_config(base.converter_config) is not None
    assert base_for_class_name(base.class_name).transformer_class is base.transformer_class
    import diffusers

    assert getattr(diffusers, base.pipeline_class)
    from mhla_gen.configs import shipped_config
    from mhla_gen.testing import TinyBase

    tiny = base.tiny.load()  # the test reference: a tiny model of the record, a config of its grid rank
    assert isinstance(tiny, TinyBase) and len(tiny.mhla.blocks) == len(tiny.latent) == base.grid.ndim
    model = tiny.model()
    assert type(model) is base.transformer_class and base_for_model(model) is base
    assert shipped_config(tiny.tiny_config) is not None and tiny.latent == tiny.sizes[0]
    assert base.capabilities <= set(CAPABILITIES)


def test_every_data_source_is_a_class():
    """The ``data.source`` names a run config accepts are its records' ``data_sources``, each a class of
    the source registry of its task's kind (DiT's or the captioned one); each class there is a record's."""
    from mhla_gen.train.caption_sources import CAPTION_SOURCES
    from mhla_gen.train.config import data_sources
    from mhla_gen.train.dit import DiTTask
    from mhla_gen.train.dit_sources import DIT_SOURCES

    listed = {"DiTTask": set(), "captioned": set()}
    for base in BASES.values():
        if base.trains:
            kind = "DiTTask" if issubclass(base.task.load(), DiTTask) else "captioned"
            assert set(base.data_sources) <= set({"DiTTask": DIT_SOURCES, "captioned": CAPTION_SOURCES}[kind])
            assert set(base.data_sources) <= set(data_sources(base.run_config.load())), base.name
            listed[kind].update(base.data_sources)
    assert listed == {"DiTTask": set(DIT_SOURCES), "captioned": set(CAPTION_SOURCES)}


@pytest.mark.parametrize("name", sorted(BASES))
def test_a_transformer_subclass_finds_its_base(name):
    """A subclass of a base's transformer (e.g. one registered for diffusers loading) is that base."""
    base = BASES[name]
    subclass = type(f"My{base.class_name}", (base.transformer_class,), {})
    assert base_for_class_name(subclass.__name__).transformer_class is base.transformer_class
    assert base_for_model(subclass.from_config(base.tiny.load().model().config)) is base


def test_lookups_name_what_is_supported():
    import torch

    supported = re.escape(str(sorted(BASES)))
    with pytest.raises(ValueError, match=rf"unknown base 'unet'; supported bases: {supported}"):
        base_for("unet")
    with pytest.raises(ValueError, match="MHLA does not support Linear"):
        base_for_model(torch.nn.Linear(2, 2))


def test_adopt_does_not_load_the_training_stack():
    """``mhla-gen adopt`` (and every entry point through mhla_gen.commands.cli) imports the training loop
    and the pipelines only when its command trains or samples."""
    code = ("import sys, mhla_gen.commands.adopt, mhla_gen.commands.cli; "
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


def test_the_library_holds_no_study_harness():
    """The study harness lives in eval/studies and the library imports nothing from it."""
    harness = {p.stem for p in (ROOT / "eval" / "studies").glob("*.py")} - {"__init__"}
    assert harness and not any((ROOT / "mhla_gen" / f"{name}.py").exists() for name in harness)
    for path in (ROOT / "mhla_gen").rglob("*.py"):
        source = path.read_text()
        assert "import studies" not in source and "from studies" not in source, path
