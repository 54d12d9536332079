"""Adopt a folder that an mhla_gen version without folder markers (or file listings) wrote.

    mhla-gen adopt run runs/old_run
    mhla-gen adopt latent_cache /data/imagenet256_latents

Every command refuses to write into a non-empty folder that does not carry mhla_gen's marker
(``.mhla_gen.json``, see :mod:`.outputs.folders`), whatever the names of its files. This command is the
explicit way to say "this folder is mhla_gen's". Names prove nothing, so it proves the *content*: it lists
what it is about to claim, then checks every entry against what a folder of that kind holds (a sample set's
``manifest.jsonl`` records match its images; a run's ``config.yaml`` parses as a run config; a model's
``config.json`` names a supported transformer and carries mhla_gen's own record; a cache's arrays have
the cache's shapes ...) and refuses, naming the first entry that does not fit. Only then does it write the
marker and the list of the files it may later replace.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..bases import BASES, base_for_class_name
from ..errors import ConfigError
from ..integration.auto_model import AUTO_MODULE_FILE, is_auto_model_module
from ..integration.install import stock_class_name
from ..outputs.folders import (
    FILE_RECORD,
    KINDS,
    content,
    file_is_ours,
    read_marker,
    seal,
    torch_archive_cut,
    write_marker,
)
from .cli import run


def _a(noun: str) -> str:
    """``noun`` with its indefinite article (``an evaluation sample set``, ``a study``)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _supported_model(config: dict) -> bool:
    """Whether a ``config.json`` names the transformer of a base record (an ``install_mhla``-ed class, e.g.
    ``MHLADiTTransformer2DModel``, by its stock class)."""
    try:
        base_for_class_name(stock_class_name(str(config.get("_class_name"))), config)
    except ValueError:
        return False
    return True


def _sample_output_names() -> re.Pattern:
    """The files ``scripts/sample.py`` writes for any base record: ``<base>_seed<S>_<i>.mp4`` (video),
    ``<base>_seed<S>_<i>_<name>.png`` and ``<base>_seed<S>_grid.png`` (images)."""
    videos = "|".join(re.escape(base.name) for base in BASES.values() if base.video)
    images = "|".join(re.escape(base.name) for base in BASES.values() if not base.video)
    return re.compile(rf"(({images})_seed\d+_(grid|\d{{2}}_.+)\.png)|(({videos})_seed\d+_\d{{2}}\.mp4)")


LISTED_KINDS = ("model", "latent_cache", "feature_cache", "teacher_data", "checkpoint", "pipeline")  # deleted
# by listing


class Misfit(ConfigError):
    """An entry that is not what a folder of the kind holds (``present``), or one it lacks."""

    present = True


def _misfit(path: Path, why: str) -> Misfit:
    err = Misfit(f"{path.name}: {why}")
    err.present = path.exists()
    return err


# ------------------------------------------------------------------------------------- file checks
def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise _misfit(path, f"not a JSON file ({err})") from None


def _image(path: Path) -> None:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as err:  # noqa: BLE001 - any failure means "not an image"
        raise _misfit(path, f"not an image ({type(err).__name__})") from None


