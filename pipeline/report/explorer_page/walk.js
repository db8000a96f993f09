// ---- The walk (explorer_walk.py gives the numbers) and the two languages: every text a reader sees that is not a
// number or a name lives here, in English and Chinese; the numbers are the same in both.
const TEXT = {
  en: {
    title: {tokens: "1. Text → tokens", embedding: "2. Tokens → vectors (embedding)", layers: "3. The layers",
      "lm-head": "4. Final norm and LM head → logits", softmax: "5. Logits → probabilities (softmax)",
      temperature: "6. Temperature", filter: "7. top-k and top-p", pick: "8. The pick, and the loop",
      "kv-cache": "9. The KV cache", repetition: "10. Repetition"},
    explain: {
      tokens: "The model never sees letters. A tokenizer cuts the text into pieces from a fixed vocabulary and " +
        "replaces each piece by its id. A Chinese character can be one piece, or be split into byte pieces.",
      embedding: "Each id selects one row of the embedding matrix: a vector of hidden-size numbers. The prompt " +
        "becomes a matrix, one vector per position.",
      layers: "Each layer reads the vectors and adds to them (the residual stream): attention lets a position look " +
        "back at earlier positions (queries, keys, values; never ahead), then a feed-forward network transforms " +
        "each position; RMSNorm keeps the scale in check. The logit lens shows what each layer would already predict.",
      "lm-head": "After the last layer and the final norm, the vector at the last position meets the LM head: one " +
        "row per vocabulary entry; the dot product with a row is that token's logit.",
      softmax: "Softmax turns logits into probabilities: p = exp(logit − max) / (the sum over the whole " +
        "vocabulary). Computed in FP64, as recorded.",
      temperature: "Temperature divides the logits before the softmax: below 1 the top token gains, above 1 the " +
        "distribution flattens. T = 0 means greedy: always the highest logit.",
      filter: "top-k keeps the k most likely ids; top-p keeps the smallest set whose probability reaches p. The " +
        "kept probabilities are renormalised to sum to 1.",
      pick: "Greedy takes the top id; sampling draws one id at random from the kept set. The picked token is " +
        "appended to the text and the model runs again for the next one.",
      "kv-cache": "Generating token by token, the model can keep each layer's keys and values (the KV cache) " +
        "instead of recomputing the whole prefix. Both ways should pick the same tokens.",
      repetition: "Greedy decoding can fall into a loop, repeating the same phrase. The run checks each branch.",
    },
    ui: {walk: "Step by step, on this run's numbers", source: "hover a number: the file it comes from",
      tokens: "The prompt as tokens", run: "Run details", checks: "Checks", lens: "Logit lens",
      attention: "Attention", trajectories: "Trajectories", sample: "sample once", language: "language",
      next: "Next token:", temperature: "temperature", seed: "seed", drawn: "drawn:", kept: "kept:",
      "ids-mass": "ids, mass", rank: "rank", prob: "probability (FP64, before filtering; hover: full precision)",
      t0: "T = 0: greedy (the highest logit). top-k 0 and top-p 1 are off.",
      "tokens-note": "Each box is one token: its text and, small, its id (hover: bytes). ⚠: a piece that does not " +
        "decode alone (part of a multi-byte character); special tokens are grey. Click a position to see its " +
        "recorded top candidates."},
  },
  zh: {
    title: {tokens: "1. 文本 → token", embedding: "2. token → 向量（嵌入）", layers: "3. 各层",
      "lm-head": "4. 最终归一化与 LM head → logit", softmax: "5. logit → 概率（softmax）", temperature: "6. 温度",
      filter: "7. top-k 与 top-p", pick: "8. 选词与循环", "kv-cache": "9. KV 缓存", repetition: "10. 重复"},
    explain: {
      tokens: "模型看不到文字本身。分词器把文本切成固定词表里的片段（token），并把每个片段换成它的 id。" +
        "一个汉字可能是一个 token，也可能被拆成几个字节 token。",
      embedding: "每个 id 取出嵌入矩阵中的一行：一个长度为隐藏维度的向量。整个提示词变成一个矩阵，每个位置一个向量。",
      layers: "每一层读取这些向量并在上面累加（残差流）：注意力让每个位置回看之前的位置（Q、K、V，从不看后面），" +
        "然后前馈网络逐个位置变换；RMSNorm 控制数值尺度。logit lens 显示每一层已经会预测什么。",
      "lm-head": "经过最后一层和最终归一化之后，最后一个位置的向量进入 LM head：词表中每个 token 一行，" +
        "与某一行的点积就是该 token 的 logit。",
      softmax: "softmax 把 logit 变成概率：p = exp(logit − max) /（全词表之和）。这里用 FP64 计算，与记录一致。",
      temperature: "在 softmax 之前，logit 先除以温度：温度小于 1 时最高的 token 更突出，大于 1 时分布更平。" +
        "T = 0 表示贪心：总是选 logit 最高的。",
      filter: "top-k 只保留概率最高的 k 个 id；top-p 保留累计概率达到 p 的最小集合。保留下来的概率重新归一化，和为 1。",
      pick: "贪心选概率最高的 id；采样从保留的集合中随机抽一个。选出的 token 接到文本后面，模型再运行一次，预测下一个。",
      "kv-cache": "逐个生成 token 时，模型可以保存每层的键和值（KV 缓存），而不必重新计算整个前缀。两种方式应当选出相同的 token。",
      repetition: "贪心解码可能陷入循环，不断重复同一句话。本次运行检查了每个分支。",
    },
    ui: {walk: "逐步讲解：本次运行的真实数字", source: "鼠标悬停在数字上：查看它来自哪个文件",
      tokens: "提示词的 token", run: "运行详情", checks: "检查", lens: "Logit lens",
      attention: "注意力", trajectories: "生成轨迹", sample: "采样一次", language: "语言",
      next: "下一个 token：", temperature: "温度", seed: "随机种子", drawn: "抽到：", kept: "保留：",
      "ids-mass": "个 id，总概率", rank: "排名", prob: "概率（FP64，过滤之前；悬停显示完整精度）",
      t0: "T = 0：贪心（选 logit 最高的）。top-k 为 0、top-p 为 1 表示不启用。",
      "tokens-note": "每个方框是一个 token：它的文本和小字的 id（悬停显示字节）。⚠：单独无法解码的片段" +
        "（多字节字符的一部分）；特殊 token 为灰色。点击一个位置查看它记录的候选词。"},
  },
};
function walk() {
  const box = $("walk");
  for (const s of D.walk) {
    const table = el("table", {class: "walk-numbers"});
    for (const n of s.numbers) {
      table.append(el("tr", {}, el("th", {"data-label-en": n.label.en, "data-label-zh": n.label.zh}, n.label.en),
        el("td", {class: "num", "data-source": n.source, title: n.source}, n.value)));
    }
    const sec = el("section", {"data-step": s.step, id: `step-${s.step}`, class: "step-section"},
      el("h2", {"data-step-title": s.step}), el("p", {class: "explain", "data-step-explain": s.step}), table);
    if (s.missing) sec.append(el("p", {class: "note", "data-missing-en": s.missing.en,
                                       "data-missing-zh": s.missing.zh}, s.missing.en));
    box.append(sec);
  }
}
function setLanguage(lang) {
  const T = TEXT[lang] || TEXT.en;
  document.documentElement.lang = lang === "zh" ? "zh-Hans" : "en";
  document.querySelectorAll("[data-step-title]").forEach((e) => { e.textContent = T.title[e.dataset.stepTitle]; });
  document.querySelectorAll("[data-step-explain]").forEach((e) => { e.textContent = T.explain[e.dataset.stepExplain]; });
  document.querySelectorAll("[data-label-en]").forEach((e) => { e.textContent = e.dataset[`label${lang === "zh" ? "Zh" : "En"}`]; });
  document.querySelectorAll("[data-missing-en]").forEach((e) => { e.textContent = e.dataset[`missing${lang === "zh" ? "Zh" : "En"}`]; });
  document.querySelectorAll("[data-ui]").forEach((e) => { e.textContent = T.ui[e.dataset.ui]; });
  $("language").value = lang;
}
