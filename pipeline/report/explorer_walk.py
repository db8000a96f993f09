"""The explorer's walk: the seed article's steps on the run's own numbers, each number with the artifact it is from.

`walk(inp, lens)` gives, per step (tokens, embedding, layers, lm-head, why, what-if, softmax, temperature, filter, pick,
kv-cache, repetition), the figures the page shows under that step's plain-language explanation (written in
explorer_page/explorer.js, in English and Chinese): each a label in both languages, the value as text, and the
artifact path it comes from (the page puts it in `data-source`). A step without its artifact says why in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.model.names import act_name
from pipeline.numerics import parts_table
from pipeline.store import paths, safetensors_io

STEPS = ("tokens", "embedding", "layers", "lm-head", "why", "what-if", "softmax", "temperature", "filter", "pick",
         "kv-cache", "repetition")
SHOW_IDS = 12           # ids listed in a row
N_COORDS = 4            # coordinates shown of a vector


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
        out += [_num(f"the top id's logit as the sum of its {len(mine)} parts (≈ the model's)",
                     f"最高 id 的 logit = 它的 {len(mine)} 个部分之和（≈ 模型的 logit）",
                     f"{tok(cands[0])}: {float(mine['contribution'].sum()):.4f} ≈ {float(mine['logit'].iloc[0]):g}",
                     parts_src),
                _num("the largest part", "最大的部分", f"{big['component']}: {float(big['contribution']):+.4f}",
                     parts_src)]
        if len(cands) > 1:
            lead = parts_table.top1_differences(attr.parts)
            lead = lead[lead["token_id"] == cands[1]]
            top = lead.iloc[int(np.argmax(lead["difference"].abs().to_numpy()))]
            out += [_num("its lead over the runner-up, and the part that decides most",
                         "它领先第二名多少，以及贡献最大的部分",
                         f"{tok(cands[1])}: {float(lead['difference'].sum()):+.4f}; {top['component']}: "
                         f"{float(top['difference']):+.4f}", parts_src)]
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


def _what_if(inp, src: str) -> list[dict]:
    """The "what if another token" step's numbers: each forced branch (docs/artifacts.md, what-if branches): the id
    forced, its rank, p and step, and the text the greedy continuation after it wrote; the page's view below them
    (explorer.js, whatIf) shows a chosen candidate's branch step by step beside the greedy one."""
    runs: dict[str, list[dict]] = {}
    for r in inp.steps:
        if r.get("forced_step") is not None:
            runs.setdefault(r["branch"], []).append(r)
    out = []
    for branch, rows in runs.items():
        rows = sorted(rows, key=lambda r: r["step"])
        f = next(r for r in rows if r["step"] == r["forced_step"])
        text = (inp.vocab.get(int(f["token_id"])) or {}).get("text")
        rank, step = f["forced_rank"], f["forced_step"]
        out.append(_num(f"{branch}: the id forced (rank {rank}, step {step}), its p → the greedy text after it",
                        f"{branch}：强制选的 id（排名 {rank}，第 {step} 步）、它的概率 → 之后贪心续写的文本",
                        f"{f['token_id']} {text!r} ({100 * f['prob']:.2f}%) → {rows[-1]['text_so_far']!r}", src))
    return out


HEAD_NAMES = ("lm_head.weight", "embed_out.weight")                 # an untied LM head's weight
TIED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")   # tied: the input embedding


def resid_norms(capture: Path, num_layers: int, position: int) -> list[tuple[int, float]]:
    """(layer, FP64 L2 norm of blocks.{layer}.resid_post at `position`) for each captured layer: the residual
    stream's size after each block, read from capture.safetensors without torch."""
    have, _ = safetensors_io.header(capture)
    out = []
    for layer in range(num_layers):
        name = act_name("resid_post", layer)
        if name in have:
            v = safetensors_io.read(capture, name)[0, position].astype(np.float64)
            out.append((layer, float(np.sqrt(np.dot(v, v)))))
    return out


