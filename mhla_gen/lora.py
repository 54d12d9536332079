"""LoRA + MHLA: a peft LoRA adapter on the attention projections, with the MHLA parameters trained too.

diffusers' ``transformer.add_adapter(LoraConfig(...))`` (``PeftAdapterMixin``) freezes every parameter that
is not an adapter weight, so it freezes the MHLA parameters of an ``install_mhla``-ed model, and
``transformer.save_lora_adapter`` writes the adapter only. Here:

- :func:`add_lora` adds the adapter through diffusers' ``add_adapter`` and then marks the MHLA parameters
  trainable again, so the order does not matter: MHLA installed before :func:`add_lora` stays trainable,
  and MHLA installed after any ``add_adapter`` gets fresh, trainable parameters (``install_mhla`` builds
  them after peft's freeze has run).
- :func:`lora_training_parameters` is the parameter selection of a LoRA + MHLA run: it sets
  ``requires_grad`` on the adapter and the MHLA parameters and off everywhere else, whatever happened
  before (e.g. a plain ``add_adapter`` after ``install_mhla``).
- :func:`save_lora_mhla` writes a folder with the adapter in diffusers' ``save_lora_adapter`` format
  (``pytorch_lora_weights.safetensors``, its ``LoraConfig`` in the metadata), the MHLA parameters
  (``mhla.safetensors``, :func:`mhla_gen.save_mhla_parameters`) and ``mhla_lora.json`` naming the pretrained
  checkpoint the base weights come from. :func:`mhla_gen.load_transformer` reads such a folder back
  (:func:`load_lora_mhla`): base weights, then MHLA, then the adapter.

With stock diffusers only, the same folder loads as ``transformer = <Model>.from_pretrained(base,
subfolder="transformer")``, ``load_mhla_parameters(transformer, "final/mhla.safetensors")``,
``transformer.load_lora_adapter("final", prefix=None, weight_name="pytorch_lora_weights.safetensors")``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from pathlib import Path

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from .bases import base_for_class_name
from .install import CONFIG_KEY, is_mhla_installed, mhla_parameters
from .serialization import load_mhla_parameters, save_mhla_parameters

logger = logging.getLogger(__name__)

LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")  # every attention layer's q/k/v/out projections
ADAPTER_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
MHLA_WEIGHTS = "mhla.safetensors"
MANIFEST = "mhla_lora.json"
_FORMAT = "mhla_gen.lora/1"


def check_lora_settings(rank, alpha, rank_name: str = "rank", alpha_name: str = "alpha") -> None:
    """ValueError naming the setting unless ``rank`` is a positive int and ``alpha`` a positive number."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise ValueError(f"{rank_name} must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
        raise ValueError(f"{alpha_name} must be a positive (finite) number, got {alpha!r}")


def _check_peft_support(transformer: nn.Module) -> None:
    if not isinstance(transformer, PeftAdapterMixin):
        raise ValueError(
            f"{type(transformer).__name__} has no diffusers LoRA support (PeftAdapterMixin); "
            "LoRA works for SanaTransformer2DModel and WanTransformer3DModel"
        )


def mark_mhla_trainable(transformer: nn.Module) -> nn.Module:
    """``requires_grad=True`` on every MHLA parameter (undoes peft's freeze); returns ``transformer``."""
    for param in mhla_parameters(transformer).values():
        param.requires_grad_(True)
    return transformer


def add_lora(
    transformer: nn.Module,
    rank: int,
    alpha: float,
    target_modules=LORA_TARGET_MODULES,
    adapter_name: str = "default",
    **lora_kwargs,
) -> nn.Module:
    """Add a LoRA adapter (diffusers ``add_adapter``) and keep the MHLA parameters trainable; in place.

    Args:
        transformer: a SANA or Wan transformer, with or without MHLA installed (installing it later is
            fine too: ``install_mhla`` creates trainable parameters).
        rank, alpha: ``LoraConfig(r=rank, lora_alpha=alpha)``; the update is scaled by ``alpha / rank``.
        target_modules: module names (suffixes) that get an adapter; default q/k/v/out of every attention
            layer (self- and cross-attention).
        adapter_name: the peft adapter name.
        **lora_kwargs: any other ``peft.LoraConfig`` field (e.g. ``init_lora_weights="gaussian"``).
    Returns:
        ``transformer``: only the adapter and MHLA parameters require grad.
    Raises:
        ValueError: a model without diffusers' PEFT support (DiT), or a bad rank / alpha.
    """
    _check_peft_support(transformer)
    check_lora_settings(rank, alpha)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), **lora_kwargs)
    transformer.add_adapter(config, adapter_name=adapter_name)
    return mark_mhla_trainable(transformer)


