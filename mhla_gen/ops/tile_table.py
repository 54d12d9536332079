"""The per-GPU tile table of the Triton MHLA kernels: launch parameters chosen offline.

``benchmarks/tune_mhla_tiles.py`` times a few candidate ``TileConfig``s per shape class on one GPU and
writes the fastest here; ``triton_mhla.tile_config`` reads the entry for the running device and shape
class and falls back to its heuristic where there is none. Nothing is timed at run time, so CUDA-graph
capture and ``torch.compile`` see the same launches every call. This module does not import Triton.

The table is ``mhla_tiles.json`` beside this file (shipped with the package)::

    {"mhla_gen": {"kind": "mhla_tile_table"},
     "devices": {"NVIDIA H200": {"d128-e128-bf16-L256": {"config": {"block_t": 32, "num_warps": 8},
                                                         "ms": 1.9, "default_ms": 2.3, ...}}}}

A shape class (:func:`shape_class`) is the head dims and the longest block rounded up to powers of two and
the input dtype: what sets the kernels' tile shapes and register use. Only the speed fields of
``TileConfig`` (:data:`FIELDS`) can be tuned; nothing in the table changes what is computed or stored.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TABLE_KIND = "mhla_tile_table"  # the file's record (mhla_gen.outputs.folders.file_record)
TABLE_PATH = Path(__file__).with_name("mhla_tiles.json")

_POW2 = (16, 32, 64, 128, 256)
# tunable TileConfig field -> the values a table may give it
FIELDS: dict[str, tuple[int, ...]] = {
    "block_t": _POW2,
    "block_d": _POW2,
    "block_e": _POW2,
    "num_warps": (1, 2, 4, 8, 16),
    "num_stages": (1, 2, 3, 4, 5),
    "mix_block_c": (32, 64, 128, 256, 512),
    "mix_block_m": (16, 32, 64, 128, 256),
    "mix_num_warps": (1, 2, 4, 8, 16),
    "mix_num_stages": (1, 2, 3, 4, 5),
}
DTYPE_NAMES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}

_loaded: dict[Path, tuple[float, dict]] = {}  # path -> (mtime, table), read once per change


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def shape_class(d: int, e: int, dtype, max_block_len: int) -> str:
    """``"d128-e128-bf16-L256"``: head dims, input dtype and longest block, rounded up to powers of two."""
    name = DTYPE_NAMES.get(str(dtype))
    if name is None:
        raise ValueError(f"the tile table has no dtype {dtype}; choose one of {sorted(DTYPE_NAMES)}")
    return (f"d{_pow2_at_least_16(d)}-e{_pow2_at_least_16(e)}-{name}"
            f"-L{_pow2_at_least_16(max_block_len)}")


def dense_shape_class(d: int, e: int, dtype, num_tokens: int) -> str:
    """``"dense-d128-e128-bf16-N256"``: the dense path's class (``triton_dense.dense_tiles``): head dims,
    input dtype and token count, rounded up to powers of two."""
    return f"dense-{shape_class(d, e, dtype, 1).rsplit('-', 1)[0]}-N{_pow2_at_least_16(num_tokens)}"


def empty_table() -> dict:
    return {"mhla_gen": {"kind": TABLE_KIND}, "devices": {}}


def check_config(config, where: str) -> dict[str, int]:
    """``config`` (a dict of tunable fields) or a ValueError naming ``where``, the field and the value."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: a config must be a JSON object, got {config!r}")
    for name, value in config.items():
        if name not in FIELDS:
            raise ValueError(f"{where}: {name!r} is not a tunable field; choose from {sorted(FIELDS)}")
        if type(value) is not int or value not in FIELDS[name]:
            raise ValueError(f"{where}: {name}={value!r}; allowed: {FIELDS[name]}")
    return config


def check_table(table, source: str) -> dict:
    """``table`` or a ValueError naming ``source`` and what is wrong."""
    if not isinstance(table, dict) or table.get("mhla_gen", {}).get("kind") != TABLE_KIND:
        raise ValueError(f"{source} is not an MHLA tile table (no record of kind {TABLE_KIND!r})")
    devices = table.get("devices")
    if not isinstance(devices, dict):
        raise ValueError(f"{source}: 'devices' must be an object of device name -> shape classes")
    for device, classes in devices.items():
        if not isinstance(classes, dict):
            raise ValueError(f"{source}: devices[{device!r}] must be an object of shape class -> entry")
        for key, entry in classes.items():
            where = f"{source}: devices[{device!r}][{key!r}]"
            if not isinstance(entry, dict) or "config" not in entry:
                raise ValueError(f"{where} must be an object with a 'config'")
            check_config(entry["config"], where)
    return table


def read_table(path: str | Path) -> dict:
    """The checked table at ``path`` (an empty one if there is no file)."""
    path = Path(path)
    if not path.exists():
        return empty_table()
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return check_table(table, str(path))


def lookup(device: str, key: str, path: str | Path | None = None) -> dict[str, int]:
    """The tuned fields for ``device`` (``torch.cuda.get_device_name``) and shape class ``key``, or {}.
    The file is read again only when its modification time changes."""
    path = Path(path or TABLE_PATH)
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return {}
    cached = _loaded.get(path)
    if cached is None or cached[0] != mtime:
        cached = _loaded[path] = (mtime, read_table(path))
    entry = cached[1]["devices"].get(device, {}).get(key)
    return dict(entry["config"]) if entry else {}


def with_entry(table: dict, device: str, key: str, config: dict, record: dict) -> dict:
    """A copy of ``table`` with ``config`` (and ``record``: timings, versions) for ``device`` and ``key``."""
    check_config(config, f"{device} {key}")
    table = json.loads(json.dumps(table))
    table["devices"].setdefault(device, {})[key] = {"config": dict(config), **record}
    return table


def dumps(table: dict) -> str:
    return json.dumps(check_table(table, "the table"), indent=2, sort_keys=True) + "\n"


__all__ = ["FIELDS", "TABLE_KIND", "TABLE_PATH", "check_config", "dense_shape_class", "dumps", "empty_table",
           "lookup", "read_table", "shape_class", "with_entry"]
