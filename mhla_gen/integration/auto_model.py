"""diffusers' ``AutoModel`` on a lone saved MHLA model folder.

``AutoModel.from_pretrained(folder)`` finds a class in two ways. A pipeline folder's ``model_index.json``
names the library (``["mhla_gen.models", "MHLADiTTransformer2DModel"]``), which diffusers imports. A lone
model folder has only ``config.json["_class_name"]``, which diffusers looks up in ``diffusers`` itself, so
an MHLA class is not found there ("`diffusers` has no class ..."). diffusers' way for a class of another
package is custom code: ``config.json["auto_map"]`` maps ``"AutoModel"`` to ``"<module file>.<class>"``,
and ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` imports that file from the folder
(diffusers' ``ConfigMixin.register_for_auto_class`` writes the entry, but neither the file nor a module
name of our choosing, hence this module).

An MHLA class's ``save_pretrained`` writes both: the entry (``MHLAModelMixin.to_json_string``) and
:data:`AUTO_MODULE_FILE`, which only imports the class from the installed ``mhla_gen`` (where it is not
installed, diffusers warns that the file needs it and the import fails). The MHLA classes drop the
entry when they read a config (it is no init argument), as do the loaders that build the stock class from
a ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

AUTO_MAP_KEY = "auto_map"  # diffusers' config.json key for AutoModel's custom code
AUTO_MODULE = "mhla_gen_auto_model"  # the module file save_pretrained writes beside config.json
AUTO_MODULE_FILE = f"{AUTO_MODULE}.py"
AUTO_MODULE_SOURCE = '''"""The model class of this folder for diffusers'
AutoModel.from_pretrained(folder, trust_remote_code=True): the one config.json's "auto_map" names,
from the installed mhla_gen package (pip install mhla_gen). Written by mhla_gen's save_pretrained;
it defines nothing of its own."""

from mhla_gen.models import *  # noqa: F401,F403
'''


def auto_map(class_name: str) -> dict[str, str]:
    """The ``config.json["auto_map"]`` of a saved model of the MHLA class ``class_name``."""
    return {"AutoModel": f"{AUTO_MODULE}.{class_name}"}


def without_auto_map(config: dict) -> dict:
    """``config`` (a ``config.json`` as a dict) without the ``auto_map`` entry, which no model class takes
    as an init argument (diffusers would warn that it "will be ignored")."""
    return {key: value for key, value in config.items() if key != AUTO_MAP_KEY}


def is_auto_model_module(path: Path) -> bool:
    """Whether ``path`` is a file holding exactly :data:`AUTO_MODULE_SOURCE` (ours to replace)."""
    ours = AUTO_MODULE_SOURCE.encode()
    return path.is_file() and path.stat().st_size == len(ours) and path.read_bytes() == ours


def write_auto_model_module(folder) -> None:
    """:data:`AUTO_MODULE_FILE` in ``folder`` (made if missing): the same text for every MHLA class. A file
    of that name with other contents is not ours: ``FileExistsError`` before anything is written."""
    path = Path(folder) / AUTO_MODULE_FILE
    if path.exists() and not is_auto_model_module(path):
        raise FileExistsError(f"{str(path)!r} exists and is not the module file mhla_gen's save_pretrained "
                              "writes; nothing was saved: move it or save elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(AUTO_MODULE_SOURCE)
