"""Save and load MHLA transformers.

Saving a whole transformer is diffusers' own ``transformer.save_pretrained(d)``: the MHLA processors are
``nn.Module`` children of the attention layers, so their parameters are in the safetensors file, and
``install_mhla`` registered the MHLA config into ``config.json`` under the key ``"mhla"``.
:func:`load_saved_transformer` reads such a folder back (stock folders too: no ``"mhla"`` key, no install);
:func:`mhla_gen.load_transformer` (:mod:`mhla_gen.integration.loading`) reads it and LoRA + MHLA folders
alike.

The MHLA parameters alone (a few KB: mixing matrices, CPE, gates) can be exported and imported with
:func:`save_mhla_parameters` / :func:`load_mhla_parameters`; the MHLA config travels in the file metadata.

FSDP2 (``torch.distributed.fsdp.fully_shard``): the parameters of a sharded model are ``DTensor`` shards.
:func:`save_mhla_parameters` then gathers each one (``DTensor.full_tensor()``, a collective: call it on
every rank) and rank 0 writes the file; :func:`load_mhla_parameters` cuts the full tensors of the file into
each parameter's own shard (every rank reads the file; no communication). :func:`load_saved_transformer`
returns a full model: shard it after loading, or load a ``save_pretrained`` folder into an already sharded
model with ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` (README, "FSDP2").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers.utils.constants import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..bases import base_for_class_name, base_for_model
from ..processors.config import MHLAConfig
from .auto_model import without_auto_map
from .install import CONFIG_KEY, install_mhla, is_mhla_installed, mhla_parameters, stock_class_name

METADATA_CONFIG_KEY = "mhla_config"
METADATA_BASE_KEY = "mhla_base"


def _load_own(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors ``file``, each copied into memory of its own (one at a time). Left in
    the file's buffer a tensor sits at whatever offset the file gives it, and CPU kernels sum in another
    order for unaligned operands: a loaded model would compute other last bits than the saved one."""
    state = load_file(file)
    for name in list(state):
        state[name] = state[name].clone()
    return state


def model_weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files a diffusers model folder's loader reads: the one weight file, else the shards
    its index lists (present or not); None when the folder has neither (a LoRA folder, a config alone).
    A malformed index raises ``ValueError``."""
    single, index = folder / SAFETENSORS_WEIGHTS_NAME, folder / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():
        return [single]
    if not index.is_file():
        return None
    try:
        shards = json.loads(index.read_text())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{str(index)!r} is not a weight index ({type(err).__name__}: {err})") from None
    return [folder / shard for shard in sorted(set(shards))]


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers model folder: one safetensors file or an index of shards."""
    files = model_weight_files(folder)
    if files is None:
        raise FileNotFoundError(
            f"no weights in {folder}: expected {SAFETENSORS_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}"
        )
    state = {}
    for file in files:
        if not file.is_file():
            index = folder / SAFE_WEIGHTS_INDEX_NAME
            raise FileNotFoundError(f"weight shard {file} listed in {index} does not exist")
        state.update(_load_own(file))
    return state


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], source) -> None:
    """``load_state_dict(assign=True)`` that names every missing / unexpected key in a ValueError."""
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {source} do not match model: missing keys {missing}, unexpected keys {unexpected}"
        )
    module.load_state_dict(state, strict=True, assign=True)


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in a diffusers model folder's weights, from the headers only (the
    files of :func:`model_weight_files`); None when it has none or a listed shard is absent (whatever
    loads it says so)."""
    files = model_weight_files(folder)
    if files is None or not all(file.is_file() for file in files):
        return None
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def weights_mismatch(folder: str | Path) -> str | None:
    """What a transformer folder's weights lack against the model its ``config.json`` describes (with the
    MHLA it records), in one line: missing tensors and shape mismatches, and, where :func:`_load_strict`
    reads the folder (MHLA recorded), unexpected ones. None when they fit, or when the folder is not a
    saved transformer of a supported base (no ``config.json``, another class, no default weight file).

    diffusers' ``from_pretrained`` loads a stock folder one tensor short with a logged warning and that
    tensor randomly initialised; a command that checks this first refuses it before it writes anything.
    Headers only; the model is built on the meta device."""
    folder = Path(folder)
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
        mhla = config.pop(CONFIG_KEY, None)
        shapes = saved_shapes(folder)
        model = _empty_model(config, mhla)
    except (ValueError, TypeError, KeyError, AttributeError):  # a config.json that is not an object too
        return None  # a VAE, a text encoder, another family, a config the loader itself refuses
    if shapes is None:
        return None
    if mhla is not None:
        check_mhla_weights(model, set(shapes), folder)  # none at all: a stock re-save, its own explanation
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    resized = [f"{name} {shapes[name]} (the config needs {expected[name]})"
               for name in sorted(set(expected) & set(shapes)) if shapes[name] != expected[name]]
    unexpected = sorted(set(shapes) - set(expected)) if mhla is not None else []
    problems = [f"{what} {_few(names)}" for what, names in
                (("missing", missing), ("of another shape", resized), ("unexpected", unexpected)) if names]
    if not problems:
        return None
    return f"the weights in {str(folder)!r} do not fit its config.json: " + "; ".join(problems)


def _few(names: list[str], shown: int = 5) -> str:
    """``names`` for a one-line message: the first ``shown``, then how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} ({', '.join(names[:shown])}{more})"


