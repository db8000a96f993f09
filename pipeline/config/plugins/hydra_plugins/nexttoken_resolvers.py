"""nexttoken's OmegaConf resolvers for DVC's own composition of conf/ (`dvc exp run -S ...`).

DVC composes conf/ itself, with the Hydra plugins found under `hydra.plugins_path` (.dvc/config:
pipeline/config/plugins); Hydra imports every module of the `hydra_plugins` namespace there, so importing
this one registers the resolvers. `nexttoken compose` registers the same ones directly (compose.py).
"""

from pipeline.config import ollama

ollama.register_resolver()
