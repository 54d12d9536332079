"""What README.md and docs/ show a user to copy: every ``mhla_gen`` name they import or call exists, and
every command line they print parses (its flags are the command's own, its ``--config`` and ``key=value``
settings load) — so a renamed function, flag or setting cannot leave the pages behind."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
from script_helpers import load_script
from train_helpers import REPO

from mhla_gen.bases import BASES
from mhla_gen.commands import COMMANDS

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
SCRIPT = re.compile(r"^(?:\./)?((?:scripts|eval|benchmarks)/\w+\.py)$")
TRAINING = {"train-dit", "finetune-sana", "finetune-sana-video", "finetune-wan", "finetune-wan-i2v",
            "linearize"}
IMPORT = re.compile(r"^[ \t]*from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([\w\s,]+\)|[\w \t,]+)", re.M)


def blocks(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(page:line, text)`` of every fenced block whose language is one of ``kinds``."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) in kinds:
                found.append((f"{page.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}",
                              match.group(2)))
    return found


def inline_spans() -> list[tuple[str, str]]:
    """``(page, text)`` of every inline code span outside the fenced blocks."""
    return [(str(page.relative_to(REPO)), span) for page in PAGES
            for span in INLINE.findall(FENCE.sub("", page.read_text()))]


# ------------------------------------------------------------------------------------ python names
def resolves(dotted: str) -> bool:
    """``mhla_gen.a.b.c`` names a module or an attribute of one (a module or any object)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def imported_names(code: str, package: str = "mhla_gen.bases") -> set[str]:
    """Dotted names the ``from X import a, b`` / ``import X`` lines of ``code`` need (relative imports are
    read from inside ``package``: the base records' example in docs/extending.md)."""
    names = set()
    for module, listed in IMPORT.findall(code):
        module = importlib.util.resolve_name(module, package)
        if module.split(".")[0] == "mhla_gen":
            listed = [n.split(" as ")[0].strip() for n in listed.strip("()").split(",")]
            names |= {f"{module}.{n}" for n in listed if n}
    names |= {m for m in re.findall(r"^\s*import\s+(mhla_gen[.\w]*)", code, re.M)}
    return names


def documented_names() -> dict[str, str]:
    """Every ``mhla_gen`` name the pages import or spell out (``mhla_gen.x.y``, ``Ref("mhla_gen.x:y")``),
    with the first place it appears."""
    places = {}
    for page in PAGES:
        text = page.read_text()
        where = str(page.relative_to(REPO))
        code = "\n".join(body for kind, body in FENCE.findall(text) if kind == "python")
        names = imported_names(code)
        names |= {m.rstrip(".") for m in re.findall(r"(?<![\w/.])mhla_gen(?:\.\w+)+(?![\w/])", text)}
        names |= {f"{m}.{a}" for m, a in re.findall(r"\b(mhla_gen[.\w]*):(\w+)", text)}
        for name in names:
            places.setdefault(name, where)
    return places


def test_every_documented_mhla_gen_name_exists():
    places = documented_names()
    assert len(places) > 40
    missing = sorted(f"{name} ({where})" for name, where in places.items() if not resolves(name))
    assert missing == []


# ---------------------------------------------------------------------------------- command lines
def command_lines() -> list[tuple[str, str, list[str], bool]]:
    """``(place, program, arguments, whole)`` of every command line in the bash blocks and inline code spans
    that runs a checkout script (``python scripts/x.py``) or a ``mhla-gen`` command; ``program`` is the
    command's name or the script's path. Placeholders (``...``, ``$VAR``) and ``[optional]`` brackets
    are dropped; ``whole``: a line of a block that leaves nothing out (no ``...``), to be run as written."""
    found = []
    sources = [(where, text, True) for where, text in blocks(("bash", "sh", ""))]
    sources += [(where, text, False) for where, text in inline_spans()]
    for where, text, block in sources:
        for line in text.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote: prose, not a command
                continue
            for i, word in enumerate(words):
                script = SCRIPT.match(word)
                if script and (i == 0 or words[i - 1] != "--config"):
                    program = next((n for n, c in COMMANDS.items() if c.script == script.group(1)),
                                   script.group(1))
                elif word == "mhla-gen" or (word == "mhla_gen" and i and words[i - 1] == "-m"):
                    if i + 1 >= len(words) or words[i + 1] not in COMMANDS:
                        continue
                    program, i = words[i + 1], i + 1
                else:
                    continue
                args = [a.strip("[]") if a.startswith("[-") or a.endswith("]") and "=" not in a else a
                        for a in words[i + 1:] if a != "..." and "$" not in a and a not in ("&&", "|")]
                found.append((where, program, args, block and "..." not in words))
                break
    return found


def main_of(program: str):
    if program in COMMANDS:
        return importlib.import_module(COMMANDS[program].module).main
    return load_script(program, f"_docs_{Path(program).stem}").main


