"""The explorer's walk: the seed article's steps on the run's own numbers, each number with the artifact it is from.

`walk(inp, lens)` gives, per step (tokens, embedding, layers, lm-head, softmax, temperature, filter, pick,
kv-cache, repetition), the figures the page shows under that step's plain-language explanation (written in
explorer_page/explorer.js, in English and Chinese): each a label in both languages, the value as text, and the
artifact path it comes from (the page puts it in `data-source`). A step without its artifact says why in one line.
"""

from __future__ import annotations

import numpy as np

from pipeline.model.names import act_name
from pipeline.numerics import parts_table
from pipeline.store import paths

STEPS = ("tokens", "embedding", "layers", "lm-head", "why", "softmax", "temperature", "filter", "pick", "kv-cache",
         "repetition")
SHOW_IDS = 12           # ids listed in a row


def _num(en: str, zh: str, value, source: str) -> dict:
    return {"label": {"en": en, "zh": zh}, "value": str(value), "source": source}


def _coords(v: np.ndarray) -> str:
    return "[" + ", ".join(f"{float(x):.4g}" for x in v) + ", …]"


def _why(inp) -> list[dict]:
    """The "why this token" step's numbers (the report's section 10 in brief); none where the attribution stage
    did not attribute this prompt."""
    attr = inp.attribution
    if isinstance(attr, str) or not attr:
        return []
    pid = inp.prompt_id
    parts_src, inputs_src = (paths.partition(i, pid).as_posix() for i in (paths.LOGIT_PARTS, paths.INPUTS))
    out = []

    def tok(i: int) -> str:
        return f"{i} {(inp.vocab.get(i) or {}).get('text')!r}"
    if not attr.parts.empty:
        cands = attr.candidates()
        mine = attr.parts[attr.parts["token_id"] == cands[0]]
        big = mine.iloc[int(np.argmax(mine["contribution"].abs().to_numpy()))]
        out += [_num(f"id {tok(cands[0])}: its logit as the sum of {len(mine)} parts",
                     f"id {tok(cands[0])}：logit = {len(mine)} 个部分之和",
                     f"{float(mine['contribution'].sum()):.4f} (model: {float(mine['logit'].iloc[0]):g})", parts_src),
                _num("the largest part", "最大的部分", f"{big['component']}: {float(big['contribution']):+.4f}",
                     parts_src)]
        if len(cands) > 1:
            lead = parts_table.top1_differences(attr.parts)
            lead = lead[lead["token_id"] == cands[1]]
            top = lead.iloc[int(np.argmax(lead["difference"].abs().to_numpy()))]
            out += [_num(f"its lead over id {tok(cands[1])}, and the part that decides most",
                         f"它领先 id {tok(cands[1])} 多少，以及贡献最大的部分",
                         f"{float(lead['difference'].sum()):+.4f}; {top['component']}: {float(top['difference']):+.4f}",
                         parts_src)]
    elif attr.reason:
        out.append(_num("logit parts", "logit 分解", attr.reason, parts_src))
    ig = attr.inputs[attr.inputs["method"] == "integrated_gradients"]
    if not ig.empty:
        i = int(np.argmax(ig["attribution"].abs().to_numpy()))
        pos = int(ig["source_position"].iloc[i])
        text = inp.tokens[pos]["text"] if pos < len(inp.tokens) else ""
        out.append(_num("the prompt token it depends on most (integrated gradients)",
                        "它最依赖的提示词 token（积分梯度）",
                        f"position {pos} {text!r}: {float(ig['attribution'].iloc[i]):+.4f}", inputs_src))
    return out


