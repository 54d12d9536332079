""":func:`load_transformer`: any transformer folder this project writes, back as a ready model.

Two kinds of folder, told apart by their files:

- a whole saved transformer (``transformer.save_pretrained`` after ``install_mhla``: ``config.json`` with
  the MHLA config, safetensors weights): :func:`mhla_gen.integration.serialization.load_saved_transformer`;
- a LoRA + MHLA folder (:func:`mhla_gen.integration.lora.save_lora_mhla`: adapter, MHLA parameters, a manifest
naming
  the pretrained base), e.g. the ``final/`` of a ``train.trainable=lora`` run:
  :func:`mhla_gen.integration.lora.load_lora_mhla`.

This module sits above both: ``lora`` writes and reads its MHLA parameters with ``serialization``, and only
the dispatch here needs to know about LoRA folders.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .install import is_mhla_installed
from .lora import is_lora_folder, load_lora_mhla
from .serialization import load_saved_transformer, model_weight_files, weights_mismatch

logger = logging.getLogger(__name__)


def check_weight_files(folder: str | Path, setting: str) -> None:
    """The safetensors files the loader of ``folder`` reads open: each header reads and its data covers
    what the header lists; and, for a transformer of a supported base, the weights hold every tensor its
    ``config.json`` needs, at its shape (:func:`~mhla_gen.integration.serialization.weights_mismatch`).
    Reads the headers only (no weights), so a command can refuse a truncated or corrupt download, a shard
    its index lists but the folder lacks, or a file one tensor short that diffusers would fill at random,
    in one line naming ``setting`` before it writes anything.

    The files read are those of a diffusers model folder (its one weight file or its index's shards; a
    stray file beside them, e.g. another precision's copy the loader does not read, is not looked at), or
    every ``*.safetensors`` of a folder without them (a LoRA + MHLA folder). A folder without any passes
    (whatever loads it says what is missing)."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    try:
        files = model_weight_files(folder)
    except ValueError as err:
        raise ConfigError(f"{setting}: {err}") from None
    for file in files if files is not None else sorted(folder.glob("*.safetensors")):
        if not file.is_file():
            raise ConfigError(f"{setting}: {str(file)!r} is listed in the weight index of {str(folder)!r} "
                              f"but does not exist; was the download cut short?")
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"{setting}: {str(file)!r} is not a readable safetensors file ({err}); was its "
                              f"download or copy cut short?") from None
    try:
        mismatch = weights_mismatch(folder)
    except ValueError as err:  # config.json records MHLA, the weights hold none of it
        raise ConfigError(f"{setting}: {err}") from None
    if mismatch is not None:
        raise ConfigError(f"{setting}: {mismatch}; nothing was changed")


def load_transformer(path, torch_dtype: torch.dtype | None = None, device=None, base=None) -> nn.Module:
    """Rebuild a transformer saved with ``save_pretrained``, with its MHLA installed and weights loaded.

    A LoRA + MHLA folder (:func:`mhla_gen.integration.lora.save_lora_mhla`: adapter, MHLA parameters and a
    manifest, e.g. the ``final/`` of a ``train.trainable=lora`` run) loads too: the pretrained base weights,
    then MHLA, then the adapter (:func:`mhla_gen.integration.lora.load_lora_mhla`).

    Args:
        path: the folder holding ``config.json`` and the safetensors weights (or a LoRA + MHLA folder).
        torch_dtype: cast after loading (None keeps the saved dtype).
        device: move after loading (None keeps CPU).
        base: LoRA + MHLA folders only: the pretrained checkpoint (folder or hub id) to take the base
            weights from instead of the one recorded in the folder. Ignored for full folders.
    Returns:
        the diffusers model in eval mode: with MHLA its ``mhla_gen.models`` class
        (``MHLADiTTransformer2DModel`` etc., a subclass of the stock one), else the stock class; logs (INFO)
        what it loaded.
    Raises:
        FileNotFoundError: missing folder, ``config.json`` or weights.
        ValueError: unsupported model class, or weights whose keys do not match (all listed).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"transformer folder {folder} does not exist")
    if is_lora_folder(folder):
        return load_lora_mhla(folder, base=base, torch_dtype=torch_dtype, device=device)
    model = load_saved_transformer(folder, torch_dtype=torch_dtype, device=device)
    what = f"MHLA {model.mhla_config.to_dict()}" if is_mhla_installed(model) else "stock attention (no MHLA)"
    logger.info("loaded %s from %s: %s", type(model).__name__, folder, what)
    return model