def option_strings(program: str, args: list[str]) -> set[str]:
    """The flags the parsers of ``program --help`` take (with ``--base`` of ``args``: its settings may
    differ), read from the parsers themselves (the help's prose may name flags of other commands)."""
    base = args[args.index("--base"):args.index("--base") + 2] if "--base" in args else []
    base = base if base[1:] and base[1] in BASES else []  # `--base NAME` in prose: the default's help
    flags, parse = set(), argparse.ArgumentParser.parse_known_args

    def options(parser: argparse.ArgumentParser) -> set[str]:  # a subcommand's too (eval/results.py render)
        subparsers = [a.choices.values() for a in parser._actions
                      if isinstance(a, argparse._SubParsersAction)]
        return set(parser._option_string_actions).union(*(options(p) for c in subparsers for p in c))

    def recording(parser, *a, **kw):
        flags.update(options(parser))
        return parse(parser, *a, **kw)

    with (mock.patch.object(argparse.ArgumentParser, "parse_known_args", recording),
          contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit)):
        main_of(program)([*base, "--help"])
    return flags


def test_every_documented_command_line_uses_its_commands_flags():
    lines = command_lines()
    assert len(lines) > 60 and {p for _, p, _, _ in lines} >= {"train-dit", "linearize", "sample", "generate"}
    unknown = []
    helps = {}
    for where, program, args, _ in lines:
        key = (program, tuple(args[args.index("--base"):][:2]) if "--base" in args else ())
        if key not in helps:
            helps[key] = option_strings(program, args)
        flags = [a.split("=")[0] for a in args if re.match(r"--?[A-Za-z]", a)]
        unknown += [f"{where}: {program} {flag}" for flag in flags if flag not in helps[key]]
    assert unknown == []


class Loaded(Exception):
    """Raised in place of running: the command's settings loaded."""


def test_every_documented_training_and_generate_command_loads_its_settings(monkeypatch):
    """``--config NAME key=value ...`` of each training / ``generate`` command line of a block is a valid
    config (known keys, right types, checks passed); nothing runs."""
    import mhla_gen.train.config as train_config
    from mhla_gen.commands import generate

    real = train_config.load_config

    def load_and_stop(*args, **kwargs):
        real(*args, **kwargs)
        raise Loaded

    monkeypatch.setattr(train_config, "load_config", load_and_stop)
    monkeypatch.setattr(generate, "load_config", load_and_stop)
    checked, failed = 0, []
    for where, program, args, whole in command_lines():
        if not whole or program not in TRAINING | {"generate"}:
            continue
        try:
            main_of(program)(args)
        except Loaded:
            checked += 1
        except (ValueError, OSError, SystemExit) as err:
            failed.append(f"{where}: {program} {' '.join(args)}: {err}")
    assert checked > 30 and failed == []


def setting_keys() -> set[str]:
    """Every dotted setting (``train.max_steps``, ``mhla``, ...) of the training, stage-1 and generate
    configs."""
    from omegaconf import OmegaConf

    from mhla_gen.commands.generate import GenerateConfig
    from mhla_gen.train.linearize import stage1_schema

    def keys(conf, prefix: str = "") -> set[str]:
        found = set()
        for key in conf.keys():
            found.add(f"{prefix}{key}")
            if OmegaConf.is_dict(node := conf._get_node(key)):
                found |= keys(node, f"{prefix}{key}.")
        return found

    schemas = [GenerateConfig] + [schema for base in BASES.values() if base.trains
                                  for schema in (base.run_config.load(), stage1_schema(base))]
    return set().union(*(keys(OmegaConf.structured(schema)) for schema in schemas))


def test_every_setting_the_prose_names_exists():
    """``section.key=value`` in the pages' inline code (``train.trainable=lora``) is a setting of some
    command (the command lines of the blocks are loaded whole above)."""
    known = setting_keys()
    named = {(where, m) for where, span in inline_spans()
             for m in re.findall(r"(?<![\w.\-/])([a-z_]\w*(?:\.\w+)+)=", span)}
    assert len(named) > 30 and sorted(f"{where}: {key}" for where, key in named if key not in known) == []


def test_the_record_examples_of_extending_md_are_the_records():
    """docs/extending.md shows two base records to copy: run as a module of ``mhla_gen.bases``, each equals
    the record of its name field by field (a rope text cut short with ``...`` aside)."""
    import dataclasses
    import types

    examples = [code for where, code in blocks(("python",))
                if where.startswith("docs/extending.md") and "BASE = " in code]
    assert len(examples) == 2
    for code in examples:
        module = types.ModuleType("mhla_gen.bases._docs_example")
        module.__package__ = "mhla_gen.bases"
        exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
        shown, real = module.BASE, BASES[module.BASE.name]
        differ = [f.name for f in dataclasses.fields(real) if getattr(shown, f.name) != getattr(real, f.name)
                  and not (f.name == "grid" and shown.grid.rope.endswith("...")
                           and shown.grid.ndim == real.grid.ndim)]
        assert type(shown).__name__ == type(real).__name__ and differ == [], shown.name
