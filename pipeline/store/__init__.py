"""Store: where artifacts live and how they are written, hashed and read back.

Paths stated once (`paths`), atomic stage folders with their manifest (`artifacts`),
provenance and content hashes (`provenance`), logits in long-format Parquet (`logits_io`).
No model code and no numerics here.
"""
