"""Load a prepared model snapshot (weights, tokenizer, config facts) and resolve device and dtype.

Everything a stage needs to run a model that `pipeline.model.snapshot` prepared: the model in
eval mode from safetensors only, its tokenizer, facts read from its config alone (no
weights), and the device / dtype names of `capture` turned into torch objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.errors import UserError, bad_value

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def snapshot_dir(prepared_dir: Path, source_record: dict) -> Path:
    """Where the model loads from: the hub snapshot for kind=hub, else the prepared folder."""
    where = source_record.get("snapshot_dir")
    return Path(where) if where else Path(prepared_dir)


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device, attn_implementation: str,
               trust_remote_code: bool):
    """The snapshot's model in eval mode, weights in `dtype` on `device` (safetensors only)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    with _unreadable(path, "model"):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation,
            device_map=None if device.type == "cpu" else str(device),
            trust_remote_code=trust_remote_code, use_safetensors=True, local_files_only=True)
    return model.eval()


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    with _unreadable(path, "tokenizer"):
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def tokenizer_files(prepared_dir: Path, source_record: dict) -> list[Path]:
    """The prepared snapshot's files a tokenizer reads (all but the weights); none for a hub cache snapshot."""
    if source_record.get("snapshot_dir"):
        return []
    return sorted(p for p in Path(prepared_dir).iterdir() if p.is_file() and p.suffix != ".safetensors"
                  and p.name not in ("manifest.json", "source.json"))


@contextmanager
def _unreadable(path: Path, what: str) -> Iterator[None]:
    """Loading errors from damaged or missing snapshot files as one line naming the folder.

    `Exception` too: the tokenizers library raises a bare Exception for a corrupt tokenizer.json.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        if not isinstance(e, (OSError, ValueError, KeyError)) and type(e) is not Exception:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load the {what} from {path} (damaged or missing files?): {first}; "
                        "re-run `dvc repro`") from None


def max_positions(path: Path, trust_remote_code: bool = False) -> int | None:
    """The model's max_position_embeddings, or None when its config does not state one."""
    return getattr(auto_config(path, trust_remote_code).get_text_config(), "max_position_embeddings", None)


def num_layers(path: Path, trust_remote_code: bool = False) -> int:
    """Number of decoder layers, from the snapshot's config alone (no weights loaded)."""
    return int(auto_config(path, trust_remote_code).get_text_config().num_hidden_layers)


def auto_config(path: Path, trust_remote_code: bool):
    """The snapshot's config.json as a transformers config; one line naming it when it is damaged."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{Path(path) / 'config.json'} is not a readable model config (corrupt, or not the "
                        f"prepared model?): {first}; re-run `dvc repro`") from None


def eos_ids(model) -> set[int]:
    """Every id the model's generation config (or config) treats as end of sequence."""
    ids: set[int] = set()
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            ids |= set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    return ids


def resolve_device(name: str, key: str = "capture.device") -> torch.device:
    """auto -> cuda when available, else cpu; cpu; cuda / cuda:N only when that GPU exists."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise ValueError(f"device {name!r}: not auto, cpu, cuda or cuda:N (CaptureConfig allows no other)")
    index = int(match.group(1) or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise bad_value(key, name, f"a GPU that exists ({torch.cuda.device_count()} CUDA devices here); "
                                   "use auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: not one of {', '.join(DTYPES)} (CaptureConfig allows no other)")
    return DTYPES[name]