def head_row(snapshot: Path, capture: Path, facts: dict, position: int, token_id: int) -> dict | None:
    """The LM head's row of `token_id` in the prepared snapshot's weights (lm_head.weight, or the input embedding
    for a tied head) and its FP64 dot product with final_norm_out at `position` (the capture's): the logit before
    any bias or soft-capping, which equals the recorded logit within its bf16 rounding. None where no weight file
    of the snapshot holds a tensor of the LM head's shape under a known name."""
    shape = list(facts.get("lm_head_weight_shape") or [])
    names = TIED_SUFFIXES if facts.get("tied_embeddings") else HEAD_NAMES
    for path in sorted(Path(snapshot).glob("*.safetensors")):
        tensors, _ = safetensors_io.header(path)
        for name, t in tensors.items():
            if name.endswith(names) and list(t.shape) == shape:
                with open(path, "rb") as f:          # the one row, as stored (bf16 bits widened exactly)
                    f.seek(t.start + token_id * t.row_bytes)
                    stored = np.frombuffer(f.read(t.row_bytes), safetensors_io.STORED[t.dtype])
                row = safetensors_io.widen(stored, t.dtype).astype(np.float64)
                x = safetensors_io.read(capture, act_name("final_norm_out"))[0, position].astype(np.float64)
                return {"file": path.name, "tensor": name, "row": row[:N_COORDS], "input": x[:N_COORDS],
                        "dot": float(np.dot(row, x)), "size": row.size}
    return None


def _internals(inp, internals: dict | None, src: dict, top: int) -> tuple[list[dict], list[dict]]:
    """The layers step's residual-stream norms and the lm-head step's row and dot product."""
    norms, head = [], []
    internals = internals or {}
    for layer, norm in internals.get("norms") or []:
        norms.append(_num(f"‖residual stream‖ after layer {layer} (L2)", f"第 {layer} 层之后残差流的范数（L2）",
                          f"{norm:.4g}", f"{src['capture']} ({act_name('resid_post', layer)})"))
    h = internals.get("head")
    if h:
        where = f"{src['snapshot']}/{h['file']} ({h['tensor']}[{top}])"
        head = [_num(f"row {top} of the LM head (id {top}): first coordinates",
                     f"LM head 的第 {top} 行（id {top}）：前几个坐标", _coords(h["row"]), where),
                _num(f"that row · the final-norm output, summed over all {h['size']} coordinates in FP64",
                     f"这一行与最终归一化输出的点积（FP64，全部 {h['size']} 个坐标）", f"{h['dot']:.6g}",
                     f"{where} · {src['capture']} ({act_name('final_norm_out')})"),
                _num("the recorded logit of that id (bf16)", "该 id 记录的 logit（bf16）",
                     f"{float(inp.logits[top]):g}", src["logits"])]
    return norms, head


def walk(inp, lens: dict | None, internals: dict | None = None) -> list[dict]:
    """[{step, numbers, missing}]: `missing` (en, zh) says why a step shows no number. internals: {"norms":
    resid_norms(...), "head": head_row(...)} (pages.py reads them from the capture and the snapshot)."""
    pid = inp.prompt_id
    src = {k: (paths.partition(item, pid) if item in paths.PER_PROMPT else paths.artifact(item)).as_posix()
           for k, item in
           (("tokens", paths.TOKENS), ("capture", paths.CAPTURE), ("logits", paths.LOGITS),
            ("summary", paths.PROBS_SUMMARY), ("steps", paths.STEPS), ("lens", paths.LENS),
            ("metrics", paths.TRAJECTORY_PROMPT_METRICS))}
    src["snapshot"] = paths.artifact(paths.SOURCE).parent.as_posix()
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
    norms, head = _internals(inp, internals, src, top)
    steps["layers"] += norms
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
    steps["lm-head"] += head
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
    steps["what-if"] = _what_if(inp, src["steps"])
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
            kv = bool(m.get("kv_cache"))
            found = f"yes / 是: period {m.get('loop_period')}" if m["loop"] else "no / 否"
            steps["repetition"].append(_num(f"{m.get('branch')}{' (KV cache)' if kv else ''}: a loop?",
                                            f"{m.get('branch')}{'（KV 缓存）' if kv else ''}：是否出现循环？", found,
                                            src["metrics"]))
    missing = {"layers": ("", ""),
               "why": ("the attribution stage has not run for this prompt", "本提示词没有运行 attribution 阶段"),
               "what-if": ("no what-if branch was recorded (sampling.what_if = 0, or the trajectories stage has not "
                           "run)", "没有记录假设分支（sampling.what_if = 0，或 trajectories 阶段尚未运行）"),
               "softmax": ("no probability table at this position", "此位置没有概率表"),
               "pick": ("the trajectories stage has not run", "trajectories 阶段尚未运行"),
               "kv-cache": ("no KV-cache branch was run", "没有运行 KV 缓存分支"),
               "repetition": ("no loop figures recorded", "没有记录循环指标")}
    return [{"step": s, "numbers": steps[s],
             "missing": None if steps[s] else dict(zip(("en", "zh"), missing.get(s, ("not recorded", "未记录"))))}
            for s in STEPS]