def _video(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(12)
    if head[4:8] != b"ftyp":
        raise _misfit(path, "not an MP4 video")


def _npy(path: Path):
    import numpy as np

    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise _misfit(path, f"not a .npy array ({err})") from None


def _safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - any failure means "not a safetensors file"
        raise _misfit(path, f"not a safetensors file ({type(err).__name__})") from None


def _dir(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        raise _misfit(path, "expected a folder")


# ------------------------------------------------------------------------------------ folder proofs
def prove_model(folder: Path, in_run: bool = False) -> None:
    """``config.json`` of a supported transformer with mhla_gen's ``mhla`` record (or a LoRA folder's
    ``mhla_lora.json``), weights that open, an index whose shards are there. ``in_run``: the ``final/`` of
    a run folder being adopted, whose ``config.yaml`` is the record (a softmax run saves no ``mhla``)."""
    lora = folder / "mhla_lora.json"
    if lora.is_file():
        if "base" not in (_json(lora) or {}):
            raise _misfit(lora, "not an mhla_gen LoRA record (no base)")
    else:
        config = folder / "config.json"
        if not config.is_file():
            raise _misfit(config, "missing: a model folder has its config.json")
        record = _json(config)
        if not isinstance(record, dict) or not _supported_model(record):
            supported = sorted({base.class_name for base in BASES.values()})
            raise _misfit(config, f"names {record.get('_class_name') if isinstance(record, dict) else None}, "
                                  f"not one of {', '.join(supported)}")
        if "mhla" not in record and not in_run:
            raise _misfit(config, "has no mhla record: a model saved by another program, not by mhla_gen")
    for path in (folder / n for n in content(folder)):
        if path.name in ("config.json", "mhla_lora.json", "README.md"):  # README.md: its model card
            continue
        if path.name.endswith(".safetensors"):
            _safetensors(path)
        elif path.name.endswith(".index.json"):
            shards = set((_json(path) or {}).get("weight_map", {}).values())
            if not shards or not all((folder / s).is_file() for s in shards):
                raise _misfit(path, "an index whose shards are not all in the folder")
        elif path.suffix == ".json" and lora.is_file():
            _json(path)
        elif path.name == AUTO_MODULE_FILE:  # AutoModel's module file: the text save_pretrained writes
            if not is_auto_model_module(path):
                raise _misfit(path, "not the module file mhla_gen's save_pretrained writes")
        else:
            raise _misfit(path, "not a file a transformer folder holds")


def prove_pipeline(folder: Path) -> None:
    """``model_index.json`` naming a pipeline class, a folder for each component it names and nothing
    else but its model card (``mhla_gen.pipelines.saving.save_pipeline``)."""
    index = _json(folder / "model_index.json") if (folder / "model_index.json").is_file() else None
    if not isinstance(index, dict) or "_class_name" not in index:
        raise _misfit(folder / "model_index.json", "missing or not a diffusers pipeline index")
    components = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0]}
    for name in sorted(components):
        _dir(folder / name)
    for path in (folder / n for n in content(folder)):
        if path.name not in {"model_index.json", "README.md", *components}:
            raise _misfit(path, "not a component the pipeline's model_index.json names")


def _prove_latents(folder: Path, needs_fingerprint: bool) -> None:
    names = {"latents.npy", "labels.npy", "meta.json"}
    for path in (folder / n for n in content(folder)):
        if path.name not in names:
            raise _misfit(path, "not a file this kind of folder holds")
    for name in sorted(names):
        if not (folder / name).is_file():
            raise _misfit(folder / name, "missing")
    meta = _json(folder / "meta.json")
    if not isinstance(meta, dict) or (needs_fingerprint and "fingerprint" not in meta):
        raise _misfit(folder / "meta.json", "not the record mhla_gen writes")
    latents, labels = _npy(folder / "latents.npy"), _npy(folder / "labels.npy")
    if latents.ndim != 5 or latents.shape[1] != 2:
        raise _misfit(folder / "latents.npy", f"shape {latents.shape}, not (N, 2, C, h, w)")
    if labels.shape != (latents.shape[0],):
        raise _misfit(folder / "labels.npy", f"shape {labels.shape}, not ({latents.shape[0]},)")


def prove_latent_cache(folder: Path) -> None:
    _prove_latents(folder, needs_fingerprint=False)


def prove_teacher_data(folder: Path) -> None:
    """The DiT layout (a latent cache with a fingerprint) or captioned samples ``<i:06d>.png|.mp4`` with
    ``<i:06d>.txt`` for every ``i`` below ``meta.json``'s count."""
    if (folder / "latents.npy").exists():
        return _prove_latents(folder, needs_fingerprint=True)
    meta = _json(folder / "meta.json") if (folder / "meta.json").is_file() else None
    if not isinstance(meta, dict) or not isinstance(meta.get("count"), int) or "fingerprint" not in meta:
        raise _misfit(folder / "meta.json", "missing or not the record mhla_gen writes")
    for path in (folder / n for n in content(folder)):
        match = re.fullmatch(r"(\d{6})\.(png|mp4|txt)", path.name)
        if path.name == "meta.json":
            continue
        if match is None or int(match.group(1)) >= meta["count"]:
            raise _misfit(path, "not a sample of this teacher-data folder")
        {"png": _image, "mp4": _video, "txt": lambda p: p.read_text()}[match.group(2)](path)


