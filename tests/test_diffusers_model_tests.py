"""``scripts/diffusers_model_tests.py`` (diffusers' own model and pipeline suites, stock and with MHLA): which
suites it runs, what it exports, its Hub stand-ins and how it reads the outcomes. The suites themselves need a
diffusers git checkout, which CI does not have: the script is run by hand (docs/diffusers.md gives the
command and the last results)."""

from __future__ import annotations

from pathlib import Path

from script_helpers import load_script

from mhla_gen.bases import BASES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "diffusers_model_tests.py"


def _script():
    return load_script(SCRIPT, "diffusers_model_tests_script")


def test_every_base_record_has_a_suite():
    """A base record runs diffusers' suite of its transformer class (``Base.diffusers_tests``) or one the
    script writes (Wan I2V: diffusers' Wan suite builds text-to-video models only), and the suites of its
    pipelines (``Base.diffusers_pipeline_tests``)."""
    script = _script()
    for suites in (script.MODEL_SUITES, script.PIPELINE_SUITES):
        missing = sorted(set(BASES) - set(suites))
        assert set(suites) == set(BASES), f"no diffusers suite for {missing}"
    for path, source in script.WRITTEN.items():
        assert (path,) in script.MODEL_SUITES.values()
        compile(source, path, "exec")
        assert "from .test_models_transformer_wan import WanTransformer3DTesterConfig" in source
    pipeline_paths = [path for paths in script.PIPELINE_SUITES.values() for path in paths]
    assert len(set(pipeline_paths)) == len(pipeline_paths)
    assert all(path.startswith("tests/pipelines/") and path.endswith(".py") for path in pipeline_paths)


def test_only_the_expected_differences_may_differ():
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
    # a pipeline's output against a slice recorded from the stock attention; its save / load must pass
    pipe = "tests.pipelines.wan.test_wan::TestWanPipeline::"
    stock = {f"{pipe}test_inference": "passed", f"{pipe}test_save_load_local": "passed"}
    mhla = {f"{pipe}test_inference": "failed", f"{pipe}test_save_load_local": "failed"}
    expected, unexpected = script.differences(stock, mhla)
    assert [line.split(": stock")[0] for line in expected] == [f"{pipe}test_inference"]
    assert [line.split(": stock")[0] for line in unexpected] == [f"{pipe}test_save_load_local"]
    # ... which the MHLA run may meet where the stock run (with the Hub stand-ins) missed it; not a skip
    assert len(script.differences({**stock, f"{pipe}test_inference": "failed"}, stock)[0]) == 1
    assert len(script.differences(stock, {**stock, f"{pipe}test_inference": "skipped"})[1]) == 1


