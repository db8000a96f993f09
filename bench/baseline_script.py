"""The plain transformers script a user would write for nexttoken's outputs: the honest baseline.

What `nexttoken bench` compares the in-process chain with. It produces the same kinds of
outputs with the usual transformers calls and no verification:

- one forward pass with `output_hidden_states=True, output_attentions=True` (every layer's
  attention weights: the API has no per-layer choice), saved with safetensors;
- the logits of every prompt position in long format, `pandas.DataFrame.to_parquet`;
- a vocabulary table (id, piece, decoded text);
- FP64 softmax tables at each temperature for the tabulated positions, torch in float64;
- the kept sets of each top-k / top-p filter, renormalised;
- `generate(return_dict_in_generate=True, output_logits=True)` for the sampled and the greedy
  branch, each with and without the KV cache, and the per-step logits to Parquet.

Not sandbagged: the model is loaded once, everything runs under `torch.inference_mode()`,
generate computes only the last position's logits (its default), and arrays go to pandas
without Python loops over the vocabulary. Run it alone:

    python bench/baseline_script.py artifacts/prepare_model /tmp/out "prompt text"
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Settings:
    """The knobs the chain reads from params.yaml, as plain values."""

    prompt: str
    add_special_tokens: bool = True
    positions: tuple[int, ...] = (-1,)        # prompt positions with probability tables
    temperatures: tuple[float, ...] = (0.5, 1.0, 2.0)
    # (name, temperature, top_k, top_p); top_k=0 / top_p=1.0 = off
    filters: tuple[tuple[str, float, int, float], ...] = (("sampling", 1.0, 0, 1.0),)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 4
    kv_cache: tuple[bool, ...] = (False, True)
    extra: dict = field(default_factory=dict)


def kept_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> pd.DataFrame:
    """Temperature -> top-k -> top-p on one row, FP64, renormalised (the textbook way)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    probs, ids = torch.sort(p, descending=True)
    keep = len(ids) if top_k == 0 else min(top_k, len(ids))
    probs, ids = probs[:keep], ids[:keep]
    if top_p < 1.0:
        mass_before = torch.cumsum(probs / probs.sum(), dim=0) - probs / probs.sum()
        n = int((mass_before < top_p).sum())
        probs, ids = probs[:n], ids[:n]
    return pd.DataFrame({"token_id": ids.numpy(), "prob_before": probs.numpy(),
                         "prob_after": (probs / probs.sum()).numpy()})


def logits_frame(rows: np.ndarray, positions: np.ndarray) -> pd.DataFrame:
    """[R, V] float32 -> long format (position, token_id, logit)."""
    r, v = rows.shape
    return pd.DataFrame({"position": np.repeat(positions.astype(np.int32), v),
                         "token_id": np.tile(np.arange(v, dtype=np.int32), r),
                         "logit": rows.reshape(-1)})


def run(model, tokenizer, s: Settings, out: Path) -> dict:
    """Every output into `out`; returns the generated ids per (branch, kv_cache)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = tokenizer(s.prompt, add_special_tokens=s.add_special_tokens, return_tensors="pt").input_ids
    with torch.inference_mode():
        fwd = model(input_ids=ids, output_hidden_states=True, output_attentions=True, use_cache=False)
    tensors = {f"hidden_states.{i}": h[0] for i, h in enumerate(fwd.hidden_states)}
    tensors |= {f"attentions.{i}": a[0] for i, a in enumerate(fwd.attentions)}
    tensors["logits"] = fwd.logits[0]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "forward.safetensors"))

    logits = fwd.logits[0].float()                                   # [T, V]
    t, v = logits.shape
    logits_frame(logits.numpy(), np.arange(t)).to_parquet(out / "logits.parquet", index=False)
    n = len(tokenizer)
    pd.DataFrame({"token_id": np.arange(n), "piece": tokenizer.convert_ids_to_tokens(list(range(n))),
                  "text": tokenizer.batch_decode([[i] for i in range(n)])}).to_parquet(out / "vocab.parquet",
                                                                                      index=False)
    tables, kept = [], []
    for pos in sorted({p % t for p in s.positions}):
        row = logits[pos]
        table = pd.DataFrame({"position": pos, "token_id": np.arange(v), "logit": row.numpy()})
        table["rank"] = table["logit"].rank(ascending=False, method="first").astype(np.int64)
        for temp in s.temperatures:
            table[f"p_T{temp:g}"] = torch.softmax(row.double() / temp, dim=-1).numpy()
        tables.append(table)
        for name, temp, k, p in s.filters:
            kept.append(kept_set(row, temp, k, p).assign(position=pos, filter=name))
    pd.concat(tables).to_parquet(out / "table.parquet", index=False)
    pd.concat(kept).to_parquet(out / "filtered.parquet", index=False)

    generated, steps, step_logits = {}, [], []
    for branch in ("sample", "greedy"):
        knobs = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p} \
            if branch == "sample" else {"do_sample": False}
        for kv in s.kv_cache:
            torch.manual_seed(s.seed)
            with torch.inference_mode():
                g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                                   use_cache=kv, return_dict_in_generate=True, output_logits=True, **knobs)
            new = g.sequences[0, t:].tolist()
            generated[(branch, kv)] = new
            rows = torch.stack([step[0] for step in g.logits]).float()   # [steps, V]
            probs = torch.softmax(rows, dim=-1)
            for i, tok in enumerate(new):
                steps.append({"branch": branch, "kv_cache": kv, "step": i + 1, "token_id": tok,
                              "piece": tokenizer.convert_ids_to_tokens(tok),
                              "text_so_far": tokenizer.decode(new[:i + 1]), "logit": float(rows[i, tok]),
                              "prob": float(probs[i, tok])})
            step_logits.append(logits_frame(rows.numpy(), np.arange(t, t + len(new)))
                               .assign(branch=branch, kv_cache=kv))
    pd.DataFrame(steps).to_parquet(out / "steps.parquet", index=False)
    pd.concat(step_logits).to_parquet(out / "step_logits.parquet", index=False)
    return generated


def main(argv: list[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    snapshot, out, prompt = argv
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.bfloat16, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    print(run(model, tokenizer, Settings(prompt=prompt), Path(out)))


if __name__ == "__main__":
    main(sys.argv[1:])