def _empty_model(config: dict, mhla: dict | None) -> nn.Module:
    """The transformer a saved ``config.json`` describes (``config``: without its ``"mhla"`` entry), its
    parameters on the meta device (buffers real), with the MHLA of ``mhla`` installed; ``ValueError`` for
    a class MHLA does not support."""
    processor_cls = base_for_class_name(stock_class_name(config.get("_class_name")), config).processor
    with init_empty_weights(include_buffers=False):
        model = processor_cls.model_cls.from_config(without_auto_map(config))
        if mhla is not None:
            install_mhla(model, MHLAConfig.from_dict(mhla))
    return model


def saved_with_mhla(path) -> bool:
    """Whether ``path/config.json`` exists and records an MHLA config (written by ``save_pretrained``)."""
    config = Path(path) / CONFIG_NAME
    return config.is_file() and CONFIG_KEY in json.loads(config.read_text())


def check_mhla_weights(model: nn.Module, saved: set[str], source) -> list[str]:
    """The MHLA parameters of ``model`` (built with the MHLA its config records) that ``saved`` (the weight
    names found at ``source``) lacks; a ValueError, in one line, when it lacks all of them.

    None of them is what a folder re-saved by the stock class holds: the stock class's ``from_pretrained``
    builds stock attention and drops the MHLA weights, and its ``save_pretrained`` writes the config with
    its ``mhla`` entry and no MHLA weights. Loading such a folder with MHLA would leave the MHLA parameters
    uninitialised (diffusers: on the meta device, or random, with a warning).
    """
    expected = list(mhla_parameters(model))
    missing = [name for name in expected if name not in saved]
    if expected and len(missing) == len(expected):
        cfg, stock = model.mhla_config, base_for_model(model).transformer_class.__name__
        raise ValueError(
            f"{source}: config.json records MHLA (blocks {list(cfg.blocks)}, layers {cfg.layers}) but the "
            f"weights hold none of its {len(expected)} MHLA parameters (e.g. {expected[0]}): the folder "
            f"was saved by the stock {stock}, which loads stock attention and drops MHLA. Load the MHLA "
            f"folder it was made from, or load this one as the stock model it holds with diffusers' "
            f"{stock}.from_pretrained"
        )
    return missing


