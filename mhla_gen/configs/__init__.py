"""The YAML configs that ship inside the package (deviations from the dataclass defaults), found by name.

A ``--config`` value is a file or the name of a shipped config: ``dit_digits``, ``tiny/dit``,
``linearize/wan_1_3b_480p``, ``accelerate/fsdp`` (``.yaml`` may be added). ``configs/<name>.yaml``, the
spelling of the commands written for a checkout, names the same shipped config, so those command lines
work from any folder and from an installed wheel. An existing file at the given path always wins.

The files live here, in ``mhla_gen/configs/``, so that a wheel carries them as package data and a
checkout, an editable install and a wheel all read the same files the same way (no second copy, no
symlink, no build step).
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
CHECKOUT_PREFIX = "configs/"  # `--config configs/tiny/dit.yaml`: the name tiny/dit


def shipped_configs() -> list[str]:
    """The names of the shipped configs (``tiny/dit``, ...), sorted."""
    return sorted(p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in CONFIG_DIR.rglob("*.yaml"))


def config_name(value: str | Path) -> str:
    """``value`` as a shipped config's name: ``./``, ``configs/`` and ``.yaml`` / ``.yml`` taken off."""
    name = str(value).replace("\\", "/").removeprefix("./").removeprefix(CHECKOUT_PREFIX)
    for suffix in (".yaml", ".yml"):
        name = name.removesuffix(suffix)
    return name


def shipped_config(value: str | Path) -> Path | None:
    """The file of the shipped config ``value`` names, or None."""
    name = config_name(value)
    if not name or name.startswith("/") or ".." in name.split("/"):
        return None
    path = CONFIG_DIR / f"{name}.yaml"
    return path if path.is_file() else None


def resolve_config(value: str | Path, setting: str = "--config") -> Path:
    """The config file ``value`` means: an existing file at that path (``~`` expanded), else the shipped
    config of that name. ``FileNotFoundError`` naming ``setting`` and listing the shipped names otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    found = shipped_config(value)
    if found is not None:
        return found
    what = "is a folder" if path.is_dir() else "is no file"
    raise FileNotFoundError(f"{setting} {str(value)!r} {what} and names no shipped config; shipped configs: "
                            f"{', '.join(shipped_configs())}")
