"""The study harness behind ``eval/study.py``, ``eval/adaptation.py``, ``eval/scale_study.py`` and
``eval/stream_study.py``: the runner that trains and evaluates arms x seeds (:mod:`.experiments`), paired
evidence and verdicts (:mod:`.evidence`, :mod:`.evidence_stats`), the validation loss on fixed triples
(:mod:`.validation_loss`) and the choice of the layers that stay softmax (:mod:`.softmax_layers`).

It lives beside the scripts, not in the ``mhla_gen`` package: it is research code that uses the library's
public modules and is run from a checkout (``python eval/study.py`` puts ``eval/`` on ``sys.path``; the
tests add it in ``tests/conftest.py``)."""