def load_saved_transformer(path, torch_dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """Rebuild a transformer saved with ``save_pretrained``, with its MHLA installed and weights loaded
    (use :func:`mhla_gen.load_transformer`, which also reads LoRA + MHLA folders).

    Args:
        path: the folder holding ``config.json`` and the safetensors weights.
        torch_dtype: cast after loading (None keeps the saved dtype).
        device: move after loading (None keeps CPU).
    Returns:
        the diffusers model in eval mode.
    Raises:
        FileNotFoundError: missing folder, ``config.json`` or weights.
        ValueError: unsupported model class, or weights whose keys do not match (all listed).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"transformer folder {folder} does not exist")
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder / CONFIG_NAME} does not exist (not a saved diffusers model folder)")
    config = json.loads((folder / CONFIG_NAME).read_text())
    mhla = config.pop(CONFIG_KEY, None)
    model = _empty_model(config, mhla)  # filled by assignment below: no wasted random init
    state = _read_weights(folder)
    if mhla is not None:
        check_mhla_weights(model, set(state), folder)  # none at all: a stock re-save; some: listed below
    _load_strict(model, state, folder)
    if torch_dtype is not None:
        cast_like_diffusers(model, torch_dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def cast_like_diffusers(model: nn.Module, torch_dtype: torch.dtype) -> nn.Module:
    """Cast ``model`` in place to the dtypes ``from_pretrained(..., torch_dtype=torch_dtype)`` gives it.

    diffusers casts only what its weights file holds (parameters and persistent buffers), and keeps the
    modules its class lists in ``_keep_in_fp32_modules`` in float32 (Wan: rope, time embedder, norms,
    scale-shift tables); non-persistent buffers (Wan's rotary tables, DiT's fixed positional table) keep
    the dtype they were built in. A plain ``model.to(torch_dtype)`` would cast all of them, and a model
    loaded by :func:`load_saved_transformer` would then differ from one diffusers loads in bf16.
    """
    keep = model._keep_in_fp32_modules or []
    saved = set(model.state_dict())
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for slot in (module._parameters, module._buffers):
            for name, tensor in slot.items():
                full = prefix + name
                if tensor is None or not tensor.is_floating_point() or full not in saved:
                    continue
                target = torch.float32 if any(m in full.split(".") for m in keep) else torch_dtype
                if tensor.dtype != target:
                    tensor.data = tensor.data.to(target)
    return model


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 / tensor-parallel shard); False where torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without the public DTensor API: nothing can be sharded
        return False
    return isinstance(t, DTensor)


@torch.no_grad()
def _gathered_mhla_state(transformer: nn.Module) -> tuple[dict[str, torch.Tensor], bool]:
    """``(full CPU copies of the MHLA parameters, whether any was sharded)``.

    A ``DTensor`` parameter is gathered with ``full_tensor()``: a collective, so every rank must get here
    and visit the parameters in the same order (``mhla_parameters`` is in module order on every rank).
    """
    state, sharded = {}, False
    for name, param in mhla_parameters(transformer).items():
        tensor = param.detach()
        if _is_dtensor(tensor):
            tensor, sharded = tensor.full_tensor(), True
        state[name] = tensor.cpu().contiguous()
    return state, sharded


def save_mhla_parameters(transformer: nn.Module, file) -> None:
    """Write only the MHLA parameters of ``transformer`` to a safetensors ``file`` (config in metadata).

    On an FSDP2-sharded model (``DTensor`` parameters) call it on every rank: the full parameters are
    gathered (a collective), rank 0 writes the file, and every rank returns once it is written. An
    unsharded model is written by whichever process calls it (e.g. only the main one under DDP). The file
    is written under a temporary name and renamed into place, so it is never seen half-written.
    """
    if not is_mhla_installed(transformer):
        raise ValueError(f"no MHLA installed in this {type(transformer).__name__}; nothing to save")
    metadata = {
        METADATA_CONFIG_KEY: json.dumps(transformer.mhla_config.to_dict()),
        METADATA_BASE_KEY: base_for_model(transformer).processor.base_name,
    }
    state, sharded = _gathered_mhla_state(transformer)
    writer = not sharded or torch.distributed.get_rank() == 0
    file = Path(file)
    if writer:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.tmp")
        save_file(state, tmp, metadata=metadata)
        os.replace(tmp, file)
    if sharded:
        torch.distributed.barrier()  # the other ranks return only once rank 0 has written the file


def read_mhla_config(file) -> MHLAConfig:
    """The :class:`MHLAConfig` stored in the metadata of a :func:`save_mhla_parameters` file."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"MHLA parameter file {file} does not exist")
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata() or {}
    if METADATA_CONFIG_KEY not in metadata:
        raise ValueError(f"{file} has no {METADATA_CONFIG_KEY!r} metadata (not from save_mhla_parameters)")
    return MHLAConfig.from_dict(json.loads(metadata[METADATA_CONFIG_KEY]))


@torch.no_grad()
def load_mhla_parameters(transformer: nn.Module, file) -> nn.Module:
    """Import MHLA parameters written by :func:`save_mhla_parameters` into ``transformer``, in place.

    A transformer without MHLA gets it installed from the file's config first; one with MHLA must have
    the same config. The pretrained (non-MHLA) weights are untouched. Returns ``transformer``.
    """
    cfg = read_mhla_config(file)
    base = base_for_model(transformer).processor.base_name
    with safe_open(Path(file), framework="pt") as f:
        saved_base = (f.metadata() or {}).get(METADATA_BASE_KEY, base)
    if saved_base != base:
        raise ValueError(f"{file} holds MHLA parameters for {saved_base!r}, not for this {base!r} model")
    if not is_mhla_installed(transformer):
        if any(_is_dtensor(p) for p in transformer.parameters()):
            raise ValueError(
                f"this {type(transformer).__name__} is sharded (FSDP2 / DTensor parameters) and has no MHLA: "
                "install_mhla (or load_mhla_parameters) before fully_shard, then load into the sharded model"
            )
        install_mhla(transformer, cfg)
    elif transformer.mhla_config != cfg:
        raise ValueError(
            f"installed MHLA config {transformer.mhla_config.to_dict()} differs from the one in {file}: "
            f"{cfg.to_dict()}; uninstall_mhla first or install the file's config"
        )
    state = load_file(file)
    params = mhla_parameters(transformer)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"MHLA parameters in {file} do not match: missing keys {missing}, unexpected keys {unexpected}"
        )
    wrong = [
        f"{n}: file {tuple(state[n].shape)} vs model {tuple(p.shape)}"
        for n, p in params.items()
        if state[n].shape != p.shape
    ]
    if wrong:
        raise ValueError(f"MHLA parameters in {file} have the wrong shapes: {wrong}")
    for name, param in params.items():
        source = state[name].to(param.dtype)
        if _is_dtensor(param):  # FSDP2 shard: keep this rank's part of the full tensor (no communication)
            from torch.distributed.tensor import distribute_tensor

            source = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(source)
    return transformer