def prove_feature_cache(folder: Path) -> None:
    meta = _json(folder / "meta.json") if (folder / "meta.json").is_file() else None
    if not isinstance(meta, dict) or not isinstance(meta.get("count"), int) or "fingerprint" not in meta:
        raise _misfit(folder / "meta.json", "missing or not the record mhla_gen writes")
    for path in (folder / n for n in content(folder)):
        if path.name not in ("meta.json", "items"):
            raise _misfit(path, "not an entry of a feature cache")
    _dir(folder / "items")
    want = {f"{i:08d}.safetensors" for i in range(meta["count"])}
    for path in sorted((folder / "items").iterdir()):
        if path.name not in want:
            raise _misfit(path, "not an item of this cache")
        _safetensors(path)


def prove_samples(folder: Path) -> None:
    """``manifest.jsonl`` whose records name every sample file (and only those), a generate config."""
    records = []
    for shard in sorted(folder.glob("manifest*.jsonl")):
        for line in shard.read_text().splitlines():
            try:
                record = json.loads(line)
                records.append((int(record["index"]), str(record["file"])))
            except (ValueError, KeyError, TypeError):
                raise _misfit(shard, "a line that is not a sample record of eval/generate.py") from None
    if not records:
        raise _misfit(folder / "manifest.jsonl", "missing or empty (a sample set lists its samples)")
    files = {name for _, name in records}
    for path in (folder / n for n in content(folder)):
        if path.name in files:
            (_video if path.suffix == ".mp4" else _image)(path)
        elif path.name == "config.yaml":
            from omegaconf import OmegaConf

            try:
                base = OmegaConf.to_container(OmegaConf.load(path)).get("base")
            except Exception:  # noqa: BLE001
                base = None
            if not isinstance(base, str) or base not in BASES:
                raise _misfit(path, "not an eval/generate.py config")
        elif path.name == "samples.npz":
            import numpy as np

            with np.load(path) as data:
                if "arr_0" not in data.files or len(data["arr_0"]) != len(files):
                    raise _misfit(path, "not the samples of this manifest")
        elif path.suffix == ".json":
            record = _json(path)
            if not (isinstance(record, dict) and isinstance(record.get(FILE_RECORD), dict)):
                raise _misfit(path, "has no mhla_gen record")
        elif not re.fullmatch(r"manifest(\.\d+)?\.jsonl", path.name):
            raise _misfit(path, "not listed in manifest.jsonl")
    missing = sorted(files - set(content(folder)))
    if missing:
        raise _misfit(folder / missing[0], "named in manifest.jsonl but not in the folder")


def prove_sample_outputs(folder: Path) -> None:
    names = _sample_output_names()
    for path in (folder / n for n in content(folder)):
        if names.fullmatch(path.name):
            (_video if path.suffix == ".mp4" else _image)(path)
        else:
            raise _misfit(path, "not a file scripts/sample.py writes")


def prove_attention_stats(folder: Path) -> None:
    for path in (folder / n for n in content(folder)):
        if path.name == "attention_stats.json":
            stats = _json(path)
            if not isinstance(stats, list) or not all(isinstance(s, dict) and "rank" in s for s in stats):
                raise _misfit(path, "not per-layer attention statistics")
        elif path.name == "attention_stats.png":
            _image(path)
        else:
            raise _misfit(path, "not a file eval/attention_stats.py writes")


def _run_config(path: Path) -> None:
    # here, not at the top: adopting any other kind of folder loads no training stack
    from ..train.config import load_config
    from ..train.linearize import stage1_schema

    trained = [base for base in BASES.values() if base.trains]
    schemas = [base.run_config.load() for base in trained] + [stage1_schema(base) for base in trained]
    for schema in schemas:
        try:
            load_config(schema, str(path))
            return
        except (ValueError, OSError, TypeError):
            continue
    raise _misfit(path, "does not parse as a run config of mhla_gen")


