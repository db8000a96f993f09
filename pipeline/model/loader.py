"""Load a prepared model snapshot (weights, tokenizer, config facts) and resolve device and dtype.

Everything a stage needs to run a model that `pipeline.model.snapshot` prepared: the model in
eval mode from safetensors only, its tokenizer, facts read from its config and weight headers
alone (no weights), the device / dtype names of `capture` turned into torch objects, whether
the model is spread over several GPUs, and where it ended up (`device_record`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline import kernels
from pipeline.errors import UserError, bad_value

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def snapshot_dir(prepared_dir: Path, source_record: dict) -> Path:
    """Where the model loads from: the hub snapshot for kind=hub, else the prepared folder."""
    where = source_record.get("snapshot_dir")
    return Path(where) if where else Path(prepared_dir)


_shared: dict | None = None     # inside `shared_loads`: loaded objects by what loaded them


@contextmanager
def shared_loads() -> Iterator[None]:
    """Within it, `load_model` / `load_tokenizer` load each (snapshot, settings) once and hand the
    same object to every later caller: several stages run in one process (`nexttoken verify`)
    share one model load. Callers never modify a loaded model."""
    global _shared
    outer, _shared = _shared, {}
    try:
        yield
    finally:
        _shared = outer


def _once(key: tuple, make):
    if _shared is None:
        return make()
    if key not in _shared:
        _shared[key] = make()
    return _shared[key]


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device, attn_implementation: str,
               trust_remote_code: bool, spread: bool = False):
    """The snapshot's model in eval mode, weights in `dtype` on `device` (safetensors only).

    On one device the model loads on the CPU and moves whole: the same load everywhere (RoPE's
    tables, say, are computed by the CPU whatever the device), and no accelerate needed.
    spread: over every visible GPU instead (accelerate, `device_map="auto"`; see `spread`);
    a model that does not fit them all is refused rather than offloaded to the CPU or disk.
    On a GPU, deterministic CUDA settings are applied first (`kernels.deterministic_cuda`).
    """
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if spread or device.type == "cuda":
        kernels.deterministic_cuda()

    def load():
        with _unreadable(path, "model"):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, device_map="auto" if spread else None,
                trust_remote_code=trust_remote_code, use_safetensors=True, local_files_only=True)
        if not spread and device.type != "cpu":
            model.to(device)
        if spread and (off := sorted({str(p.device) for p in model.parameters() if p.device.type != "cuda"})):
            raise UserError(f"capture.device={SPREAD!r}: the weights ({weights_bytes(path, dtype) / 2**30:.1f} GiB "
                            f"in {str(dtype).removeprefix('torch.')}) do not fit the free memory of the {gpu_count()} "
                            f"GPUs here (accelerate would put some on {', '.join(off)}); "
                            "use GPUs with more free memory")
        return model.eval()
    return _once(("model", str(Path(path).resolve()), str(dtype), str(device), attn_implementation,
                  trust_remote_code, spread), load)


def load_captured(snapshot: Path, cap, trust_remote_code: bool):
    """The model as `capture` (dtype, device, attention, spread) configures it: what forward loaded, for
    the stages after it (trajectories, lens, checks)."""
    dtype = resolve_dtype(cap.dtype)
    return load_model(snapshot, dtype, resolve_device(cap.device), cap.attn_implementation, trust_remote_code,
                      spread=spread(cap.device, snapshot, dtype))


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    def load():
        with _unreadable(path, "tokenizer"):
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    return _once(("tokenizer", str(Path(path).resolve()), trust_remote_code), load)


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


def output_size(path: Path, trust_remote_code: bool = False) -> int:
    """Rows of the LM head (the config's vocab_size; may exceed len(tokenizer)), from the config alone."""
    return int(auto_config(path, trust_remote_code).get_text_config().vocab_size)


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


SPREAD = "multi"   # capture.device: the model spread over every visible GPU


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, key: str = "capture.device", gpus: int | None = None) -> torch.device:
    """auto -> cuda when available, else cpu; multi -> cuda (the first GPU: where the inputs go;
    the weights spread over all, see `spread`); cpu; cuda / cuda:N only when that GPU exists.

    gpus: the number of CUDA devices to check against (default: those visible here).
    """
    gpus = gpu_count() if gpus is None else gpus
    if name == "auto":
        return torch.device("cuda" if gpus else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == SPREAD:
        if not gpus:
            raise bad_value(key, name, "a machine with CUDA GPUs to spread the model over (0 here); use auto or cpu")
        return torch.device("cuda")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise ValueError(f"device {name!r}: not auto, cpu, cuda, cuda:N or {SPREAD} (CaptureConfig allows no other)")
    index = int(match.group(1) or 0)
    if index >= gpus:
        raise bad_value(key, name, f"a GPU that exists ({gpus} CUDA devices here); use auto or cpu")
    return torch.device(name)


def spread(name: str, snapshot: Path, dtype: torch.dtype) -> bool:
    """Spread the model over every visible GPU (accelerate's `device_map="auto"`)? Always for
    capture.device=multi; for auto when there are several GPUs and the weights alone exceed the
    first one's free memory. Otherwise the model stays on one device, where every GEMM runs
    on one GPU model and nothing crosses devices."""
    if name == SPREAD:
        return True
    if name != "auto" or gpu_count() < 2:
        return False
    return weights_bytes(snapshot, dtype) > torch.cuda.mem_get_info(0)[0]


def weights_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes of the snapshot's weights once loaded in `dtype`, from the safetensors headers alone."""
    from safetensors import safe_open

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with _unreadable(path, "model"), safe_open(str(file), framework="pt") as f:
            names = f.keys()        # a safe_open handle is not iterable
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in names) * size
    return total


def device_record(model, device: torch.device) -> dict:
    """Where a computation ran, as the checks compare it: the device name and the GPU model(s)
    holding the weights ("NVIDIA H200"; different ones joined by " + "), None on the CPU."""
    gpus = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    names = list(dict.fromkeys(torch.cuda.get_device_name(i) for i in gpus))
    return {"device": str(device), "gpu_name": " + ".join(names) or None}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: not one of {', '.join(DTYPES)} (CaptureConfig allows no other)")
    return DTYPES[name]
