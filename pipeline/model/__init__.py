"""Model: everything that runs the language model.

Preparing a snapshot from its source (`snapshot`), loading it (`loader`), tokenizing
(`tokenization`), the captured forward pass (`capture`, `forward`) and token-by-token
decoding (`decode`, `trajectories`).
"""
