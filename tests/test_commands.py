"""The ``mhla-gen`` command: every subcommand dispatches to the code its checkout script runs, ``--help``
lists them without importing them, and ``--config`` takes a shipped config's name as well as a path."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from script_helpers import load_script
from train_helpers import REPO, subprocess_env

from mhla_gen.commands import COMMANDS
from mhla_gen.commands.cli import main
from mhla_gen.configs import CONFIG_DIR, resolve_config, shipped_config, shipped_configs

# the subcommands the package promises (issue 54); `configs` lists the shipped configs
PROMISED = ["train-dit", "finetune-sana", "finetune-sana-video", "finetune-wan", "finetune-wan-i2v",
            "linearize", "convert-wan", "extract-latents", "sample", "generate", "fid", "vbench",
            "attention-stats", "adopt"]


def load_file(path: Path):
    return load_script(path, f"_cmd_{path.stem}")


def test_every_promised_command_is_there():
    assert set(PROMISED) <= set(COMMANDS) and set(COMMANDS) - set(PROMISED) == {"configs"}


@pytest.mark.parametrize("name", sorted(n for n, c in COMMANDS.items() if c.script))
def test_the_checkout_script_runs_the_commands_main(name):
    """``python scripts/x.py`` and ``mhla-gen x`` are one program: the script's ``main`` is the command's."""
    command = COMMANDS[name]
    script = load_file(REPO / command.script)
    assert script.main is importlib.import_module(command.module).main


def test_every_script_and_eval_entry_is_a_command_or_a_checkout_tool():
    """A new script under scripts/ or eval/ gets a subcommand, or is named here as needing a checkout."""
    checkout_only = {"scripts/gpu_check.py", "scripts/diffusers_model_tests.py",  # the repo's tests
                     "eval/study.py", "eval/adaptation.py", "eval/scale_study.py",  # research harnesses,
                     "eval/stream_study.py", "eval/stream_bed.py", "eval/stream_report.py",  # run from a
                     "eval/results.py"}  # checkout (their records and pages live in it)
    scripts = {str(p.relative_to(REPO)) for d in ("scripts", "eval") for p in (REPO / d).glob("*.py")}
    assert scripts == {c.script for c in COMMANDS.values() if c.script} | checkout_only


def test_help_lists_every_command_with_its_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mhla-gen [-h] [--version] COMMAND [ARGS ...]")
    for name, command in COMMANDS.items():
        assert f"  {name} " in out and command.summary in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_its_own_help(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mhla-gen"])
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith("usage: ") and f"mhla-gen {name}" in usage, usage[:200]


def test_help_texts_keep_their_continued_example_lines():
    """An example command continued with a backslash in a docstring prints as two lines in ``--help``
    only in a raw string: in a plain one Python swallows the backslash and the newline, and the help shows
    one line with a gap. Every non-raw string literal of the commands and checkout tools is checked."""
    import io
    import tokenize

    swallowed = []
    for folder in ("mhla_gen", "scripts", "eval", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
                prefix = token.string[:len(token.string) - len(token.string.lstrip("rRbBuUfF"))]
                if token.type == tokenize.STRING and "r" not in prefix.lower() and "\\\n" in token.string:
                    swallowed.append(f"{path.relative_to(REPO)}:{token.start[0]}")
    assert not swallowed, swallowed


def test_unknown_command_and_no_command_exit_2(capsys):
    for argv in (["train"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "invalid choice: 'train'" in capsys.readouterr().err


def test_a_commands_error_is_one_line_named_after_the_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["mhla-gen"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["train-dit", "--config", "no_such_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("mhla-gen train-dit: error: --config 'no_such_config' is no file")
    assert "tiny/dit" in err[0] and "dit_digits" in err[0]  # the shipped names, to pick from
    assert not (tmp_path / "runs").exists()


def test_the_dispatcher_imports_no_command_to_list_them():
    """``mhla-gen --help`` (and ``import mhla_gen``) loads no command, training loop, pipeline or metric."""
    code = ("import sys, mhla_gen.commands.cli\n"
            "try:\n    mhla_gen.commands.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = ('mhla_gen.commands.', 'mhla_gen.train', 'mhla_gen.pipelines')\n"
            "metrics = {f'mhla_gen.metrics.{m}' for m in ('fid', 'extractors', 'video', 'attention')}\n"
            "loaded = [m for m in sys.modules if m.startswith(heavy) or m in metrics]\n"
            "loaded = [m for m in loaded if m != 'mhla_gen.commands.cli']  # the dispatcher itself\n"
            "print(sorted(loaded), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env=subprocess_env())
    assert out.stderr.strip().splitlines()[-1] == "[]" and "train-dit" in out.stdout


# ------------------------------------------------------------------------------------------- configs
def test_a_config_is_found_by_name_in_every_spelling():
    tiny = CONFIG_DIR / "tiny" / "dit.yaml"
    for spelling in ("tiny/dit", "tiny/dit.yaml", "configs/tiny/dit.yaml", "./configs/tiny/dit.yaml"):
        assert resolve_config(spelling) == tiny, spelling
    assert resolve_config("dit_digits") == CONFIG_DIR / "dit_digits.yaml"
    assert "linearize/wan_1_3b_480p" in shipped_configs() and "accelerate/fsdp" in shipped_configs()


def test_a_file_at_the_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "tiny").mkdir(parents=True)
    (tmp_path / "configs" / "tiny" / "dit.yaml").write_text("seed: 3\n")  # the user's own file
    assert resolve_config("configs/tiny/dit.yaml") == Path("configs/tiny/dit.yaml")
    assert resolve_config("tiny/dit") == CONFIG_DIR / "tiny" / "dit.yaml"


def test_a_name_stays_a_name_and_the_error_lists_the_names(tmp_path, monkeypatch):
    assert (CONFIG_DIR / "../configs/tiny/dit.yaml").is_file()  # a file, but not by a name's rules
    assert shipped_config("../configs/tiny/dit") is None and shipped_config("/tiny/dit") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    with pytest.raises(FileNotFoundError, match=r"--config 'tiny' is a folder and names no shipped config"):
        resolve_config("tiny")
    with pytest.raises(FileNotFoundError, match=r"^--config 'nope' is no file.*configs: accelerate/ddp, "):
        resolve_config("nope")


def test_python_dash_m_mhla_gen_runs_a_command(tmp_path):
    """``python -m mhla_gen`` from a folder without a checkout: the configs command prints a shipped file."""
    result = subprocess.run([sys.executable, "-m", "mhla_gen", "configs", "tiny/dit"], capture_output=True,
                            text=True, cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()) == CONFIG_DIR / "tiny" / "dit.yaml"


def test_generate_takes_a_config_by_name(tmp_path, monkeypatch):
    """``generate --config eval/dit_digits``: the shipped file is read (its run_config is missing here)."""
    from mhla_gen.commands.generate import main as generate

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"runs/dit_digits/config\.yaml"):
        generate(["--config", "eval/dit_digits", f"output_dir={tmp_path / 'samples'}"])
    with pytest.raises(FileNotFoundError, match=r"--config 'eval/nope' is no file"):
        generate(["--config", "eval/nope"])


def test_every_config_the_docs_name_ships():
    """``configs/<name>.yaml`` or ``mhla_gen/configs/<name>.yaml`` in README and docs/ is a shipped config."""
    import re

    texts = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    named = {m for path in texts for m in re.findall(r"(?<![\w/])(?:mhla_gen/)?configs/([\w/.-]+\.yaml)",
                                                     path.read_text())}
    assert len(named) > 5 and sorted(n for n in named if shipped_config(n) is None) == []


@pytest.mark.parametrize("name", ["train-dit", "finetune-wan", "linearize", "extract-latents"])
def test_a_commands_help_shows_its_examples(name, capsys, monkeypatch):
    """``--help`` of the training, conversion and cache commands prints their docstring's example
    commands as written (continued lines included), not its first line alone."""
    monkeypatch.setattr(sys, "argv", ["mhla-gen"])
    with pytest.raises(SystemExit):
        main([name, "--help"])
    usage = capsys.readouterr().out
    examples = [line for line in importlib.import_module(COMMANDS[name].module).__doc__.splitlines()
                if line.strip().startswith("mhla-gen ")]
    assert examples and all(line in usage for line in examples), usage
