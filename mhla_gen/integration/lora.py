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
- :func:`save_lora_mhla` writes a folder with the adapter in diffusers' pipeline LoRA format
  (``pytorch_lora_weights.safetensors``: ``transformer.``-prefixed keys, its ``LoraConfig`` in the metadata,
  what ``SanaPipeline.save_lora_weights`` writes) plus the MHLA parameters in the same file (keys
  ``transformer.mhla_with_lora.<parameter>``, the MHLA config under :data:`MHLA_MARKER` in the metadata),
  the MHLA parameters again in ``mhla.safetensors`` (:func:`mhla_gen.save_mhla_parameters`) and
  ``mhla_lora.json`` naming the pretrained checkpoint the base weights come from: its hub id, or for a
  local checkpoint its folder name and its path relative to the LoRA folder, never an absolute path (the
  folder is shared as it is). A training run also records the local base resolved, with a fingerprint,
  in ``final/``'s marker (``base_record``), which the Hub never sees (:mod:`mhla_gen.integration.cards`).
  :func:`mhla_gen.load_transformer` reads such a folder back (:func:`load_lora_mhla`): base weights, then
  MHLA, then the adapter.

diffusers' own ``pipe.load_lora_weights(folder)`` hands the file to ``pipe.transformer.load_lora_adapter``:

- an MHLA transformer (``mhla_gen.models`` class, e.g. after :func:`load_lora_weights` or ``install_mhla``
  with the folder's config) loads the adapter AND the MHLA parameters (:class:`MHLALoraMixin`);
- a stock transformer fails loudly before anything is changed: the :data:`MHLA_MARKER` metadata entry is
  no ``LoraConfig`` field, so diffusers raises ``TypeError: LoraConfig class could not be instantiated``
  caused by "unexpected keyword argument" naming the marker, which names the right call,
  :func:`load_lora_weights`.

``unload_lora_weights`` / ``fuse_lora`` / ``set_adapters`` act on the low-rank adapter only: the MHLA
parameters loaded with it are the model's attention weights from then on (``fuse_lora()`` followed by
``unload_lora_weights()`` keeps exactly the LoRA + MHLA model).

DiT: diffusers' ``DiTTransformer2DModel`` has no ``add_adapter`` and ``DiTPipeline`` no LoRA loader, so
:func:`add_lora` injects the same peft adapter layers with peft's ``inject_adapter_in_model`` (what
``add_adapter`` calls) and a DiT run saves :func:`merged_lora_copy`: the adapter merged into the weights,
a plain (MHLA) DiT folder every DiT loader reads.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import numbers
import os
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LoraBaseMixin, _fetch_state_dict
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.utils.peft_utils import recurse_remove_peft_layers
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..bases import base_for_class_name, base_for_model
from ..outputs.folders import fingerprint, read_marker
from ..processors.config import MHLAConfig
from .auto_model import AUTO_MAP_KEY
from .cards import public_ref
from .install import (
    CONFIG_KEY,
    MHLA_MODEL_CLASSES,
    install_mhla,
    is_mhla_installed,
    mhla_parameters,
    mhla_state_dict,
    stock_class_name,
    uninstall_mhla,
)
from .serialization import cast_like_diffusers, load_mhla_parameters, read_mhla_config, save_mhla_parameters

logger = logging.getLogger(__name__)

LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")  # every attention layer's q/k/v/out projections
ADAPTER_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
MHLA_WEIGHTS = "mhla.safetensors"
MANIFEST = "mhla_lora.json"
# The manifest's format tags (fixed names written into users' folders, not this module's path):
_FORMAT = "mhla_gen.lora/2"  # /2: adapter keys prefixed "transformer." and the MHLA parameters inside
_FORMATS = ("mhla_gen.lora/1", _FORMAT)  # /1: unprefixed adapter keys (save_lora_adapter), still read
ADAPTER_PREFIX = "transformer"  # diffusers' pipeline LoRA files: the component the keys belong to
MHLA_ENTRY = "mhla_with_lora"  # adapter-file keys <prefix>.mhla_with_lora.<MHLA parameter> ("lora" in
# every key is what diffusers' load_lora_weights checks)
MHLA_MARKER = "mhla (MHLA LoRA: load it with mhla_gen.integration.lora.load_lora_weights(pipe, folder))"
"""Adapter-metadata key holding the MHLA config: not a ``LoraConfig`` field, so a stock transformer's
``load_lora_adapter`` raises a TypeError that shows this text instead of loading without MHLA."""
_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY


