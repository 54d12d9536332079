"""The study harness behind ``eval/study.py``, ``eval/adaptation.py``, ``eval/scale_study.py`` and
``eval/stream_study.py``: the runner that trains and evaluates arms x seeds (:mod:`.experiments`), paired
evidence and verdicts (:mod:`.evidence`, :mod:`.evidence_stats`), the validation loss on fixed triples
(:mod:`.validation_loss`), the choice of the layers that stay softmax (:mod:`.softmax_layers`), a
conversion study's teachers, one per seed, with their training FLOPs (:mod:`.teachers`), the softmax /
linear / MHLA study's runs, tables and plots (:mod:`.study_preset`, :mod:`.study_report`,
:mod:`.study_plots`), the adaptation study's arms and teachers, compute readings and report
(:mod:`.adaptation_arms`, :mod:`.adaptation_compute`, :mod:`.adaptation_report`), and the scale study's
runs and budgets, sizing and tables (:mod:`.scale_preset`, :mod:`.scale_sizing`, :mod:`.scale_report`); which
runner a study folder belongs to (:mod:`.folders`).

It lives beside the scripts, not in the ``mhla_gen`` package: it is research code that uses the library's
public modules and is run from a checkout (``python eval/study.py`` puts ``eval/`` on ``sys.path``; the
tests add it in ``tests/conftest.py``)."""

import importlib.util
import sys
from pathlib import Path


def sibling(name: str):
    """``eval/<name>.py`` as module ``eval_<name>`` (eval/ is not a package: its scripts load each other by
    path, once per process)."""
    key = f"eval_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parents[1] / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]
