"""MHLA inside diffusers: install and uninstall (``install.py``), save and load (``serialization.py``,
``loading.py``, ``single_file.py``, ``convert_wan.py``), LoRA (``lora.py``), context parallelism
(``parallel.py``), streaming a block-causal Wan (``streaming.py``) and the model cards of shared folders
(``cards.py``). The transformer classes diffusers' loaders find stay in ``mhla_gen/models.py``: saved
``model_index.json`` files name that module."""
