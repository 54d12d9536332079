"""Evaluation metrics: the FID family and its feature extractors (``fid.py``, ``extractors.py``), VBench-style
video dimensions (``video.py``), the shapes' and moving shapes' exact scorers (``shapes.py``,
``moving_shapes.py``), attention statistics of a model (``attention.py``) and of one attention map
(``attention_maps.py``), and FLOP counts (``flops.py``). Nothing is imported here: ``import mhla_gen`` loads
no feature extractor."""