def lora_parameters(transformer: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of the LoRA adapter weights: every parameter of a peft tuner layer (the
    wrapped ``to_q`` etc.) except its ``base_layer`` (the pretrained weight). Empty without an adapter."""
    found = {}
    for module_name, module in transformer.named_modules():
        if isinstance(module, BaseTunerLayer):
            for name, param in module.named_parameters():
                if not name.startswith("base_layer."):
                    found[f"{module_name}.{name}"] = param
    return found


def lora_training_parameters(transformer: nn.Module) -> list[nn.Parameter]:
    """LoRA adapter + MHLA parameters (in module order), set trainable; every other parameter is frozen.

    Raises:
        ValueError: the transformer has no LoRA adapter.
    """
    lora = lora_parameters(transformer)
    if not lora:
        raise ValueError(
            f"this {type(transformer).__name__} has no LoRA adapter: add one with mhla_gen.lora.add_lora "
            "(or diffusers' add_adapter) first"
        )
    keep = {id(p) for p in [*lora.values(), *mhla_parameters(transformer).values()]}
    for param in transformer.parameters():
        param.requires_grad_(id(param) in keep)
    # module order, as [p for p in model.parameters() if p.requires_grad] gives (EMA pairs them by position)
    return [p for p in transformer.parameters() if id(p) in keep]


def _base_config(transformer: nn.Module) -> dict:
    """The architecture part of the model config (no MHLA entry, no private ``_`` keys)."""
    return {k: v for k, v in transformer.config.items() if not k.startswith("_") and k != CONFIG_KEY}


def is_lora_folder(path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_lora_mhla`."""
    return (Path(path) / MANIFEST).is_file()


def save_lora_mhla(
    transformer: nn.Module,
    folder,
    base: str,
    subfolder: str | None = "transformer",
    revision: str | None = None,
    adapter_name: str = "default",
) -> Path:
    """Write the LoRA adapter, the MHLA parameters and a manifest into ``folder``; returns it.

    Args:
        transformer: a model with a LoRA adapter (MHLA optional).
        folder: the output folder (created).
        base: the pretrained checkpoint (folder or hub id) whose weights the adapter applies to; an
            existing local folder is recorded as an absolute path.
        subfolder, revision: where in ``base`` the transformer is (``from_pretrained`` arguments).
        adapter_name: the peft adapter to save.
    """
    if adapter_name not in getattr(transformer, "peft_config", {}):
        raise ValueError(f"this {type(transformer).__name__} has no LoRA adapter named {adapter_name!r}")
    if not base:
        raise ValueError("base must name the pretrained checkpoint the adapter was trained on")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    transformer.save_lora_adapter(str(folder), adapter_name=adapter_name, weight_name=ADAPTER_WEIGHTS)
    mhla_file = None
    if is_mhla_installed(transformer):
        mhla_file = MHLA_WEIGHTS
        save_mhla_parameters(transformer, folder / mhla_file)
    manifest = {
        "format": _FORMAT,
        "class_name": type(transformer).__name__,
        "base": str(Path(base).resolve()) if Path(base).is_dir() else base,
        "subfolder": subfolder,
        "revision": revision,
        "base_config": _base_config(transformer),
        "adapter_name": adapter_name,
        "adapter_weights": ADAPTER_WEIGHTS,
        "mhla_weights": mhla_file,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, default=list))
    return folder


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (not a folder written by save_lora_mhla)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != _FORMAT:
        raise ValueError(f"{path}: unknown format {manifest.get('format')!r}, expected {_FORMAT!r}")
    return manifest


def load_lora_mhla(folder, base: str | None = None, torch_dtype: torch.dtype | None = None, device=None):
    """Rebuild the model of a :func:`save_lora_mhla` folder: pretrained base, MHLA, adapter; eval mode.

    Args:
        folder: the folder (e.g. a LoRA fine-tuning run's ``final/``).
        base: the pretrained checkpoint to take the base weights from; default the one recorded at save
            time (pass it when the checkpoint moved, or is the same model under another path or hub id).
        torch_dtype, device: cast / move after loading.
    Raises:
        FileNotFoundError: no manifest, adapter or MHLA file.
        ValueError: the base has another class or architecture than the one the adapter was trained on,
            or the adapter file does not match the model (keys listed).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    processor_cls = base_for_class_name(manifest["class_name"]).processor
    if base and base != manifest["base"] and str(Path(base).resolve()) != manifest["base"]:
        logger.warning("LoRA in %s was trained on %s; applying it to %s", folder, manifest["base"], base)
    base = base or manifest["base"]
    files = [manifest["adapter_weights"]] + ([manifest["mhla_weights"]] if manifest["mhla_weights"] else [])
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} (listed in {folder / MANIFEST}) does not exist")

    model = processor_cls.model_cls.from_pretrained(
        base, subfolder=manifest["subfolder"], revision=manifest["revision"]
    )
    recorded, found = (
        json.loads(json.dumps(manifest["base_config"])),
        json.loads(json.dumps(_base_config(model))),
    )
    diffs = sorted(k for k in set(recorded) | set(found) if recorded.get(k) != found.get(k))
    if diffs:
        raise ValueError(
            f"base {base!r} is not the model the adapter in {folder} was trained on: config differs in "
            + ", ".join(f"{k} ({found.get(k)!r} vs trained on {recorded.get(k)!r})" for k in diffs)
        )
    if manifest["mhla_weights"]:
        load_mhla_parameters(model, folder / manifest["mhla_weights"])
    adapter = manifest["adapter_name"]
    model.load_lora_adapter(
        str(folder), prefix=None, weight_name=manifest["adapter_weights"], adapter_name=adapter
    )

    # diffusers only warns about adapter keys it could not place: check the adapter arrived whole
    saved = load_file(folder / manifest["adapter_weights"])
    loaded = get_peft_model_state_dict(model, adapter_name=adapter)
    missing, unexpected = sorted(set(loaded) - set(saved)), sorted(set(saved) - set(loaded))
    if missing or unexpected or any(not torch.equal(loaded[k], saved[k].to(loaded[k].dtype)) for k in saved):
        raise ValueError(
            f"LoRA adapter in {folder} does not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()