def check_lora_settings(rank, alpha, rank_name: str = "rank", alpha_name: str = "alpha") -> None:
    """ValueError naming the setting unless ``rank`` is a positive int and ``alpha`` a positive number."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise ValueError(f"{rank_name} must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
        raise ValueError(f"{alpha_name} must be a positive (finite) number, got {alpha!r}")


def check_lora_targets(model: nn.Module, targets, setting: str = "target_modules") -> None:
    """ValueError naming ``setting`` and the first of ``targets`` that matches no module of ``model`` by
    peft's rule (a module named the target, or whose name ends with ``.<target>``); peft itself would only
    say so once the adapter is added. The message lists the model's linear layers by their short names."""
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [name for name, _ in model.named_modules() if name]
    for target in targets:
        config = LoraConfig(target_modules=[target])
        if not any(check_target_module_exists(config, name) for name in names):
            linear = sorted({_short_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"{setting}: {target!r} names no module of the {type(model).__name__}; its "
                             f"linear layers: {', '.join(linear[:24])}{' ...' if len(linear) > 24 else ''}")


def _short_name(name: str) -> str:
    """``transformer_blocks.3.attn1.to_out.0`` -> ``to_out.0``; ``...ff.net.2`` -> ``net.2``."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


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
    """Add a LoRA adapter and keep the MHLA parameters trainable; in place. The adapter comes from
    diffusers' ``add_adapter`` where the model has it (SANA, Wan), else from peft's
    ``inject_adapter_in_model``, which ``add_adapter`` calls (DiT: the same adapter layers).

    Args:
        transformer: a SANA, Wan or DiT transformer, with or without MHLA installed (installing it later
            is fine too: ``install_mhla`` creates trainable parameters).
        rank, alpha: ``LoraConfig(r=rank, lora_alpha=alpha)``; the update is scaled by ``alpha / rank``.
        target_modules: module names (suffixes) that get an adapter; default q/k/v/out of every attention
            layer (self- and cross-attention).
        adapter_name: the peft adapter name.
        **lora_kwargs: any other ``peft.LoraConfig`` field (e.g. ``init_lora_weights="gaussian"``).
    Returns:
        ``transformer``: only the adapter and MHLA parameters require grad.
    Raises:
        ValueError: a bad rank / alpha.
    """
    check_lora_settings(rank, alpha)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), **lora_kwargs)
    if isinstance(transformer, PeftAdapterMixin):
        transformer.add_adapter(config, adapter_name=adapter_name)
    else:  # freezes every other parameter, as add_adapter does
        inject_adapter_in_model(config, transformer, adapter_name=adapter_name)
    return mark_mhla_trainable(transformer)


def merged_lora_copy(transformer: nn.Module) -> nn.Module:
    """A copy of ``transformer`` with every LoRA adapter merged into its base weight (peft's ``merge``)
    and the adapter layers replaced by their base layers (diffusers' ``recurse_remove_peft_layers``, what
    ``unload_lora`` uses): the plain model, MHLA included, that ``save_pretrained`` writes and every loader
    reads. ``transformer`` itself is left as it is (a copy costs one model's memory, once per run).

    Raises:
        ValueError: the transformer has no LoRA adapter.
    """
    if not lora_parameters(transformer):
        raise ValueError(f"this {type(transformer).__name__} has no LoRA adapter to merge")
    merged = copy.deepcopy(transformer)
    for module in merged.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge(safe_merge=True)  # raises on non-finite merged weights
    recurse_remove_peft_layers(merged)
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in merged.__dict__:
            delattr(merged, attr)
    return merged


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
            f"this {type(transformer).__name__} has no LoRA adapter: add one with "
            "mhla_gen.integration.lora.add_lora (or diffusers' add_adapter) first"
        )
    keep = {id(p) for p in [*lora.values(), *mhla_parameters(transformer).values()]}
    for param in transformer.parameters():
        param.requires_grad_(id(param) in keep)
    # module order, as [p for p in model.parameters() if p.requires_grad] gives (EMA pairs them by position)
    return [p for p in transformer.parameters() if id(p) in keep]


def _base_config(transformer: nn.Module) -> dict:
    """The architecture part of the model config (no MHLA or ``auto_map`` entry, no private ``_`` keys)."""
    return {k: v for k, v in transformer.config.items()
            if not k.startswith("_") and k not in (CONFIG_KEY, AUTO_MAP_KEY)}


def is_lora_folder(path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_lora_mhla`."""
    return (Path(path) / MANIFEST).is_file()


def lora_state_dict(transformer: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights as peft's ``get_peft_model_state_dict`` gives them, plus the MHLA parameters
    (keys ``mhla_with_lora.<parameter>``) when MHLA is installed: what diffusers' pipeline LoRA writers take,
    so ``SanaPipeline.save_lora_weights(d, transformer_lora_layers=lora_state_dict(t),
    transformer_lora_adapter_metadata=lora_adapter_metadata(t))`` keeps the MHLA (peft's state dict alone,
    as in diffusers' training examples, drops it)."""
    if adapter_name not in getattr(transformer, "peft_config", {}):
        raise ValueError(f"this {type(transformer).__name__} has no LoRA adapter named {adapter_name!r}")
    state = dict(get_peft_model_state_dict(transformer, adapter_name=adapter_name))
    if is_mhla_installed(transformer):
        state.update({f"{MHLA_ENTRY}.{k}": v for k, v in mhla_state_dict(transformer).items()})
    return state


def lora_adapter_metadata(transformer: nn.Module, adapter_name: str = "default") -> dict:
    """The adapter's ``LoraConfig`` as a dict (what diffusers' examples pass as
    ``transformer_lora_adapter_metadata``), plus the MHLA config under :data:`MHLA_MARKER` when MHLA is
    installed (a stock transformer's ``load_lora_adapter`` then refuses the file, naming the right call)."""
    if adapter_name not in getattr(transformer, "peft_config", {}):
        raise ValueError(f"this {type(transformer).__name__} has no LoRA adapter named {adapter_name!r}")
    metadata = transformer.peft_config[adapter_name].to_dict()
    if is_mhla_installed(transformer):
        metadata[MHLA_MARKER] = transformer.mhla_config.to_dict()
    return metadata


def _adapter_file_state(transformer: nn.Module, adapter_name: str) -> tuple[dict, dict]:
    """``(state, metadata)`` of the adapter file, unprefixed (:func:`lora_state_dict`,
    :func:`lora_adapter_metadata`)."""
    return lora_state_dict(transformer, adapter_name), lora_adapter_metadata(transformer, adapter_name)


def save_lora_mhla(
    transformer: nn.Module,
    folder,
    base: str,
    subfolder: str | None = "transformer",
    revision: str | None = None,
    adapter_name: str = "default",
    base_id: str | None = None,
) -> Path:
    """Write the LoRA adapter, the MHLA parameters and a manifest into ``folder``; returns it.

    Args:
        transformer: a SANA or Wan model with a LoRA adapter (MHLA optional).
        folder: the output folder (created).
        base: the pretrained checkpoint (folder or hub id) whose weights the adapter applies to. A local
            folder is recorded by name (``base``) and by its path relative to ``folder`` (``base_path``),
            so the manifest names no absolute path.
        subfolder, revision: where in ``base`` the transformer is (``from_pretrained`` arguments).
        adapter_name: the peft adapter to save.
        base_id: the hub id of ``base`` when it is a local copy: recorded as ``base`` (what loads it on
            another machine).
    """
    if adapter_name not in getattr(transformer, "peft_config", {}):
        raise ValueError(f"this {type(transformer).__name__} has no LoRA adapter named {adapter_name!r}")
    if not isinstance(transformer, PeftAdapterMixin):
        raise ValueError(
            f"{type(transformer).__name__} has no diffusers LoRA loader to read the adapter back: save "
            "merged_lora_copy(transformer) with save_pretrained instead"
        )
    if not base:
        raise ValueError("base must name the pretrained checkpoint the adapter was trained on")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state, metadata = _adapter_file_state(transformer, adapter_name)
    # diffusers' own writer of pipeline LoRA files (what SanaPipeline.save_lora_weights calls)
    LoraBaseMixin.write_lora_layers(
        state_dict=LoraBaseMixin.pack_weights(state, ADAPTER_PREFIX),
        save_directory=str(folder),
        is_main_process=True,
        weight_name=ADAPTER_WEIGHTS,
        save_function=None,
        safe_serialization=True,
        lora_adapter_metadata=LoraBaseMixin.pack_weights(metadata, ADAPTER_PREFIX),
    )
    mhla_file = None
    if is_mhla_installed(transformer):
        mhla_file = MHLA_WEIGHTS
        save_mhla_parameters(transformer, folder / mhla_file)
    manifest = {
        "format": _FORMAT,
        "class_name": base_for_model(transformer).transformer_class.__name__,  # the base's (stock) class
        **base_entries(base, folder, base_id),
        "subfolder": subfolder,
        "revision": revision,
        "base_config": _base_config(transformer),
        "adapter_name": adapter_name,
        "adapter_weights": ADAPTER_WEIGHTS,
        "adapter_prefix": ADAPTER_PREFIX,
        "mhla_weights": mhla_file,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, default=list))
    return folder


def base_entries(base: str, folder: Path, base_id: str | None = None) -> dict:
    """The manifest's ``base`` (hub id, else the local folder's name:
    :func:`mhla_gen.integration.cards.public_ref`) and, for a local base, ``base_path``: its path relative to
    ``folder``."""
    entries = {"base": public_ref(base, base_id).name}
    if Path(base).expanduser().is_dir():
        entries["base_path"] = os.path.relpath(Path(base).expanduser().resolve(), Path(folder).resolve())
    return entries


def recorded_base(folder: Path, manifest: dict) -> str:
    """Where a LoRA folder's base weights are: the local base its marker records (a training run's
    ``base_record``; a warning when its weights changed since), its manifest's ``base_path`` (relative to
    the folder), else its ``base`` (a hub id; an absolute path in folders of an earlier version).

    Raises:
        FileNotFoundError: a local base that is in none of these places (it moved: pass ``base=``).
    """
    record = (read_marker(folder) or {}).get("base_record")
    if isinstance(record, dict) and "path" in record and Path(record["path"]).exists():
        if any(fingerprint(record["path"])[k] != record.get(k) for k in ("bytes", "files", "sha256")):
            logger.warning("the base %s of the LoRA in %s has changed since the LoRA was trained",
                           record["path"], folder)
        return record["path"]
    relative = manifest.get("base_path")
    if relative is None:
        return manifest["base"]
    if (folder / relative).exists():
        return str((folder / relative).resolve())
    raise FileNotFoundError(f"the base the LoRA in {folder} was trained on (the local folder "
                            f"{manifest['base']!r}, at {relative!r} from it) is gone; pass base=PATH (or "
                            f"its hub id) to load it")


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (not a folder written by save_lora_mhla)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") not in _FORMATS:
        raise ValueError(f"{path}: unknown format {manifest.get('format')!r}, expected one of {_FORMATS}")
    return manifest


def lora_mhla_config(folder) -> MHLAConfig | None:
    """The MHLA config a LoRA + MHLA folder's adapter needs (None: a LoRA without MHLA), read from the
    adapter file's metadata (or, for a format-1 folder, from ``mhla.safetensors``)."""
    folder = Path(folder)
    adapter = folder / ADAPTER_WEIGHTS
    if not adapter.is_file():
        raise FileNotFoundError(f"{adapter} does not exist (not a LoRA folder written by save_lora_mhla)")
    with safe_open(adapter, framework="pt") as f:
        metadata = json.loads((f.metadata() or {}).get(_METADATA_KEY, "{}"))
    for key in (f"{ADAPTER_PREFIX}.{MHLA_MARKER}", MHLA_MARKER):
        if key in metadata:
            return MHLAConfig.from_dict(metadata[key])
    if (folder / MHLA_WEIGHTS).is_file():
        return read_mhla_config(folder / MHLA_WEIGHTS)
    return None


def load_lora_weights(pipe, folder, adapter_name: str | None = None, **kwargs):
    """diffusers' ``pipe.load_lora_weights(folder)`` for a LoRA + MHLA folder: install the folder's MHLA
    into the pipeline's transformer first when it has none (re-registered, so a later
    ``pipe.save_pretrained`` names the MHLA class), then load adapter and MHLA parameters. Returns ``pipe``.

    ``load_into_transformer_2=True`` (Wan2.2) targets ``pipe.transformer_2``. A transformer with another
    MHLA config is refused by its ``load_lora_adapter`` (ValueError naming both configs).
    """
    name = "transformer_2" if kwargs.get("load_into_transformer_2") else "transformer"
    transformer = getattr(pipe, name)
    cfg = lora_mhla_config(folder)
    if cfg is not None and not is_mhla_installed(transformer):
        install_mhla(transformer, cfg)
        pipe.register_modules(**{name: transformer})
    pipe.load_lora_weights(str(folder), adapter_name=adapter_name, **kwargs)
    return pipe


def _base_model_class(stock_cls: type, base: str, subfolder, revision) -> type:
    """The class that loads ``base``'s transformer whole: its MHLA class when saved with MHLA."""
    config = stock_cls.load_config(base, subfolder=subfolder, revision=revision)
    return MHLA_MODEL_CLASSES.get(stock_cls, stock_cls) if CONFIG_KEY in config else stock_cls


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
    processor_cls = base_for_class_name(stock_class_name(manifest["class_name"])).processor
    if base:
        try:
            trained_on = recorded_base(folder, manifest)
        except FileNotFoundError:
            trained_on = manifest["base"]
        if trained_on not in (str(base), str(Path(base).resolve())):
            logger.warning("LoRA in %s was trained on %s; applying it to %s", folder, manifest["base"], base)
    base = base or recorded_base(folder, manifest)
    files = [manifest["adapter_weights"]] + ([manifest["mhla_weights"]] if manifest["mhla_weights"] else [])
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} (listed in {folder / MANIFEST}) does not exist")

    where = dict(subfolder=manifest["subfolder"], revision=manifest["revision"])
    model = _base_model_class(processor_cls.model_cls, base, **where).from_pretrained(base, **where)
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
        mhla_file = folder / manifest["mhla_weights"]
        if is_mhla_installed(model) and model.mhla_config != read_mhla_config(mhla_file):
            uninstall_mhla(model)  # the run replaced the base's MHLA (init_attention=fresh)
        load_mhla_parameters(model, mhla_file)
    adapter, prefix = manifest["adapter_name"], manifest.get("adapter_prefix")
    model.load_lora_adapter(
        str(folder), prefix=prefix, weight_name=manifest["adapter_weights"], adapter_name=adapter
    )
    _check_adapter_arrived(model, folder / manifest["adapter_weights"], adapter, prefix)
    if torch_dtype is not None:
        cast_like_diffusers(model, torch_dtype)
    if device is not None:
        model = model.to(device)
    logger.info("loaded %s from %s: base %s, %s, LoRA adapter %r", type(model).__name__, folder, base,
                f"MHLA {model.mhla_config.to_dict()}" if is_mhla_installed(model) else "no MHLA", adapter)
    return model.eval()


def _check_adapter_arrived(model: nn.Module, file: Path, adapter: str, prefix: str | None) -> None:
    """diffusers only warns about adapter keys it could not place: check the adapter arrived whole."""
    saved = load_file(file)
    if prefix:
        saved = {k.removeprefix(f"{prefix}."): v for k, v in saved.items() if k.startswith(f"{prefix}.")}
    saved = {k: v for k, v in saved.items() if not k.startswith(f"{MHLA_ENTRY}.")}
    loaded = get_peft_model_state_dict(model, adapter_name=adapter)
    missing, unexpected = sorted(set(loaded) - set(saved)), sorted(set(saved) - set(loaded))
    if missing or unexpected or any(not torch.equal(loaded[k], saved[k].to(loaded[k].dtype)) for k in saved):
        raise ValueError(
            f"LoRA adapter in {file.parent} does not match the model: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )


def _split_mhla_entries(state: dict, metadata: dict | None, prefix: str | None):
    """``(MHLA parameters, MHLA config or None, LoRA state, LoRA metadata)`` of an adapter file's contents
    (keys as in the file, ``prefix``-ed or not)."""
    head = f"{prefix}." if prefix else ""
    entry = f"{head}{MHLA_ENTRY}."
    mhla = {k.removeprefix(entry): v for k, v in state.items() if k.startswith(entry)}
    state = {k: v for k, v in state.items() if not k.startswith(entry)}
    cfg = None
    if metadata is not None and f"{head}{MHLA_MARKER}" in metadata:
        metadata = dict(metadata)
        cfg = MHLAConfig.from_dict(metadata.pop(f"{head}{MHLA_MARKER}"))
    return mhla, cfg, state, metadata


class MHLALoraMixin:
    """``load_lora_adapter`` of the MHLA transformer classes (:mod:`mhla_gen.models`): a LoRA + MHLA adapter
    file's MHLA parameters load with its adapter (also through ``pipe.load_lora_weights``); and
    ``save_lora_adapter``, diffusers' own, warns that it leaves the MHLA parameters behind."""

    def save_lora_adapter(self, save_directory, *args, **kwargs):
        """diffusers' ``save_lora_adapter``, unchanged (the adapter only: diffusers' own tests read every
        key of the file back as an adapter weight), with a warning that the MHLA parameters stay behind and
        how to keep them."""
        super().save_lora_adapter(save_directory, *args, **kwargs)
        if is_mhla_installed(self):
            logger.warning(
                "save_lora_adapter wrote the LoRA adapter of this %s to %s without its MHLA parameters; "
                "mhla_gen.integration.lora.save_lora_mhla(transformer, folder, base=...) writes both, as "
                "does a pipeline's save_lora_weights given "
                "transformer_lora_layers=mhla_gen.integration.lora.lora_state_dict(transformer)",
                type(self).__name__, save_directory,
            )

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap=False,
                          **kwargs):
        """diffusers' ``load_lora_adapter``; an adapter saved with MHLA must match this model's MHLA
        config, and its MHLA parameters replace this model's once the adapter has loaded.

        Raises:
            ValueError: another MHLA config, MHLA parameters that do not fit, or MHLA parameters that
                would replace those other loaded adapters run with (``unload_lora_weights`` first).
        """
        source = pretrained_model_name_or_path_or_dict
        if isinstance(source, dict):
            state, metadata = dict(source), kwargs.pop("metadata", None)
        else:  # diffusers' own reader (files, folders, hub ids), with the same hub arguments
            hub = {k: kwargs.pop(k, None) for k in ("weight_name", "use_safetensors", "local_files_only",
                                                   "cache_dir", "proxies", "token", "revision", "subfolder")}
            state, metadata = _fetch_state_dict(
                source, force_download=kwargs.pop("force_download", False), allow_pickle=False,
                user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
                metadata=kwargs.pop("metadata", None), **hub,
            )
        mhla, cfg, state, metadata = _split_mhla_entries(state, metadata, prefix)
        if cfg is not None and cfg != self.mhla_config:
            raise ValueError(
                f"this LoRA was trained with MHLA {cfg.to_dict()}, but this {type(self).__name__} runs MHLA "
                f"{self.mhla_config.to_dict()}: uninstall_mhla and install_mhla(transformer, "
                "mhla_gen.integration.lora.lora_mhla_config(folder)) first"
            )
        self._check_mhla_entries(mhla, kwargs.get("adapter_name"), hotswap)
        super().load_lora_adapter(state, prefix=prefix, hotswap=hotswap, metadata=metadata, **kwargs)
        if mhla:
            with torch.no_grad():
                for name, param in mhla_parameters(self).items():
                    param.copy_(mhla[name].to(param.dtype))

    def _check_mhla_entries(self, mhla: dict, adapter_name, hotswap: bool) -> None:
        if not mhla:
            return
        params = mhla_parameters(self)
        missing, unexpected = sorted(set(params) - set(mhla)), sorted(set(mhla) - set(params))
        wrong = [n for n, p in params.items() if n in mhla and mhla[n].shape != p.shape]
        if missing or unexpected or wrong:
            raise ValueError(
                f"the adapter's MHLA parameters do not fit this {type(self).__name__}: missing keys "
                f"{missing}, unexpected keys {unexpected}, wrong shapes {wrong}"
            )
        others = set(getattr(self, "peft_config", {})) - ({adapter_name} if hotswap else set())
        differ = any(not torch.equal(mhla[n].to(p.device, p.dtype), p) for n, p in params.items())
        if others and differ:
            raise ValueError(
                f"this adapter's MHLA parameters would replace the ones the loaded adapters {sorted(others)} "
                "run with: unload_lora_weights() (or delete_adapters) first"
            )