def why_chart(inp) -> dict | None:
    """The why step's chart data: per layer the top-1's attention (and each head's) and MLP parts, the parts
    outside a layer, and each prompt position's IG share; None without the attribution tables."""
    attr = inp.attribution
    if isinstance(attr, str) or not attr:
        return None
    chart = {"layers": [], "outside": [], "inputs": [], "top1": None}
    if not attr.parts.empty:
        top1 = attr.candidates()[0]
        mine = attr.parts[attr.parts["token_id"] == top1]
        chart["top1"] = top1
        for layer, rows in mine[mine["layer"].notna()].groupby("layer", sort=True):
            heads = rows[rows["head"].notna()].sort_values("head")
            mlp = rows[rows["component"].str.endswith(".mlp")]
            chart["layers"].append({"layer": int(layer), "attn": float(rows[~rows["component"].str.endswith(".mlp")]
                                                                          ["contribution"].sum()),
                                    "mlp": float(mlp["contribution"].sum()),
                                    "heads": [float(v) for v in heads["contribution"]]})
        outside = mine[mine["layer"].isna()]
        chart["outside"] = [[c, float(v)] for c, v in zip(outside["component"], outside["contribution"])]
    ig = attr.inputs[attr.inputs["method"] == "integrated_gradients"].sort_values("source_position")
    chart["inputs"] = [float(v) for v in ig["attribution"]]
    return chart