def prove_run(folder: Path) -> list[tuple[Path, str]]:
    """``config.yaml`` of a run; metrics, checkpoints, logs, sample grids, ``final/`` (a model: marked
    too), a cache, attention statistics, a stage-1 report. Returns the sub-folders to mark."""
    if not (folder / "config.yaml").is_file():
        raise _misfit(folder / "config.yaml", "missing (a run folder has its resolved config)")
    marks = []
    for path in (folder / n for n in content(folder)):
        name = path.name
        if name == "config.yaml":
            _run_config(path)
        elif name == "metrics.jsonl":
            for line in path.read_text().splitlines():
                try:
                    json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    raise _misfit(path, "a line that is not a metrics record with a step") from None
        elif name == "checkpoints":
            _dir(path)
            for sub in path.iterdir():
                if (read_marker(sub) or {}).get("kind") == "checkpoint":
                    continue  # marked (and listed) when it was written
                if not re.fullmatch(r"checkpoint_\d+", sub.name) or not sub.is_dir() or sub.is_symlink():
                    raise _misfit(sub, "not a checkpoint of this run")
                prove_checkpoint(sub)
                marks.append((sub, "checkpoint"))
        elif name in ("logs", "samples"):
            _dir(path)
            for sub in path.iterdir() if name == "samples" else ():
                _image(sub)
        elif name in ("final", "cache", "attention_stats"):
            _dir(path)
            kind = {"final": "model", "cache": "feature_cache", "attention_stats": "attention_stats"}[name]
            if read_marker(path) is None:
                prove_model(path, in_run=True) if kind == "model" else PROOFS[kind](path)
                marks.append((path, kind))
        elif name == "transfer.json":
            if not file_is_ours(path, "transfer_report"):
                raise _misfit(path, "has no mhla_gen record")
        elif name == "transfer_errors.png":
            _image(path)
        else:
            raise _misfit(path, "not an entry of a training run")
    return marks


_ACCELERATE_STATE = re.compile(  # what accelerator.save_state writes (files, FSDP shard folders)
    r"(model|pytorch_model|optimizer|scheduler|sampler|random_states|custom_checkpoint|dl_state_dict)[\w.-]*"
)


def prove_checkpoint(folder: Path) -> None:
    """``trainer_state.json`` with the step its ``checkpoint_<step>`` name says and the run's model
    signature; the rest is what ``accelerator.save_state`` writes (safetensors files must open)."""
    state = folder / "trainer_state.json"
    record = _json(state) if state.is_file() else None
    if not isinstance(record, dict) or "signature" not in record or not isinstance(record.get("step"), int):
        raise _misfit(state, "not a trainer state of mhla_gen (step and signature)")
    named = re.fullmatch(r"checkpoint_(\d+)", folder.name)
    if named and int(named.group(1)) != record["step"]:
        raise _misfit(state, f"says step {record['step']}, the folder's name {folder.name}")
    for path in (folder / n for n in content(folder)):
        if path.name == state.name:
            continue
        if path.is_symlink() or not _ACCELERATE_STATE.fullmatch(path.name):
            raise _misfit(path, "not an entry of an Accelerate checkpoint")
        if path.suffix == ".safetensors":
            _safetensors(path)
        elif path.suffix in (".bin", ".pkl") and path.is_file() and torch_archive_cut(path):
            raise _misfit(path, "a torch.save archive cut short (its zip directory is missing)")


def prove_study(folder: Path) -> list[tuple[Path, str]]:
    """Reports carrying mhla_gen's record, plots, and runs / results / stage-1 / teacher folders whose
    result files carry the record and whose runs prove as runs (marked too)."""
    marks = []
    for path in (folder / n for n in content(folder)):
        name = path.name
        if name in ("study.json", "adaptation.json"):
            if not file_is_ours(path, "study"):
                raise _misfit(path, "has no mhla_gen record")
        elif name in ("study.md", "adaptation.md", "scale_study.md"):
            path.read_text()
        elif name == "record.npz":  # eval/results.py's record: a numpy archive of arrays, no pickles
            _record(path)
        elif re.fullmatch(r"(curves|samples|compute)_[\w.-]+\.png", name):
            _image(path)
        elif path.is_dir() and not path.is_symlink():
            marks += _prove_study_tree(path)
        else:
            raise _misfit(path, "not an entry of a study")
    return marks


