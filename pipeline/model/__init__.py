"""Model: everything that runs the language model.

Preparing a snapshot from its source (`snapshot`; `tiny` builds the seeded toy Qwen2), loading
it (`loader`: device, dtype, one GPU or spread over several), tokenizing (`tokenization`), the
captured forward pass (`capture`, `forward`; `memory` refuses one that cannot fit) and
token-by-token decoding (`decode`, `trajectories`).
"""