def test_a_missing_checkout_or_revision_is_one_line_before_out_is_claimed(tmp_path, capsys, monkeypatch):
    """``--diffusers`` that is no folder or no git dir, a ``--rev`` it does not hold, a ``--suites`` base
    without such a suite, suites the revision lacks or that import a module not installed stop in one line
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
    (checkout / "tests" / "pipelines" / "dit").mkdir(parents=True)
    (checkout / "tests" / "pipelines" / "dit" / "test_dit.py").write_text("import no_such_module_of_tests\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    monkeypatch.setattr(script, "PIPELINE_SUITES", {"dit": ("tests/pipelines/dit/test_dit.py",)})
    cases = [(["--diffusers", str(tmp_path / "missing")], "--diffusers '", "is not a folder"),
             (["--diffusers", str(tmp_path / "empty")], "--diffusers '", "is not a git checkout"),
             (["--diffusers", str(checkout), "--rev", "v9.9.9"], "--rev 'v9.9.9' names no commit", ""),
             (["--diffusers", str(checkout), "--pipelines", "--suites", "sana"], "--suites sana: no pipeline",
              "those with one: dit"),
             (["--diffusers", str(checkout), "--pipelines"], "--rev HEAD import no_such_module_of_tests, not "
              "installed", "(pip install no_such_module_of_tests)"),
             (["--diffusers", str(checkout)], "--rev HEAD has no tests/models/transformers/", "")]
    for argv, setting, problem in cases:
        monkeypatch.setattr(sys, "argv", ["diffusers_model_tests.py"])
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            run(lambda argv=argv: script.main([*argv, "--out", str(tmp_path / "out")]))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert setting in err and problem in err, err
    assert not (tmp_path / "out").exists()


def _commit(checkout: Path, files: dict[str, str]) -> None:
    """A git repository at ``checkout`` holding ``files`` (path -> text) in one commit."""
    import subprocess

    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    for name, text in files.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)


def test_the_export_follows_relative_imports(tmp_path):
    """A suite comes with what it imports, transitively: ``from ..x import y`` (``x`` a module or a package,
    ``y`` a module of it), imports inside functions, the packages above each file, diffusers' conftest; the
    suite the script writes (Wan I2V) from its own source. Nothing else; what is not installed is named."""
    script = _script()
    files = {
        "setup.py": "", "tests/__init__.py": "", "tests/conftest.py": "", "tests/testing_utils.py": "",
        "tests/unrelated.py": "",
        "tests/pipelines/__init__.py": "",
        "tests/pipelines/common.py": "from ..testing_utils import device\n",
        "tests/pipelines/helpers/__init__.py": "from .cache import CacheMixin\n",
        "tests/pipelines/helpers/cache.py": "import no_such_module_of_the_tests\n",
        "tests/pipelines/helpers/unused.py": "",
        "tests/pipelines/wan/__init__.py": "",
        "tests/pipelines/wan/fixtures.py": "try:\n    import cv2\nexcept ImportError:\n    pass\n",
        "tests/pipelines/wan/test_wan.py": "import torch\nfrom ..common import A\n"
        "from ..helpers import CacheMixin\nfrom . import fixtures\n\n\n"
        "def test_x():\n    from ...models.vae import Vae\n",
        "tests/pipelines/wan/test_other.py": "",
        "tests/models/__init__.py": "", "tests/models/vae.py": "",
        "tests/models/testing_utils/__init__.py": "", "tests/models/transformers/__init__.py": "",
        "tests/models/transformers/test_models_transformer_wan.py": "",
    }
    _commit(tmp_path, files)
    git = script.git_command(tmp_path)
    exported = script.exported_files(git, "HEAD", ["tests/pipelines/wan/test_wan.py"])
    assert sorted(exported) == sorted([
        "tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", "tests/pipelines/__init__.py",
        "tests/pipelines/common.py", "tests/pipelines/helpers/__init__.py",
        "tests/pipelines/helpers/cache.py", "tests/pipelines/wan/__init__.py",
        "tests/pipelines/wan/fixtures.py", "tests/pipelines/wan/test_wan.py", "tests/models/__init__.py",
        "tests/models/vae.py"])
    assert exported["tests/pipelines/common.py"] == files["tests/pipelines/common.py"].encode()
    # module-level imports only: a guarded one (cv2) is the test's own business
    assert script.missing_modules(exported) == ["no_such_module_of_the_tests"]

    written = script.exported_files(git, "HEAD", [script.WAN_I2V_SUITE])
    assert written[script.WAN_I2V_SUITE] == script.WAN_I2V_SOURCE.encode()
    assert {"tests/models/transformers/test_models_transformer_wan.py", "tests/testing_utils.py",
            "tests/models/testing_utils/__init__.py"} < set(written)


def test_the_hub_stand_ins_fit_the_tiny_pipelines():
    """The stand-ins build, offline, what diffusers' tiny pipelines read from the Hub: a width-32 T5 (Wan's
    ``text_dim``) whose vocabulary covers its tokenizer, and a Gemma tokenizer with ids below 8 (the tiny
    Gemma2 encoders' vocabulary) that starts with ``<bos>``; other names go to the original loader."""
    import types

    from transformers import AutoConfig, GemmaTokenizer, T5Config, T5EncoderModel

    script = _script()
    standins = types.ModuleType("hub_standins")
    exec(compile(script.HUB_STANDINS, "hub_standins.py", "exec"), standins.__dict__)  # no pytest_configure
    config = standins.tiny_random_t5_config()
    tokens = standins.tiny_random_t5_tokenizer()(["dance monkey", "a photo of an unknown word"], padding=True,
                                                 return_tensors="pt")
    assert 0 <= int(tokens.input_ids.min()) and int(tokens.input_ids.max()) < config.vocab_size
    hidden = T5EncoderModel(config).eval()(**tokens).last_hidden_state
    assert hidden.shape == (2, tokens.input_ids.shape[1], 32)

    gemma = standins.dummy_gemma_tokenizer()
    gemma.padding_side = "right"  # as SanaPipeline sets it
    ids = gemma(["", "a long prompt of many words"], padding="max_length", max_length=16,
                truncation=True).input_ids
    assert all(row[0] == gemma.bos_token_id and max(row) < 8 for row in ids)

    load_config = standins._standing_in(AutoConfig).__get__(None, AutoConfig)
    assert isinstance(load_config("hf-internal-testing/tiny-random-t5"), T5Config)
    load_gemma = standins._standing_in(GemmaTokenizer).__get__(None, GemmaTokenizer)
    assert isinstance(load_gemma("hf-internal-testing/dummy-gemma"), GemmaTokenizer)


def test_the_hub_stand_ins_pass_other_names_on(tmp_path):
    """A name that is not a stand-in (a pipeline saved by a round-trip test) loads as before."""
    import types

    from transformers import AutoConfig, BertConfig

    script = _script()
    standins = types.ModuleType("hub_standins")
    exec(compile(script.HUB_STANDINS, "hub_standins.py", "exec"), standins.__dict__)
    BertConfig(hidden_size=8).save_pretrained(tmp_path)
    loaded = standins._standing_in(AutoConfig).__get__(None, AutoConfig)(str(tmp_path))
    assert isinstance(loaded, BertConfig) and loaded.hidden_size == 8


def test_each_suite_runs_with_the_stand_ins_and_only_the_mhla_run_installs_mhla(tmp_path, monkeypatch):
    import subprocess

    script = _script()
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        xml = next(arg for arg in command if arg.startswith("--junitxml=")).split("=", 1)[1]
        Path(xml).write_text('<testsuite><testcase classname="tests.pipelines.dit.test_dit.T" name="test_a"/>'
                             '</testsuite>')
        return subprocess.CompletedProcess(command, 0, stdout="mhla_plugin: MHLA attention ran 3 times\n")

    monkeypatch.setattr(script.subprocess, "run", fake_run)
    for mode in ("stock", "mhla"):
        outcomes, used = script.run_suite("tests/pipelines/dit/test_dit.py", mode, tmp_path, {})
        assert outcomes == {"T::test_a": "passed"} and used == ["mhla_plugin: MHLA attention ran 3 times"]
    plugins = [[command[i + 1] for i, arg in enumerate(command) if arg == "-p"] for command in commands]
    assert plugins == [["no:cacheprovider", "hub_standins"],
                       ["no:cacheprovider", "hub_standins", "mhla_plugin"]]


def test_adopt_proves_an_export_with_the_hub_stand_ins(tmp_path):
    """``mhla-gen adopt`` recognises an export of this script (the stand-ins plugin too); a foreign file of
    that name is not ours."""
    import pytest

    from mhla_gen.commands.adopt import Misfit, prove_diffusers_tests

    script = _script()
    (tmp_path / "tests").mkdir()
    (tmp_path / "mhla_plugin.py").write_text(script.PLUGIN)
    (tmp_path / "hub_standins.py").write_text(script.HUB_STANDINS)
    (tmp_path / "stock_test_dit.xml").write_text("<testsuite/>")
    prove_diffusers_tests(tmp_path)
    (tmp_path / "hub_standins.py").write_text("print('a user file')\n")
    with pytest.raises(Misfit, match="hub_standins.py: not the Hub stand-ins"):
        prove_diffusers_tests(tmp_path)


def test_the_pipeline_suites_blocks_fit_diffusers_tiny_wan_pipeline(tmp_path):
    """diffusers' tiny Wan pipelines give a (3, 1, 1) token grid: the blocks the pipeline run installs fit it
    (frames only), those of the model run are refused there, and the written plugin installs the run's."""
    import pytest
    import torch
    from diffusers import WanTransformer3DModel

    from mhla_gen import MHLAConfig, install_mhla

    script = _script()
    ranks = {base.grid.ndim for base in BASES.values()}
    assert set(script.PIPELINE_BLOCKS) == set(script.MODEL_BLOCKS) == ranks
    script.export({}, tmp_path, script.PIPELINE_BLOCKS)
    plugin = (tmp_path / "mhla_plugin.py").read_text()
    compile(plugin, "mhla_plugin.py", "exec")
    assert f"BLOCKS = {script.PIPELINE_BLOCKS!r}" in plugin and "__BLOCKS__" not in plugin

    torch.manual_seed(0)
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                  out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)  # diffusers' tests/pipelines/wan
    latent = torch.randn(1, 16, 3, 2, 2)  # 9 frames of 16 px through Wan's VAE (4x time, 8x space)
    inputs = dict(hidden_states=latent, timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 4, 32))
    for blocks, fits in ((script.PIPELINE_BLOCKS[3], True), (script.MODEL_BLOCKS[3], False)):
        mhla = MHLAConfig(blocks=blocks, cpe_kernel=3, gate=True)
        model = install_mhla(WanTransformer3DModel(**config), mhla)
        if fits:
            assert model(**inputs).sample.shape == latent.shape
        else:
            with pytest.raises(ValueError, match=r"do not fit the token grid \(3, 1, 1\)"):
                model(**inputs)
