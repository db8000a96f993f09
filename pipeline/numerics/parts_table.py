"""A logit-parts table read as the reader wants it, with pandas alone (no torch: the report imports it).

The table is `pipeline.model.logit_parts`'s, one row per (position, candidate, part), columns
`PARTS_COLUMNS`; `numerics.logit_parts` computes and checks it. Here: what decides the pick (the top-1
minus each other candidate, part by part) and the parts summed per layer, the two views the report and the
explorer show.
"""

from __future__ import annotations

import pandas as pd

PARTS_COLUMNS = ("position", "token_id", "component", "layer", "head", "contribution", "logit", "logit_fp64",
                 "bound")


def top1_differences(parts: pd.DataFrame) -> pd.DataFrame:
    """Per position, per other candidate: each component's contribution to the top-1 minus its
    contribution to that candidate (top-1: the highest `logit`, ties by lower id). Columns
    position, token_id (the other candidate), top1_id, component, layer, head, difference; per
    (position, token_id) the differences sum to logit(top1) - logit(token), what decides the pick."""
    out = []
    for position, rows in parts.groupby("position", sort=True):
        logits = rows.groupby("token_id")["logit"].first()
        top1 = int(min(logits.index[logits == logits.max()]))
        mine = rows[rows["token_id"] == top1].set_index("component")["contribution"]
        for token_id, other in rows[rows["token_id"] != top1].groupby("token_id", sort=True):
            diff = other[["component", "layer", "head"]].copy()
            diff["difference"] = mine.loc[other["component"]].to_numpy() - other["contribution"].to_numpy()
            diff.insert(0, "top1_id", top1)
            diff.insert(0, "token_id", int(token_id))
            diff.insert(0, "position", int(position))
            out.append(diff)
    columns = ["position", "token_id", "top1_id", "component", "layer", "head", "difference"]
    return pd.concat(out, ignore_index=True)[columns] if out else pd.DataFrame(columns=columns)


def by_layer(parts: pd.DataFrame, value: str = "contribution") -> pd.DataFrame:
    """Per (position, token_id) and layer: the layer's attention (its heads and o_proj bias summed) and its
    MLP, with the parts outside any layer (`embed`, `pos_embed`, `bias`, `softcap`) as their own rows
    (layer null). Columns position, token_id, layer, kind (`attn`, `mlp` or the component), `value` summed;
    per (position, token_id) the rows add up to what `parts`' rows add up to."""
    df = parts.copy()
    kind = df["component"].where(df["layer"].isna(), df["component"].str.split(".").str[2])
    df["kind"] = kind
    out = df.groupby(["position", "token_id", "layer", "kind"], dropna=False, sort=False)[value].sum().reset_index()
    order = out["layer"].fillna(-1)
    return out.assign(_o=order).sort_values(["position", "token_id", "_o", "kind"], kind="stable") \
        .drop(columns="_o").reset_index(drop=True)
