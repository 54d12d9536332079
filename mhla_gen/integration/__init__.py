"""MHLA inside diffusers: install and uninstall (``install.py``), save and load (``serialization.py``,
``loading.py``, ``single_file.py``, ``convert_wan.py``), LoRA (``lora.py``), streaming a block-causal Wan
(``streaming.py``) and the model cards of shared folders (``cards.py``). Context parallelism is the
operator's (``mhla_gen/ops/context_parallel.py``); the transformer classes diffusers' loaders find stay in
``mhla_gen/models.py``: saved ``model_index.json`` files name that module."""
