"""Reusable Hydra config pieces (model sizes, parallel meshes), shipped as ``verl_ds4.configs_data``.

Add ``pkg://verl_ds4.configs_data`` to ``hydra.searchpath`` to use the ``ds4_model`` and
``ds4_mesh`` config groups. This file only marks the folder as a package so the YAML is
installed with ``pip install .``; there is no Python here.
"""
