"""What sampling checks from ``config.json`` files alone, before it loads a weight or writes a file.

``eval/generate.py`` and ``scripts/sample.py`` call :func:`check_sampling` before their output folder is
claimed: a transformer the pipeline's VAE cannot decode (a pixel-space DiT in a latent pipeline), and MHLA
blocks that do not fit the token grid of the requested size, are refused here with the setting named,
instead of failing after the folder (and its ``config.yaml``) was written. A hub id has no local config:
those are checked when the pipeline loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from mhla_gen.errors import ConfigError
from mhla_gen.integration.install import CONFIG_KEY
from mhla_gen.integration.lora import MANIFEST, lora_mhla_config
from mhla_gen.processors.config import MHLAConfig
from mhla_gen.processors.grid import check_grid

from . import PipelineSampler, SampleSettings


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def local_configs(model: str | None, transformer: str | None, subfolder: str = "transformer") -> dict:
    """``{"transformer": config, "vae": config, "mhla": MHLAConfig | None}`` of what would be sampled, read
    from local files: the ``transformer`` folder (a saved model, or a LoRA folder: its recorded base
    architecture and the MHLA its adapter file carries), else ``model/<subfolder>``; the VAE of the
    ``model`` pipeline. Entries that are not local are left out."""
    found = {}
    folder = Path(transformer).expanduser() if transformer else None
    if folder is not None and (folder / MANIFEST).is_file():
        found["transformer"] = json.loads((folder / MANIFEST).read_text()).get("base_config")
        found["mhla"] = lora_mhla_config(folder)
    elif folder is not None:
        found["transformer"] = _read(folder / "config.json")
    if model:
        pipeline = Path(model).expanduser()
        found.setdefault("transformer", _read(pipeline / subfolder / "config.json"))
        found["vae"] = _read(pipeline / "vae" / "config.json")
    if found.get("transformer") and "mhla" not in found:
        saved = found["transformer"].get(CONFIG_KEY)
        found["mhla"] = MHLAConfig.from_dict(saved) if saved else None
    return {k: v for k, v in found.items() if v is not None}


def check_sampling(
    sampler: type[PipelineSampler],
    model: str | None,
    transformer: str | None,
    settings: SampleSettings,
    mhla: MHLAConfig | None,
    names: dict[str, str],
) -> None:
    """Refuse (``ConfigError``) what sampling would only find out after writing: a transformer the
    pipeline's components cannot run (``sampler.check_components``), fresh ``mhla`` on a transformer saved
    with another MHLA, and MHLA blocks that do not fit the token grid of ``settings``
    (``sampler.token_grid``). ``names``: the settings as the caller spells them (keys ``model``,
    ``transformer``, ``mhla``)."""
    configs = local_configs(model, transformer)
    if "transformer" not in configs:
        return
    where = f"{names['transformer']}={transformer!r}" if transformer else f"{names['model']}={model!r}"
    sampler.check_components(configs, where, names)
    saved = configs.get("mhla")
    if mhla is not None and saved is not None and saved != mhla:
        raise ConfigError(f"{names['mhla']}: {where} was saved with MHLA {saved.to_dict()}; installing "
                          f"{mhla.to_dict()} would throw its trained MHLA away (leave {names['mhla']} unset)")
    running = mhla or saved
    grid = sampler.token_grid(configs, settings)
    if running is None or grid is None:
        return
    try:
        check_grid(grid, tuple(running.blocks))
    except ValueError as err:
        source = names["mhla"] if mhla is not None else where
        raise ConfigError(f"{source}: {err} (at the requested size)") from None


def video_token_grid(configs: dict, height: int, width: int, frames: int | None) -> tuple[int, ...] | None:
    """``(F' / pt, H / (s ph), W / (s pw))`` with ``F' = (F - 1) / t + 1`` latent frames, for the VAE's
    temporal factor t and spatial factor s (its config; None without a local VAE config or frame count)."""
    vae = configs.get("vae")
    if vae is None or frames is None:
        return None
    spatial = vae.get("scale_factor_spatial", vae.get("spatial_compression_ratio", 8))
    temporal = vae.get("scale_factor_temporal", vae.get("temporal_compression_ratio", 4))
    pt, ph, pw = configs["transformer"]["patch_size"]
    return ((frames - 1) // temporal + 1) // pt, height // (spatial * ph), width // (spatial * pw)
