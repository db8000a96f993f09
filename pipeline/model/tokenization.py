"""Tokenize the prompt and describe every token: id, piece, raw bytes, decodes alone?

A token stands for bytes, not characters: byte-level BPE (Qwen, GPT-2) writes each byte as
a printable stand-in character; SentencePiece-style vocabularies (Gemma) write a space as
"▁" and lone bytes as "<0xHH>". `piece_bytes` undoes either, so a piece like " 就"'s first
half (id 58230) shows as the two bytes it really is and is flagged as not decodable alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import pyarrow as pa

from pipeline.errors import UserError

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer) -> bool:
    # The decoder's own JSON: serialising the whole tokenizer (vocabulary, merges) took seconds.
    decoder = tokenizer.backend_tokenizer.decoder
    decoder = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


def decode_each(tokenizer, ids: list[int]) -> list[str]:
    """`tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)` for
    every id. Where the tokenizer's decode is transformers' plain call into its `tokenizers`
    backend (not overridden by its class), that call is made for all ids at once, in Rust."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    if getattr(type(tokenizer), "_decode", None) is TokenizersBackend._decode:
        return tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The raw bytes one vocabulary piece stands for."""
    if byte_level:
        table = _byte_level_decoder()
        try:
            return bytes(table[ch] for ch in piece)
        except KeyError:          # added tokens are stored as plain text
            return piece.encode("utf-8")
    m = _BYTE_TOKEN.match(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def decodes_alone(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    table: pa.Table           # one row per position
    summary: dict             # round trip, special ids, tokenizer facts


def prompt_for(tokenizer, record, add_special_tokens: bool, where: str = "prompt.text") -> tuple[str, bool]:
    """The text a prompt record is scored as, and whether special tokens are added when encoding it.

    A chat record (`messages`, or prompt.chat=true) is rendered by the tokenizer's own template,
    `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`; the rendered text
    already holds the template's special tokens, so none are added. A tokenizer without a template
    is refused in one line. Both the tokenize and the checks stage take the prompt through here.
    """
    if not record.chat:
        return record.text, add_special_tokens
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where} is a chat prompt, but this model's tokenizer has no chat template "
                        "(tokenizer_config.json / chat_template.jinja): give the prompt as plain text "
                        "(prompt.chat=false, text instead of messages)")
    return tokenizer.apply_chat_template(chat_messages(record), tokenize=False, add_generation_prompt=True), False


def chat_messages(record) -> list[dict]:
    return [m.model_dump() for m in record.messages]


def chat_template_ids(tokenizer, record) -> list[int]:
    """The ids transformers' template gives when it tokenizes itself (`tokenize=True`), for the check
    that the rendered text tokenizes to them."""
    out = tokenizer.apply_chat_template(chat_messages(record), tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def tokenize_prompt(tokenizer, text: str, add_special_tokens: bool, max_positions: int | None = None,
                    where: str = "prompt.text", chat: bool = False) -> Tokenized:
    """One prompt's tokens; `where` names the prompt in an error (`prompt_set.where`). chat: the text is a
    rendered chat template, whose special tokens are part of the text (the round trip keeps them)."""
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    if not ids:
        raise UserError(f"{where} tokenizes to no tokens (text {text[:60]!r}): give a prompt with text in it")
    if max_positions is not None and len(ids) > max_positions:
        raise UserError(f"{where} is {len(ids)} tokens long: the model's context allows at most "
                        f"{max_positions} (max_position_embeddings)")
    table = vocab_table(tokenizer, ids)
    table = pa.table({"position": pa.array(range(len(ids)), pa.int32()), **{
        name: table[name] for name in table.column_names}})
    special = set(tokenizer.all_special_ids)
    content_ids = [i for i in ids if i not in special]
    decoded = tokenizer.decode(content_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    summary = {
        "prompt": text,
        "n_tokens": len(ids),
        "token_ids": ids,
        "add_special_tokens": add_special_tokens,
        "special_positions": [p for p, i in enumerate(ids) if i in special],
        "decoded": tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False),
        "decoded_without_special": decoded,
        # a rendered chat template holds its special tokens as text: decoded with them, it must come back whole
        "round_trip_ok": (tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                          if chat else decoded) == text,
        "tokenizer_class": type(tokenizer).__name__,
        "tokenizer_len": len(tokenizer),
        "byte_level": is_byte_level(tokenizer),
        "special_ids": {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")},
    }
    return Tokenized(ids=ids, table=table, summary=summary)


def vocab_table(tokenizer, ids: list[int] | range) -> pa.Table:
    """token_id, piece, piece_bytes_hex, text, decodes_alone, is_special for the given ids.

    Ids at or past len(tokenizer) (the model's output may be larger, e.g. 152064 vs 151665
    for Qwen2.5) have no token: piece null, has_token false.
    """
    byte_level = is_byte_level(tokenizer)
    n = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    ids = list(ids)
    known = [i for i in ids if i < n]
    pieces = dict(zip(known, tokenizer.convert_ids_to_tokens(known)))
    texts = dict(zip(known, decode_each(tokenizer, known)))
    rows = {"token_id": [], "piece": [], "piece_bytes_hex": [], "text": [], "decodes_alone": [],
            "is_special": [], "has_token": []}
    for i in ids:
        piece = pieces.get(i)
        raw = None if piece is None else (
            piece.encode("utf-8") if i in special else piece_bytes(piece, byte_level))
        rows["token_id"].append(i)
        rows["piece"].append(piece)
        rows["piece_bytes_hex"].append(None if raw is None else raw.hex())
        rows["text"].append(None if piece is None else texts[i])
        rows["decodes_alone"].append(None if raw is None else decodes_alone(raw))
        rows["is_special"].append(i in special)
        rows["has_token"].append(piece is not None)
    return pa.table({
        "token_id": pa.array(rows["token_id"], pa.int32()),
        "piece": pa.array(rows["piece"], pa.string()),
        "piece_bytes_hex": pa.array(rows["piece_bytes_hex"], pa.string()),
        "text": pa.array(rows["text"], pa.string()),
        "decodes_alone": pa.array(rows["decodes_alone"], pa.bool_()),
        "is_special": pa.array(rows["is_special"], pa.bool_()),
        "has_token": pa.array(rows["has_token"], pa.bool_()),
    })
