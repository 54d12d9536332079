"""Strict config loading: defaults -> YAML -> CLI, every YAML in configs/ valid, bad keys named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mhla_gen.bases import BASES
from mhla_gen.train.config import DiTRunConfig, SanaRunConfig, WanRunConfig, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "mhla_gen" / "configs"
SCHEMAS = {name: base.run_config.load() for name, base in BASES.items() if base.trains}  # each record's
TRAINING_YAMLS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name not in ("accelerate", "eval"))


def schema_for(path: Path):
    """The config class a YAML is for: its name's first word (``dit``, ``sana``, ``wan``); stage-1 configs
    live in configs/linearize/."""
    if path.parent.name == "linearize":
        from mhla_gen.bases import base_for
        from mhla_gen.train.linearize import stage1_schema

        return stage1_schema(base_for(path.stem.split("_")[0]))
    return SCHEMAS[path.stem.split("_")[0]]


def test_training_configs_exist():
    names = {str(p.relative_to(CONFIGS)) for p in TRAINING_YAMLS}
    assert {"dit_digits.yaml", "tiny/dit.yaml", "tiny/sana.yaml", "tiny/wan.yaml"} <= names


@pytest.mark.parametrize("path", TRAINING_YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_training_yaml_loads_strictly(path):
    cfg = load_config(schema_for(path), path)
    raw = yaml.safe_load(path.read_text())
    assert cfg.output_dir == raw.get("output_dir", cfg.output_dir)
    if "train" in raw and "max_steps" in raw["train"]:
        assert cfg.train.max_steps == raw["train"]["max_steps"]


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_are_valid(path):
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_processes >= 2


def test_precedence_defaults_yaml_cli(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("seed: 7\ntrain:\n  max_steps: 11\n  learning_rate: 0.5\n")
    cfg = load_config(DiTRunConfig, f, ["train.max_steps=3", "mhla.blocks=[2,2]"])
    assert (cfg.seed, cfg.train.max_steps, cfg.train.learning_rate) == (7, 3, 0.5)  # yaml, cli, yaml
    assert cfg.mhla.blocks == (2, 2) and cfg.train.global_batch_size == 256  # cli, default


def test_unknown_yaml_key_is_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ValueError, match="max_stepz"):
        load_config(DiTRunConfig, f)


def test_a_run_config_from_before_the_debug_section_left_still_loads(tmp_path):
    """Fault injection moved to tests/fault_injection.py: an older run's config.yaml (with its debug
    section) loads, and the keys are unknown on the command line."""
    f = tmp_path / "config.yaml"
    f.write_text("seed: 3\ndebug:\n  kill_after_step: 0\n  kill_during_checkpoint: 0\n")
    assert load_config(DiTRunConfig, f).seed == 3
    with pytest.raises(ValueError, match="debug"):
        load_config(DiTRunConfig, None, ["debug.kill_after_step=3"])


@pytest.mark.parametrize(
    "override, named",
    [
        ("train.learning_rat=1", "learning_rat"),
        ("mhla.blokcs=[2,2]", "blokcs"),
        ("train.max_steps=abc", "max_steps"),
        ("model.attention=flash", "model.attention"),
        ("train.trainable=some", "train.trainable"),
        ("mhla.feature_map=tanh", "feature_map"),
    ],
)
def test_bad_cli_override_is_named(override, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_config(SanaRunConfig, None, [override])


def test_missing_config_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(WanRunConfig, tmp_path / "nope.yaml")


def test_yaml_boolean_no_is_mixed_precision_no(tmp_path):
    """YAML 1.1 reads a bare `no` as False; `train.mixed_precision: no` still means no mixed precision."""
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  mixed_precision: no\n")
    assert load_config(DiTRunConfig, f).train.mixed_precision == "no"
    assert load_config(DiTRunConfig, None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config(DiTRunConfig, f, ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"


def test_errors_say_where_the_bad_key_came_from(tmp_path):
    """A typo on the command line is not blamed on the YAML file, and the reverse."""
    from mhla_gen.errors import ConfigError

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("seed: 1\n")
    bad.write_text("seed: 1\ntrain:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match=r"^invalid config on the command line: Key 'max_stepz'") as err:
        load_config(DiTRunConfig, good, ["train.max_stepz=3"])
    assert "good.yaml" not in str(err.value) and "object_type" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^invalid config in .*bad\.yaml: Key 'max_stepz'"):
        load_config(DiTRunConfig, bad, ["seed=2"])
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"invalid config in .*bad\.yaml"):
        load_config(DiTRunConfig, bad)


def test_documented_output_dirs_are_the_configs():
    """Commands in the README and configs/eval that read a training run's final/ name its output_dir."""
    import re

    readme = (REPO / "README.md").read_text()
    texts = [readme] + [p.read_text() for p in (CONFIGS / "eval").glob("*.yaml")]
    finals = {m for t in texts for m in re.findall(r"(runs/[\w.-]+)/final", t)}
    outputs = {load_config(schema_for(p), p).output_dir for p in TRAINING_YAMLS}
    outputs |= set(re.findall(r"output_dir=(runs/[\w.-]+)", readme))  # a documented command writes it
    assert finals and finals <= outputs | {"runs/x", "runs/dit", "runs/sana", "runs/wan"}, finals - outputs


def test_wan_hybrid_yaml_is_the_preset():
    """configs/wan_mhla_hybrid.yaml keeps softmax where the preset and the released model do (0, 3, ...)."""
    from mhla_gen import MHLAConfig

    cfg = load_config(WanRunConfig, CONFIGS / "wan_mhla_hybrid.yaml")
    assert cfg.mhla == MHLAConfig.preset("wan2.1-1.3b-480p-hybrid")
    assert sorted(set(range(30)) - set(cfg.mhla.layers)) == list(range(0, 30, 3))


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", TRAINING_YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_training_yamls_list_only_deviations(path):
    """As the README says: a config file lists what differs from the dataclass defaults, nothing else."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.structured(schema_for(path)))
    repeated = []
    for key, value in _leaves(yaml.safe_load(path.read_text())):
        default = defaults
        for part in key.split("."):
            default = default[part]
        if default == value or (isinstance(default, (list, tuple)) and list(default) == value):
            repeated.append(key)
    assert not repeated, f"{path.name} repeats defaults: {repeated}"


def test_one_start_key_for_every_base():
    """``model.init_from`` names the transformer to start from for every base; SANA / Wan's old
    ``model.transformer`` maps onto it with a warning, and the two may not disagree."""
    for schema in (DiTRunConfig, SanaRunConfig, WanRunConfig):
        assert load_config(schema, None, ["model.init_from=runs/x/final"]).model.init_from == "runs/x/final"
    with pytest.warns(FutureWarning, match="model.transformer is now model.init_from"):
        cfg = load_config(SanaRunConfig, None, ["model.transformer=runs/x/final"])
    assert (cfg.model.init_from, cfg.model.transformer) == ("runs/x/final", None)
    with pytest.raises(ValueError, match="model.transformer='a'.*model.init_from='b' disagree"):
        load_config(WanRunConfig, None, ["model.transformer=a", "model.init_from=b"])
