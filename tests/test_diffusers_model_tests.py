"""``scripts/diffusers_model_tests.py`` (diffusers' own model suites, stock and with MHLA): which suites it
runs and how it reads the outcomes. The suites themselves need a diffusers git checkout, which CI does not
have: the script is run by hand (docs/diffusers.md gives the command and the last results)."""

from __future__ import annotations

from pathlib import Path

from script_helpers import load_script

from mhla_gen.bases import BASES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "diffusers_model_tests.py"


def _script():
    return load_script(SCRIPT, "diffusers_model_tests_script")


def test_every_base_record_has_a_suite():
    """A base record runs diffusers' suite of its transformer class (``Base.diffusers_tests``) or one the
    script writes (Wan I2V: diffusers' Wan suite builds text-to-video models only)."""
    script = _script()
    missing = sorted(set(BASES) - set(script.SUITES))
    assert set(script.SUITES) == set(BASES), f"no diffusers suite for {missing}"
    for path, source in script.WRITTEN.items():
        assert path in script.SUITES.values()
        compile(source, path, "exec")
        assert "from .test_models_transformer_wan import WanTransformer3DTesterConfig" in source


def test_only_class_name_tests_may_differ():
    script = _script()
    test = "tests.models.transformers.test_x::TestX::"
    stock = {f"{test}test_gradient_checkpointing_is_applied": "passed", f"{test}test_a": "passed",
             f"{test}test_logs_info_when_no_lora_keys_found": "passed", f"{test}test_b": "failed"}
    mhla = {**stock, f"{test}test_gradient_checkpointing_is_applied": "failed",
            f"{test}test_logs_info_when_no_lora_keys_found": "skipped", f"{test}test_a": "failed"}
    expected, unexpected = script.differences(stock, mhla)
    names = [line.split(": stock")[0] for line in expected]
    assert names == [f"{test}test_gradient_checkpointing_is_applied"]
    # a class-name test skipped with MHLA did not fail on a class name: reported
    assert sorted(line.split(": stock")[0] for line in unexpected) == [
        f"{test}test_a", f"{test}test_logs_info_when_no_lora_keys_found"]
    assert script.differences(stock, stock) == ([], [])


def test_a_missing_checkout_or_revision_is_one_line_before_out_is_claimed(tmp_path, capsys, monkeypatch):
    """``--diffusers`` that is no folder or no git dir, or a ``--rev`` it does not hold, stops in one line
    naming the setting before ``--out`` is claimed (git's CalledProcessError was a traceback after it)."""
    import subprocess
    import sys

    import pytest

    from mhla_gen.commands.cli import run

    script = _script()
    checkout = tmp_path / "diffusers"
    checkout.mkdir()
    (tmp_path / "empty").mkdir()
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (checkout / "setup.py").write_text("")
    subprocess.run([*git, "add", "setup.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    cases = [(["--diffusers", str(tmp_path / "missing")], "--diffusers '", "is not a folder"),
             (["--diffusers", str(tmp_path / "empty")], "--diffusers '", "is not a git checkout"),
             (["--diffusers", str(checkout), "--rev", "v9.9.9"], "--rev 'v9.9.9' names no commit", "")]
    for argv, setting, problem in cases:
        monkeypatch.setattr(sys, "argv", ["diffusers_model_tests.py"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            run(lambda argv=argv: script.main([*argv, "--out", str(tmp_path / "out")]))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert setting in err and problem in err, err
    assert not (tmp_path / "out").exists()
