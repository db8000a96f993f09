"""nexttoken: a reproducible record of how a causal LM picks its next token.

The library holds all logic; nothing here does I/O at import time.
"""

__version__ = "0.1.0"
