// ---- The walk (explorer_walk.py gives the numbers) and the two languages: every text a reader sees that is not a
// number or a name lives here, in English and Chinese; the numbers are the same in both.
const TEXT = {
  en: {
    title: {tokens: "1. Text → tokens", embedding: "2. Tokens → vectors (embedding)", layers: "3. The layers",
      "lm-head": "4. Final norm and LM head → logits", why: "5. Why this token?",
      "what-if": "6. What if another token?", softmax: "7. Logits → probabilities (softmax)",
      temperature: "8. Temperature", filter: "9. top-k and top-p", pick: "10. The pick, and the loop",
      "kv-cache": "11. The KV cache", repetition: "12. Repetition"},
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
      why: "The last vector is a sum: the embedding plus what every attention head and every MLP added. With the " +
        "final norm's scale frozen at its recorded value, the top token's logit splits exactly into one part per " +
        "piece. The bars show each layer's parts (click a layer for its heads; red pushes the logit up, blue down); " +
        "the prompt below is shaded by how much each token matters (integrated gradients). A share is not a cause.",
      "what-if": "The model picked its top token, but the others had some probability too. What would it have " +
        "written after another one? The run records it: each of the next candidates is forced as the first new " +
        "token, and the model goes on greedily from there (checked against transformers' own generation). Click a " +
        "candidate, here or in the next-token bars, to see its continuation step by step beside the greedy one.",
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
      tokens: "The prompt as tokens", run: "Run details", "why-layers": "Parts of the top token's logit, by layer",
      "why-inputs": "The prompt, shaded by each token's share",
      "wi-cands": "candidates (rank, token):", "wi-hint": "click a candidate (or Enter): what the model would have " +
        "written after it (step 6)",
      "wi-forced": "if the model had picked {0} (rank {1}, p = {2} at T = 1) instead of {3}, and then gone on greedily:",
      "wi-is-greedy": "{0} is the greedy pick (rank 1): what follows is the greedy continuation itself",
      "wi-none": "{0} (rank {1}): no branch recorded for it: this run forces only the {2} candidates after the " +
        "greedy one ({3})",
      "wi-off": "no forced branch in this run ({0}, or the trajectories stage has not run)",
      "wi-branch-head": "{0}, step by step", "wi-greedy-head": "{0}, for comparison", "wi-th-pick": "pick (text, id)",
      "wi-text": "the text:", attn: "attention", mlp: "MLP", head: "head", checks: "Checks", lens: "Logit lens",
      attention: "Attention", trajectories: "Trajectories", sample: "sample once", language: "language",
      next: "Next token:", temperature: "temperature", seed: "seed", drawn: "drawn:", kept: "kept:",
      "ids-mass": "ids, mass", rank: "rank", prob: "probability (FP64, before filtering; hover: full precision)",
      t0: "T = 0: greedy (the highest logit). top-k 0 and top-p 1 are off.",
      "tokens-note": "Each box is one token: its text and, small, its id (hover: bytes). ⚠: a piece that does not " +
        "decode alone (part of a multi-byte character); special tokens are grey. Click a position to see its " +
        "recorded top candidates.",
      "tokens-shade": "Green: how likely the model found the token after the ones before it (dark = expected, " +
        "pale = a surprise; hover: p at T = 1 and rank).",
      "traj-shade": "Each pick is shaded by the probability it had when it was picked (dark green = likely).",
      "err-temperature": "temperature = {0}: not allowed; a number >= 0 (0 = greedy)",
      "err-top-k": "top-k = {0}: not allowed; a whole number >= 0 (0 = off)",
      "err-top-p": "top-p = {0}: not allowed; a number in (0, 1] (1 = off)",
      "err-seed": "seed = {0}: not allowed; a whole number in [0, 2^64)",
      "src-greedy": "(T = 0: greedy, the highest logit; top-k and top-p do not apply)",
      "src-warper": "(the set recorded by transformers' warpers for filter {0}: {1})",
      "src-fp64": "(computed here in FP64: not a configured filter)",
      "drawn-how": "{0} (seed {1}, u = {2})", "next-where": "after position {0}, {1}",
      chat: "Chat prompt, rendered by the tokenizer's own template:",
      "pos-none": "position {0}: no logits recorded there", "pos-top": "position {0}: recorded top candidates (logit)",
      "att-none": "no attention weights captured", layer: "layer", "head-n": "head {0}",
      "att-maps": "layer {0}, every head (positions {1}..{2}; row = query)",
      "att-last": "what position {0} (the last) attends to, in percent, per head of layer {1}",
      "lens-none": "no logit lens in this run",
      "lens-note": "layer × position: the top-1 piece after the model's own final norm and LM head; colour = its " +
        "probability (FP64); hover for the top 5 and the final token's rank",
      "traj-kv": " (KV cache)", "traj-forced": ": id {0} (rank {1}) forced at step {2}, then greedy",
      "traj-agree": ": KV cache and full prefix agree", "traj-differ": ": KV cache and full prefix DIFFER",
      loop: "(loop)", "th-step": "step", "th-token": "token id", "th-text": "text so far", "th-alts": "alternatives (text id p)",
      "checks-none": "the checks stage has not run",
      "checks-outside": "checks: none ran on this prompt (outside the checks.prompts sample of a large set)",
      "checks-summary": "checks: {0} of {1} pass; {2} error and {3} report checks fail",
      "cond-model": "model", "cond-dtype / attention": "dtype / attention", "cond-device": "device",
      "cond-kernel path": "kernel path", "cond-commit": "commit", "cond-created": "created",
      eq: "Equivalence: a variation against the record", "eq-variation": "variation",
      "eq-temp-note": "temperature: the Next token panel's ({0}); top-k off",
      "eq-kl-label": "KL(record ‖ variant), FP64, this position", "eq-top1-label": "top-1 (record → variant)",
      "eq-kept-label": "top-p kept (record → variant)", "eq-diff-label": "max / mean |Δ logit|, this position",
      "eq-rank-rec": "rank rec", "eq-rank-var": "rank var", "eq-drank": "Δ rank", "eq-logit-rec": "logit rec",
      "eq-logit-var": "logit var", "eq-dlogit": "Δ logit", "eq-p-rec": "p rec", "eq-p-var": "p var", "eq-kept": "kept",
      "eq-none": "the equivalence stage did not run for this prompt ({0})", "eq-unchosen": "no variation chosen",
      "eq-not-shown": "{0}: not shown: {1}", "eq-greedy": "T = 0 (greedy): no distribution to compare; choose a temperature > 0",
      "eq-invalid": "(invalid setting)", "eq-nan": "{0}: every logit is NaN at position {1} ({2}): no distribution to compare",
      "eq-src-row": "(the row's sets: transformers' float32 warper at T = 1, top-p 0.9)",
      "eq-src-fp64": "(computed here: the FP64 nucleus)",
      "eq-status": "{0} ({1}, embedded as {2}) at position {3}, the next token's",
      "eq-same": "same: {0}", "eq-changed": "changed: {0} → {1}",
      "eq-row": "stored row ({0}, {1}, {2} positions, T = 1): KL mean {3}, max {4}, at the last one {5}; top-p 0.9 " +
        "kept {6}, Jaccard {7} (transformers' float32 warper); top-1 changed at {8}; max |Δ logit| {9}, mean {10}; " +
        "bit-identical {11}; first differing tensor {12}; {13}"},
    // hover titles: values stay as written (full precision), after ": " where a test or a reader reads them off
    tip: {tok: "id {0}, bytes {1}", "tok-p": "id {0}, bytes {1}; p = {2} (rank {3}) after position {4}",
      "att-map": "layer {0}, head {1}", "att-pos": "position {0}", "att-cell": "head {0} → {1}: {2}",
      "lens-cell": "{0}\nthe final token's rank: {1}", "why-attn": "attention: {0}", "why-mlp": "MLP: {0}",
      "why-head": "head {0}: {1}", "why-tok": "position {0}, id {1}: {2}"},
  },
  zh: {
    title: {tokens: "1. 文本 → token", embedding: "2. token → 向量（嵌入）", layers: "3. 各层",
      "lm-head": "4. 最终归一化与 LM head → logit", why: "5. 为什么是这个 token？",
      "what-if": "6. 如果选了另一个 token？", softmax: "7. logit → 概率（softmax）", temperature: "8. 温度",
      filter: "9. top-k 与 top-p", pick: "10. 选词与循环", "kv-cache": "11. KV 缓存", repetition: "12. 重复"},
    explain: {
      tokens: "模型看不到文字本身。分词器把文本切成固定词表里的片段（token），并把每个片段换成它的 id。" +
        "一个汉字可能是一个 token，也可能被拆成几个字节 token。",
      embedding: "每个 id 取出嵌入矩阵中的一行：一个长度为隐藏维度的向量。整个提示词变成一个矩阵，每个位置一个向量。",
      layers: "每一层读取这些向量并在上面累加（残差流）：注意力让每个位置回看之前的位置（Q、K、V，从不看后面），" +
        "然后前馈网络逐个位置变换；RMSNorm 控制数值尺度。logit lens 显示每一层已经会预测什么。",
      "lm-head": "经过最后一层和最终归一化之后，最后一个位置的向量进入 LM head：词表中每个 token 一行，" +
        "与某一行的点积就是该 token 的 logit。",
      why: "最后的向量是一个和：嵌入，加上每个注意力头和每个 MLP 加进去的部分。把最终归一化的尺度固定在记录值上，" +
        "最高 token 的 logit 就能精确地拆成每个部分的贡献。条形图显示每一层的贡献（点击一层查看各个注意力头；" +
        "红色推高 logit，蓝色拉低）；下面的提示词按每个 token 的重要程度着色（积分梯度）。贡献大不等于因果。",
      "what-if": "模型选了排名第一的 token，但其他候选也有一定的概率。如果选了另一个，它会接着写什么？本次运行记录了答案：" +
        "把排在后面的几个候选分别强制作为第一个新 token，然后让模型从那里继续贪心生成（已与 transformers 自己的生成结果" +
        "逐一核对）。点击一个候选（这里或“下一个 token”的条形图中），即可在贪心结果旁边逐步查看它的续写。",
      softmax: "softmax 把 logit 变成概率：p = exp(logit − max) /（全词表之和）。这里用 FP64 计算，与记录一致。",
      temperature: "在 softmax 之前，logit 先除以温度：温度小于 1 时最高的 token 更突出，大于 1 时分布更平。" +
        "T = 0 表示贪心：总是选 logit 最高的。",
      filter: "top-k 只保留概率最高的 k 个 id；top-p 保留累计概率达到 p 的最小集合。保留下来的概率重新归一化，和为 1。",
      pick: "贪心选概率最高的 id；采样从保留的集合中随机抽一个。选出的 token 接到文本后面，模型再运行一次，预测下一个。",
      "kv-cache": "逐个生成 token 时，模型可以保存每层的键和值（KV 缓存），而不必重新计算整个前缀。两种方式应当选出相同的 token。",
      repetition: "贪心解码可能陷入循环，不断重复同一句话。本次运行检查了每个分支。",
    },
    ui: {walk: "逐步讲解：本次运行的真实数字", source: "鼠标悬停在数字上：查看它来自哪个文件",
      tokens: "提示词的 token", run: "运行详情", "why-layers": "最高 token 的 logit 按层分解",
      "why-inputs": "提示词，按每个 token 的贡献着色",
      "wi-cands": "候选（排名，token）：", "wi-hint": "点击一个候选（或按回车）：查看模型选它之后会写什么（第 6 步）",
      "wi-forced": "如果模型选的是 {0}（排名 {1}，T = 1 时 p = {2}）而不是 {3}，之后继续贪心生成：",
      "wi-is-greedy": "{0} 就是贪心的选择（排名 1）：下面就是贪心续写本身",
      "wi-none": "{0}（排名 {1}）：没有为它记录分支：本次运行只强制了贪心之后的 {2} 个候选（{3}）",
      "wi-off": "本次运行没有强制分支（{0}，或 trajectories 阶段尚未运行）",
      "wi-branch-head": "{0}，逐步", "wi-greedy-head": "{0}，用于对比", "wi-th-pick": "选中（文本，id）",
      "wi-text": "文本：", attn: "注意力", mlp: "MLP", head: "头", checks: "检查", lens: "Logit lens",
      attention: "注意力", trajectories: "生成轨迹", sample: "采样一次", language: "语言",
      next: "下一个 token：", temperature: "温度", seed: "随机种子", drawn: "抽到：", kept: "保留：",
      "ids-mass": "个 id，总概率", rank: "排名", prob: "概率（FP64，过滤之前；悬停显示完整精度）",
      t0: "T = 0：贪心（选 logit 最高的）。top-k 为 0、top-p 为 1 表示不启用。",
      "tokens-note": "每个方框是一个 token：它的文本和小字的 id（悬停显示字节）。⚠：单独无法解码的片段" +
        "（多字节字符的一部分）；特殊 token 为灰色。点击一个位置查看它记录的候选词。",
      "tokens-shade": "绿色：在前面的 token 之后，模型认为这个 token 有多大可能（深 = 意料之中，浅 = 出乎意料；" +
        "悬停显示 T = 1 时的 p 和排名）。",
      "traj-shade": "每个选中的 token 按它被选中时的概率着色（深绿 = 可能性大）。",
      "err-temperature": "温度 = {0}：不允许；应为 >= 0 的数（0 = 贪心）",
      "err-top-k": "top-k = {0}：不允许；应为 >= 0 的整数（0 = 不启用）",
      "err-top-p": "top-p = {0}：不允许；应为 (0, 1] 中的数（1 = 不启用）",
      "err-seed": "随机种子 = {0}：不允许；应为 [0, 2^64) 中的整数",
      "src-greedy": "（T = 0：贪心，取 logit 最高者；top-k 与 top-p 不适用）",
      "src-warper": "（transformers 的 warper 为过滤器 {0} 记录的集合：{1}）",
      "src-fp64": "（在此用 FP64 计算：不是配置过的过滤器）",
      "drawn-how": "{0}（种子 {1}，u = {2}）", "next-where": "位置 {0} 之后，{1}",
      chat: "对话提示词，由分词器自带的模板渲染：",
      "pos-none": "位置 {0}：此处没有记录 logit", "pos-top": "位置 {0}：记录的候选词（logit）",
      "att-none": "没有捕获注意力权重", layer: "层", "head-n": "头 {0}",
      "att-maps": "第 {0} 层，每个头（位置 {1}..{2}；行 = 查询）",
      "att-last": "位置 {0}（最后一个）对各位置的注意力，百分比，第 {1} 层的每个头",
      "lens-none": "本次运行没有 logit lens",
      "lens-note": "层 × 位置：经过模型自己的最终归一化和 LM head 后排名第一的片段；颜色 = 它的概率（FP64）；" +
        "悬停显示前 5 名和最终 token 的排名",
      "traj-kv": "（KV 缓存）", "traj-forced": "：第 {2} 步强制为 id {0}（排名 {1}），之后贪心",
      "traj-agree": "：KV 缓存与完整前缀一致", "traj-differ": "：KV 缓存与完整前缀不一致",
      loop: "（循环）", "th-step": "步", "th-token": "token id", "th-text": "目前的文本", "th-alts": "备选（文本 id p）",
      "checks-none": "checks 阶段尚未运行",
      "checks-outside": "检查：本提示词没有运行检查（不在大集合的 checks.prompts 抽样中）",
      "checks-summary": "检查：{1} 项中 {0} 项通过；{2} 项 error 检查和 {3} 项 report 检查未通过",
      "cond-model": "模型", "cond-dtype / attention": "数据类型 / 注意力实现", "cond-device": "设备",
      "cond-kernel path": "内核路径", "cond-commit": "提交", "cond-created": "创建时间",
      eq: "等价性：一种变体与记录的对比", "eq-variation": "变体",
      "eq-temp-note": "温度：使用“下一个 token”面板的温度（{0}）；top-k 不启用",
      "eq-kl-label": "KL（记录 ‖ 变体），FP64，此位置", "eq-top1-label": "第一名（记录 → 变体）",
      "eq-kept-label": "top-p 保留（记录 → 变体）", "eq-diff-label": "最大 / 平均 |Δ logit|，此位置",
      "eq-rank-rec": "记录排名", "eq-rank-var": "变体排名", "eq-drank": "Δ 排名", "eq-logit-rec": "记录 logit",
      "eq-logit-var": "变体 logit", "eq-dlogit": "Δ logit", "eq-p-rec": "记录 p", "eq-p-var": "变体 p", "eq-kept": "保留",
      "eq-none": "本提示词没有运行 equivalence 阶段（{0}）", "eq-unchosen": "未选择变体",
      "eq-not-shown": "{0}：不显示：{1}", "eq-greedy": "T = 0（贪心）：没有可比较的分布；请选择大于 0 的温度",
      "eq-invalid": "（设置无效）", "eq-nan": "{0}：位置 {1} 的每个 logit 都是 NaN（{2}）：没有可比较的分布",
      "eq-src-row": "（该行自己的集合：transformers 的 float32 warper，T = 1，top-p 0.9）",
      "eq-src-fp64": "（在此计算：FP64 核心集合）",
      "eq-status": "{0}（{1}，以 {2} 编码嵌入），位置 {3}，下一个 token 的分布",
      "eq-same": "相同：{0}", "eq-changed": "改变：{0} → {1}",
      "eq-row": "存储的行（{0}，{1}，{2} 个位置，T = 1）：KL 平均 {3}，最大 {4}，最后一个位置 {5}；top-p 0.9 " +
        "保留 {6}，Jaccard {7}（transformers 的 float32 warper）；第一名改变的位置 {8}；最大 |Δ logit| {9}，平均 {10}；" +
        "逐位相同 {11}；第一个不同的张量 {12}；{13}"},
    tip: {tok: "id {0}，字节 {1}", "tok-p": "id {0}，字节 {1}；位置 {4} 给它的 p = {2}（排名 {3}）",
      "att-map": "第 {0} 层，头 {1}", "att-pos": "位置 {0}", "att-cell": "头 {0} → {1}: {2}",
      "lens-cell": "{0}\n最终 token 的排名：{1}", "why-attn": "注意力: {0}", "why-mlp": "MLP: {0}",
      "why-head": "头 {0}: {1}", "why-tok": "位置 {0}，id {1}: {2}"},
  },
};
function walk() {
  const box = $("walk");
  for (const s of D.walk) {
    const table = el("table", {class: "walk-numbers"});
    for (const n of s.numbers) {
      table.append(el("tr", {}, el("th", {"data-label-en": n.label.en, "data-label-zh": n.label.zh}, n.label.en),
        el("td", {class: "num", "data-source": n.source, title: n.source, translate: "no"}, n.value)));
    }
    const sec = el("section", {"data-step": s.step, id: `step-${s.step}`, class: "step-section"},
      el("h2", {"data-step-title": s.step}), el("p", {class: "explain", "data-step-explain": s.step}), table);
    if (s.step === "why" && D.why) sec.append(whyChart(D.why));
    if (s.missing) sec.append(el("p", {class: "note", "data-missing-en": s.missing.en,
                                       "data-missing-zh": s.missing.zh}, s.missing.en));
    box.append(sec);
    if (s.step === "what-if") whatIfSetup(sec);
  }
}
function signColor(v, span) {   // red up, blue down, white at 0 (the report's coolwarm, simplified)
  const a = Math.min(1, Math.abs(v) / (span || 1));
  const [r, g, b] = v >= 0 ? [214, 96, 77] : [67, 147, 195];
  return `rgba(${r},${g},${b},${(0.15 + 0.85 * a).toFixed(3)})`;
}
function whyBar(v, span, key, ...label) {
  const w = (50 * Math.abs(v) / (span || 1)).toFixed(2);
  return tip(el("div", {class: "why-bar"},
    el("span", {class: v >= 0 ? "up" : "down", style: v >= 0 ? `left:50%;width:${w}%` : `right:50%;width:${w}%`}),
    el("b", {}, (v >= 0 ? "+" : "") + v.toFixed(3))), key, ...label, v);
}
function whyChart(w) {            // explorer_walk.why_chart: the step's bars (a layer opens per head) and the prompt
  const box = el("div", {class: "why"});
  if (w.layers.length) {
    const span = Math.max(...w.layers.flatMap((l) => [Math.abs(l.attn), Math.abs(l.mlp), ...l.heads.map(Math.abs)]));
    const table = el("table", {class: "why-layers", id: "why-layers"});
    table.append(el("caption", {"data-ui": "why-layers"}));
    for (const l of w.layers) {
      const row = el("tr", {class: "why-layer", "data-layer": l.layer, tabindex: 0},
        el("th", {}, `▸ ${l.layer}`), el("td", {"data-ui": "attn"}), el("td", {class: "barcell"}, whyBar(l.attn, span, "why-attn")),
        el("td", {"data-ui": "mlp"}), el("td", {class: "barcell"}, whyBar(l.mlp, span, "why-mlp")));
      const heads = l.heads.map((v, h) => el("tr", {class: "why-head", "data-layer": l.layer, hidden: ""},
        el("th", {}, ""), el("td", {}, el("span", {"data-ui": "head"}), ` ${h}`),
        el("td", {class: "barcell"}, whyBar(v, span, "why-head", h)), el("td", {}), el("td", {})));
      const toggle = () => {
        const open = heads.length && heads[0].hidden;
        heads.forEach((r) => { r.hidden = !open; });
        row.firstChild.textContent = `${open ? "▾" : "▸"} ${l.layer}`;
      };
      row.addEventListener("click", toggle);
      row.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(); } });
      table.append(row, ...heads);
    }
    box.append(table);
    if (w.outside.length) box.append(el("p", {class: "note", translate: "no"}, w.outside.map(([c, v]) => `${c}: ${v >= 0 ? "+" : ""}${v.toFixed(3)}`).join(" · ")));
  }
  if (w.inputs.length) {
    const span = Math.max(...w.inputs.map(Math.abs));
    const strip = el("div", {class: "why-inputs", id: "why-inputs"});
    w.inputs.forEach((v, i) => {
      const t = D.tokens[i] || {text: "", id: ""};
      strip.append(tip(el("span", {class: "why-tok", style: `background:${signColor(v, span)}`, translate: "no"},
        t.text.replace(/\n/g, "⏎") || "␣"), "why-tok", i, t.id, v));
    });
    box.append(el("p", {class: "caption", "data-ui": "why-inputs"}), strip);
  }
  return box;
}
// ---- What if another token (step "what-if"): the forced branches (docs/artifacts.md) forced at the last prompt
// position, one per candidate of rank 2 .. sampling.what_if + 1. A click (or Enter) on a candidate, in the step's
// own row or in the Next token bars, shows its branch step by step (each pick and the top alternatives with their
// recorded p) beside the greedy branch; a candidate without a branch says so in one line.
function forcedBranch(id) {          // looked up by the id forced as the first new token, never by position in a list
  return D.trajectories.find((b) => b.forced && b.forced.step === 1 && b.forced.id === id);
}
function greedyBranch() {            // the full-prefix greedy run (the reference path), else the KV-cache one
  return D.trajectories.find((b) => b.branch === "greedy" && !b.kv) ??
    D.trajectories.find((b) => b.branch === "greedy");
}
const tokText = (t) => {               // a token as text; one of spaces only is shown as ␣ (an empty one as ∅)
  const s = JSON.stringify(t ?? "").slice(1, -1);
  return s.trim() ? s : s.replace(/ /g, "␣") || "∅";
};
function stepsTable(b, id) {          // like the Trajectories panel: pick, its p, the alternatives with their p
  const t = el("table", {class: "wi-steps", id, "data-branch": b.branch}, el("tr", {}, ui("th", "th-step"),
    ui("th", "wi-th-pick"), el("th", {}, "p"), ui("th", "th-alts")));
  for (const s of b.steps) {
    const forced = b.forced && s.step === b.forced.step;
    t.append(el("tr", {class: forced ? "wi-forced" : "", "data-step": String(s.step), "data-token-id": String(s.id),
                       "data-prob": String(s.prob), translate: "no"}, el("td", {}, String(s.step)),
      el("td", {class: "wi-tok", style: `background:${probColor(s.prob)}`}, `${tokText(s.piece)} `,
        el("small", {}, String(s.id))),
      el("td", {class: "pct", "data-source": D.steps_source, title: `p = ${s.prob} (${D.steps_source})`},
        percent(s.prob)),
      el("td", {class: "wi-alts"}, ...s.alts.map(([aid, q, text]) =>
        el("span", {class: aid === s.id ? "wi-alt own" : "wi-alt", "data-token-id": String(aid), "data-prob": String(q),
                    title: `id ${aid}: p = ${q}`},
          `${tokText(text)} `, el("small", {}, String(aid)), ` ${percent(q)}`)))));
  }
  return t;
}
function branchColumn(b, head, id) {
  const last = b.steps[b.steps.length - 1];
  return el("div", {class: "wi-col"}, ui("h3", head, [b.branch]),
    el("p", {class: "wi-text"}, ui("span", "wi-text"), " ",
      el("b", {translate: "no"}, JSON.stringify(last ? last.text : ""))),
    stepsTable(b, id));
}
function whatIf(id, scroll) {
  const box = $("what-if"), status = $("what-if-status"), view = $("what-if-view");
  if (!box) return;
  const g = greedyBranch(), forced = D.trajectories.filter((b) => b.forced && b.forced.step === 1);
  const b = forcedBranch(id) ?? (g && g.steps[0] && g.steps[0].id === id ? g : null);
  box.dataset.tokenId = String(id); box.dataset.branch = b ? b.branch : "";
  document.querySelectorAll("#what-if-candidates button, #candidates tr").forEach((e) =>
    e.classList.toggle("wi-sel", e.dataset.tokenId === String(id)));
  const name = `${JSON.stringify(D.last.text[id] ?? "")} (${id})`;
  if (!b) {
    if (forced.length) setUi(status, "wi-none", name, RANK[id], forced.length, `sampling.what_if = ${forced.length}`);
    else setUi(status, "wi-off", "sampling.what_if = 0");
    view.replaceChildren(...(g ? [el("div", {class: "wi-col"}), branchColumn(g, "wi-greedy-head", "what-if-greedy")]
      : []));
  } else {
    const first = b.steps.find((s) => s.step === 1), top = g && g.steps[0];
    if (b === g) setUi(status, "wi-is-greedy", name);
    else setUi(status, "wi-forced", name, RANK[id], first ? percent(first.prob) : "?",
               top ? `${JSON.stringify(D.last.text[top.id] ?? top.piece ?? "")} (${top.id})` : "?");
    view.replaceChildren(branchColumn(b, "wi-branch-head", "what-if-branch"),
      ...(g && b !== g ? [branchColumn(g, "wi-greedy-head", "what-if-greedy")] : []));
  }
  if (scroll) box.closest("section").scrollIntoView({block: "start"});
}
function whatIfSetup(sec) {
  const forced = D.trajectories.filter((b) => b.forced && b.forced.step === 1);
  const n = Math.min(D.last.top.length, Math.max(6, forced.length + 3));
  const row = el("div", {id: "what-if-candidates", class: "wi-cands"}, ui("span", "wi-cands"));
  for (const id of D.last.top.slice(0, n)) {
    const btn = el("button", {type: "button", "data-token-id": String(id), translate: "no",
                              class: forcedBranch(id) ? "has-branch" : ""},
      `${RANK[id]}. ${tokText(D.last.text[id])} `, el("small", {}, String(id)));
    btn.addEventListener("click", () => whatIf(id, false));
    row.append(btn);
  }
  sec.append(el("div", {class: "what-if", id: "what-if"}, row, el("p", {id: "what-if-status", class: "wi-status"}),
    el("div", {id: "what-if-view", class: "wi-view"})));
  const start = forced.map((b) => b.forced.id).sort((a, b) => RANK[a] - RANK[b])[0];
  whatIf(start ?? D.last.top[1] ?? D.last.top[0], false);
}
// An element whose text is TEXT[lang].ui[key] with {0}, {1}, ... filled by args (names and numbers, the same in
// both languages: each in a <span translate="no">); setLanguage fills every such element again.
let LANG = "en";
function fillUi(e) {
  const tpl = TEXT[LANG].ui[e.dataset.ui] ?? TEXT.en.ui[e.dataset.ui] ?? "";
  const args = e.dataset.args ? JSON.parse(e.dataset.args) : [];
  if (e.tagName === "OPTION") { e.textContent = tpl.replace(/\{(\d+)\}/g, (_, i) => String(args[+i])); return; }
  e.replaceChildren(...tpl.split(/\{(\d+)\}/).map((part, i) =>
    i % 2 ? el("span", {translate: "no"}, String(args[+part])) : part));
}
function setUi(e, key, ...args) {
  e.dataset.ui = key;
  if (args.length) e.dataset.args = JSON.stringify(args); else delete e.dataset.args;
  fillUi(e);
}
function clearUi(e) {
  delete e.dataset.ui; delete e.dataset.args; e.textContent = "";
}
function ui(tag, key, args = [], attrs = {}) {
  const e = el(tag, attrs);
  setUi(e, key, ...args);
  return e;
}
// A hover title from TEXT[lang].tip[key], its {0}, {1}, ... the values as given (full precision); setLanguage
// fills it again.
function fillTip(e) {
  const tpl = TEXT[LANG].tip[e.dataset.tip] ?? TEXT.en.tip[e.dataset.tip] ?? "";
  const args = JSON.parse(e.dataset.tipArgs || "[]");
  e.title = tpl.replace(/\{(\d+)\}/g, (_, i) => String(args[+i]));
}
function tip(e, key, ...args) {
  e.dataset.tip = key; e.dataset.tipArgs = JSON.stringify(args.map(String));
  fillTip(e);
  return e;
}
function setLanguage(lang) {
  LANG = lang === "zh" ? "zh" : "en";
  const T = TEXT[LANG];
  document.documentElement.lang = lang === "zh" ? "zh-Hans" : "en";
  document.querySelectorAll("[data-step-title]").forEach((e) => { e.textContent = T.title[e.dataset.stepTitle]; });
  document.querySelectorAll("[data-step-explain]").forEach((e) => { e.textContent = T.explain[e.dataset.stepExplain]; });
  document.querySelectorAll("[data-label-en]").forEach((e) => { e.textContent = e.dataset[`label${lang === "zh" ? "Zh" : "En"}`]; });
  document.querySelectorAll("[data-missing-en]").forEach((e) => { e.textContent = e.dataset[`missing${lang === "zh" ? "Zh" : "En"}`]; });
  document.querySelectorAll("[data-ui]").forEach(fillUi);
  document.querySelectorAll("[data-tip]").forEach(fillTip);
  $("language").value = lang;
}
