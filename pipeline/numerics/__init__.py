"""Numerics: logits -> probabilities, filters and draws, on hand-held tensors and arrays.

`sampling` (temperature / top-k / top-p through transformers' warpers, the draw) and `probs`
(the FP64 tables, filtered sets and summaries of the probs stage), `divergence` (where two runs' numbers part:
kernel path, first diverging tensor, top-1 ids). No model is run here.
"""