def _record(path: Path) -> None:
    try:
        with np.load(path, allow_pickle=False) as archive:
            archive.files  # noqa: B018 - reads the archive's index
    except (OSError, ValueError) as err:
        raise _misfit(path, f"not a study record ({err})") from None


def _prove_study_tree(folder: Path) -> list[tuple[Path, str]]:
    marks = []
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.parent.name.startswith("seed") and path.suffix == ".json" and \
                re.fullmatch(r"step\d+", path.stem):
            if not file_is_ours(path, "experiment_point"):
                raise _misfit(path, "a result without mhla_gen's record")
        if path.is_dir() and (path / "config.yaml").is_file() and read_marker(path) is None:
            marks += [(path, "run"), *prove_run(path)]
    return marks


def prove_diffusers_tests(folder: Path) -> None:
    for path in (folder / n for n in content(folder)):
        if path.name == "mhla_plugin.py":
            if "mhla_plugin" not in path.read_text() and "install_mhla" not in path.read_text():
                raise _misfit(path, "not the plugin scripts/diffusers_model_tests.py writes")
        elif path.name == "hub_standins.py":
            if "STANDINS" not in path.read_text():
                raise _misfit(path, "not the Hub stand-ins scripts/diffusers_model_tests.py writes")
        elif path.name == "tests":
            _dir(path)
        elif not re.fullmatch(r"\w+_\w+\.xml", path.name):
            raise _misfit(path, "not a file scripts/diffusers_model_tests.py writes")


PROOFS: dict[str, Callable[[Path], object]] = {
    "run": prove_run, "latent_cache": prove_latent_cache, "feature_cache": prove_feature_cache,
    "teacher_data": prove_teacher_data, "samples": prove_samples, "sample_outputs": prove_sample_outputs,
    "model": prove_model, "attention_stats": prove_attention_stats, "study": prove_study,
    "diffusers_tests": prove_diffusers_tests, "checkpoint": prove_checkpoint, "pipeline": prove_pipeline,
}


def adopt(folder: str | Path, kind: str, show: Callable[[str], None] = print) -> Path:
    """Prove that ``folder`` holds what a ``kind`` folder holds, then mark it (and the sub-folders the
    proof found, e.g. a run's ``final/``) and list the files later commands may replace. ``show`` gets
    the list of what is claimed before anything is written."""
    folder = Path(folder).expanduser()
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is not a folder kind of mhla_gen; choose one of {sorted(KINDS)}")
    if folder.is_symlink() or not folder.is_dir():
        raise FileNotFoundError(f"folder {str(folder)!r} does not exist (or is a symbolic link)")
    marker = read_marker(folder)
    if marker is not None and marker.get("kind") != kind:
        raise ConfigError(f"{str(folder)!r} is already a {marker.get('kind')} folder of mhla_gen")
    entries = content(folder)
    if not entries:
        raise ConfigError(f"{str(folder)!r} is empty: nothing to adopt (commands use empty folders)")
    show(f"{folder}: claiming as {_a(KINDS[kind])} folder: {', '.join(entries)}")
    try:
        marks = PROOFS[kind](folder) or []
    except Misfit as err:
        what = f"holds entries {_a(KINDS[kind])} folder does not" if err.present else \
            f"is not {_a(KINDS[kind])} folder of mhla_gen"
        raise ConfigError(f"{str(folder)!r} {what} (first: {err}); not adopted, nothing changed") from None
    for sub, sub_kind in [*marks, (folder, kind)]:
        if read_marker(sub) is None:
            write_marker(sub, sub_kind, adopted=True)
        if sub_kind in LISTED_KINDS:
            seal(sub)
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="mhla-gen adopt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="what the folder is")
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    folder = adopt(args.folder, args.kind)
    print(f"{folder} is now marked as a {KINDS[args.kind]} folder of mhla_gen")


if __name__ == "__main__":
    run(main)