def walk(inp, lens: dict | None) -> list[dict]:
    """[{step, numbers, missing}]: `missing` (en, zh) says why a step shows no number."""
    pid = inp.prompt_id
    src = {k: (paths.partition(item, pid) if item in paths.PER_PROMPT else paths.artifact(item)).as_posix()
           for k, item in
           (("tokens", paths.TOKENS), ("capture", paths.CAPTURE), ("logits", paths.LOGITS),
            ("summary", paths.PROBS_SUMMARY), ("steps", paths.STEPS), ("lens", paths.LENS),
            ("metrics", paths.TRAJECTORY_PROMPT_METRICS))}
    facts, last = inp.facts, inp.position
    toks = inp.tokens
    top = int(np.lexsort((np.arange(inp.logits.size), -inp.logits.astype(np.float64)))[0])
    steps = {s: [] for s in STEPS}
    steps["tokens"] = [
        _num("tokens in the prompt", "提示词的 token 数", len(toks), src["tokens"]),
        _num("their ids", "它们的 id", " ".join(str(t["token_id"]) for t in toks[:SHOW_IDS])
             + (" …" if len(toks) > SHOW_IDS else ""), src["tokens"]),
        _num("pieces that are part of a character", "只是一个字符的一部分的 token",
             sum(not t["decodes_alone"] for t in toks), src["tokens"])]
    emb, fin = inp.coords.get(act_name("embed")), inp.coords.get(act_name("final_norm_out"))
    steps["embedding"] = [_num("embedded prompt: positions × hidden size", "嵌入后的提示词：位置数 × 隐藏维度",
                               f"{facts.get('n_positions')} × {facts.get('hidden_size')}", src["capture"])]
    if emb is not None:
        steps["embedding"].append(_num(f"position {last}: first coordinates", f"位置 {last}：前几个坐标",
                                       _coords(emb[last]), src["capture"] + " (embed)"))
    steps["layers"] = [_num("layers", "层数", facts.get("num_layers"), src["capture"]),
                       _num("attention heads (key/value heads)", "注意力头数（键/值头数）",
                            f"{facts.get('num_heads')} ({facts.get('num_kv_heads')})", src["capture"])]
    if lens:
        col = lens["positions"].index(last) if last in lens["positions"] else None
        for li, row in zip(lens["layers"], lens["cells"]):
            if col is not None:
                c = row[col]
                steps["layers"].append(_num(f"layer {li} predicts", f"第 {li} 层的预测",
                                            f"{c['text']!r} ({100 * c['p']:.1f}%)", src["lens"]))
    steps["lm-head"] = [_num("LM-head weight shape (vocabulary × hidden)", "LM head 权重形状（词表 × 隐藏维度）",
                             " × ".join(map(str, facts.get("lm_head_weight_shape") or [])), src["capture"])]
    if fin is not None:
        steps["lm-head"].append(_num(f"its input at position {last} (after the final norm)",
                                     f"位置 {last} 的输入（最终归一化之后）", _coords(fin[last]),
                                     src["capture"] + " (final_norm_out)"))
    steps["lm-head"].append(_num("the highest logit (id)", "最高的 logit（id）",
                                 f"{float(inp.logits[top]):g} ({top})", src["logits"]))
    steps["why"] = _why(inp)
    by_t = {t["temperature"]: t for t in inp.summary["temperatures"] if t["position"] == last}
    one = by_t.get(1.0) or next(iter(by_t.values()), None)
    if one:
        steps["softmax"] = [
            _num(f"p of id {one['top'][0]['token_id']} at T = {one['temperature']:g}",
                 f"T = {one['temperature']:g} 时 id {one['top'][0]['token_id']} 的概率",
                 f"{100 * one['top'][0]['prob']:.2f}%", src["summary"]),
            _num("|sum of p − 1| in FP64", "FP64 概率之和与 1 的差", f"{one['sum_error_fp64']:.3g}", src["summary"]),
            _num("entropy (bits)", "熵（比特）", f"{one['entropy_bits']:.3f}", src["summary"])]
    steps["temperature"] = [_num(f"T = {t:g}: p of the top id, entropy", f"T = {t:g}：最高 id 的概率，熵",
                                 f"{100 * s['top'][0]['prob']:.2f}%, {s['entropy_bits']:.3f} bits", src["summary"])
                            for t, s in sorted(by_t.items())]
    steps["filter"] = [_num(f"{f['filter']} (T {f['temperature']:g}, top-k {f['top_k']}, top-p {f['top_p']:g}): "
                            "kept ids, mass", f"{f['filter']}（T {f['temperature']:g}，top-k {f['top_k']}，"
                            f"top-p {f['top_p']:g}）：保留的 id 数，总概率",
                            f"{f['kept_count']}, {f['kept_mass']:.6f}", src["summary"])
                       for f in inp.summary["filters"] if f["position"] == last]
    branches = {}
    for r in inp.steps:
        branches.setdefault((r["branch"], bool(r["kv_cache"])), []).append(r)
    for (branch, kv), rows in branches.items():
        if not kv:
            ids = " ".join(str(r["token_id"]) for r in rows[:SHOW_IDS])
            steps["pick"].append(_num(f"{branch}: ids, then the text so far", f"{branch}：id，以及目前的文本",
                                      f"{ids} → {rows[-1]['text_so_far']!r}", src["steps"]))
            twin = branches.get((branch, True))
            if twin:
                agree = [r["token_id"] for r in rows] == [r["token_id"] for r in twin]
                steps["kv-cache"].append(_num(f"{branch}: the same {len(rows)} tokens with the KV cache as without?",
                                              f"{branch}：使用 KV 缓存与不使用时，{len(rows)} 个 token 是否相同？",
                                              "yes / 是" if agree else "NO / 否", src["steps"]))
    for m in inp.prompt_metrics or []:
        if isinstance(m, dict) and "loop" in m and m.get("prompt_id", pid) == pid:
            name = f"{m.get('branch')}{' (KV cache)' if m.get('kv_cache') else ''}"
            found = f"yes / 是: period {m.get('loop_period')}" if m["loop"] else "no / 否"
            steps["repetition"].append(_num(f"{name}: a loop?", f"{name}：是否出现循环？", found, src["metrics"]))
    missing = {"layers": ("", ""),
               "why": ("the attribution stage has not run for this prompt", "本提示词没有运行 attribution 阶段"),
               "softmax": ("no probability table at this position", "此位置没有概率表"),
               "pick": ("the trajectories stage has not run", "trajectories 阶段尚未运行"),
               "kv-cache": ("no KV-cache branch was run", "没有运行 KV 缓存分支"),
               "repetition": ("no loop figures recorded", "没有记录循环指标")}
    return [{"step": s, "numbers": steps[s],
             "missing": None if steps[s] else dict(zip(("en", "zh"), missing.get(s, ("not recorded", "未记录"))))}
            for s in STEPS]
