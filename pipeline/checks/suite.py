"""The checks stage's work: every recorded number against a second derivation of it.

Each check is a small function returning a `pipeline.checks.verdicts.Check` whose `what`
names the two things it compares: a stored value and the same value computed another way
(another implementation, another library, or another path through the model), never the
function that wrote it. This module: tokenizer, capture and recomputations;
`pipeline.checks.tables`: the probability tables and kept sets;
`pipeline.checks.trajectory`: the decoding steps. Earlier stages' own verdicts (facts.json /
summary.json booleans) are never used as measurements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline import kernels
from pipeline.checks import next_token, recompute, tables
from pipeline.checks.trajectory import (
    generate_parity,
    greedy_argmax,
    kv_cache,
    loops,
    step1_logits,
    step_logits_sha256,
    what_if_branches,
    what_if_generate,
)
from pipeline.checks.verdicts import Check, diff_detail, max_abs, mismatches
from pipeline.model import capture, decode, loader, tokenization, trajectories
from pipeline.numerics import probs
from pipeline.store import logits_io, paths
from pipeline.store.artifacts import (
    device_where,
    parquet_facts,
    read_json,
    read_manifest_once,
    read_once,
    read_parquet,
    read_safetensors,
    recorded_cpu_kernels,
    tables_stored,
)


# ---------------------------------------------------------------- stored artifacts
@dataclass(frozen=True)
class Stored:
    """What the checks read: token ids, the capture, where it ran, and the tables' paths.

    The probs and trajectories outputs are None when that stage has no output folder (it
    stopped: e.g. on non-finite logits); their checks are then one failed `<stage>_outputs`.
    """

    token_ids: list[int]
    token_text: list[str]
    tensors: dict[str, torch.Tensor]     # capture.safetensors
    devices: dict[str, dict]             # forward / trajectories -> {"device", "gpu_name"} they ran on
    logits: Path
    table: Path | pa.Table | None        # a derived table (`probs.table`): re-derived from logits.parquet
    filtered: Path | pa.Table | None     # likewise
    steps: Path | None
    step_logits: Path | None             # None with steps: not stored (`sampling.step_logits`), re-derived here
    token_bytes: list[bytes | None] = field(default_factory=list)   # tokens.parquet piece_bytes_hex
    token_special: list[bool] = field(default_factory=list)
    # trajectories/prompt_metrics.parquet and this prompt's id in it; None when trajectories did not run
    prompt_metrics: tuple[Path, str] | None = None
    # probs/prompt_metrics.parquet with what its check needs (tokenize.json's prompt_id,
    # vocab.parquet); None when probs did not run
    probs_prompt_metrics: tuple[Path, str, Path] | None = None
    # lens/lens.parquet and lens_summary.parquet; None when the lens stage did not run
    lens: Path | None = None
    lens_summary: Path | None = None
    trajectories: Path | None = None     # trajectories.json: every step logits row's recorded sha256

    @property
    def missing(self) -> tuple[str, ...]:
        """The stages whose outputs are absent, in pipeline order."""
        return tuple(stage for stage, p in (("probs", self.table), ("trajectories", self.steps)) if p is None)

    @property
    def logit_positions(self) -> list[int]:
        # From the shapes, not from facts.json: all positions, or the last one.
        n, rows = len(self.token_ids), self.tensors[capture.act_name("logits")].shape[1]
        return list(range(n)) if rows == n else [n - 1]

    def last_row(self) -> np.ndarray:
        """logits.parquet at the last prompt position (float32 = the exact bf16 values)."""
        return logits_io.read_position(self.logits, len(self.token_ids) - 1)


OPTIONAL_STAGES = ("probs", "trajectories")   # they refuse non-finite logits; forward and logits record them


def load(use: Callable[..., Path], root: Path | str, prompt_id: str) -> Stored:
    """Read one prompt's artifacts through `use(item, prompt_id)` (StageRun.use: records each one as an
    input; `paths.lookup`: reads them as they are).

    An OPTIONAL_STAGES stage without an output folder (DVC removes a failed stage's outputs)
    is recorded as missing; any other absent or partial output stays an error (from `use`).
    """
    def optional(item: tuple[str, str]) -> Path | None:
        return use(item, prompt_id) if item[0] not in OPTIONAL_STAGES or paths.stage_dir(item[0], root).exists() \
            else None

    tokens = read_parquet(use(paths.TOKENS, prompt_id), columns=["token_id", "text", "piece_bytes_hex", "is_special"])
    own_id = read_json(use(paths.TOKENIZE_SUMMARY, prompt_id)).get("prompt_id")
    facts, steps = read_json(use(paths.FORWARD_FACTS, prompt_id)), optional(paths.STEPS)
    from pipeline.model.trajectories import step_logits_stored
    step_logits = optional(paths.STEP_LOGITS) if steps is not None and step_logits_stored(steps) else None
    metrics, item = None, paths.PROBS_PROMPT_METRICS     # after this prompt's own inputs: a missing one is named first
    if paths.stage_dir(item[0], root).exists():
        metrics = (use(item), own_id, use(paths.VOCAB))
    traj = parquet_facts(steps) if steps else {}
    devices = {"forward": {"device": facts.get("device"), "gpu_name": facts.get("gpu_name"),
                           "cpu_kernels": recorded_cpu_kernels(root, "forward", prompt_id)},
               "trajectories": {"device": traj.get("device"), "gpu_name": traj.get("gpu_name"),
                                "cpu_kernels": recorded_cpu_kernels(root, "trajectories", prompt_id)}}
    loops_item = paths.TRAJECTORY_PROMPT_METRICS
    loops_table = (use(loops_item), own_id) if paths.stage_dir(loops_item[0], root).exists() else None
    lens = paths.manifest_path(paths.LENS[0], root).exists()                       # False: the lens stage did not run
    return Stored(tokens["token_id"].to_pylist(), tokens["text"].to_pylist(),
                  read_safetensors(use(paths.CAPTURE, prompt_id)), devices, use(paths.LOGITS, prompt_id),
                  _probs_table(use, root, prompt_id), _probs_table(use, root, prompt_id, paths.FILTERED),
                  steps,
                  step_logits, [None if h is None else bytes.fromhex(h) for h in tokens["piece_bytes_hex"].to_pylist()],
                  tokens["is_special"].to_pylist(),
                  loops_table, metrics, use(paths.LENS, prompt_id) if lens else None,
                  use(paths.LENS_SUMMARY, prompt_id) if lens else None,
                  use(paths.TRAJECTORIES, prompt_id) if steps is not None else None)


def _probs_table(use: Callable[..., Path], root: Path | str, prompt_id: str,
                 item: tuple[str, str] = paths.TABLE) -> Path | pa.Table | None:
    """table.parquet's (or filtered.parquet's) path; where the probs stage derived it (`probs.table`), the
    table re-derived from logits.parquet by the stage's own function (`probs.read_table`); None when probs
    did not run."""
    if not paths.stage_dir(item[0], root).exists():
        return None
    manifest = read_manifest_once(item[0], root)        # a set's lists every prompt: not read per prompt
    if tables_stored(manifest):
        return use(item, prompt_id)
    return probs.read_table(use, prompt_id, manifest, item)


def here_record(model, device: torch.device) -> dict:
    """Where this process computes, as `device_difference` compares it."""
    from pipeline.store import provenance
    return {**loader.device_record(model, device), "cpu_kernels": kernels.cpu_key(provenance.kernel_path())}


def _cpu_kernels_differ(ra: dict, rb: dict) -> bool:
    """Both computed on the CPU with recorded kernels, and those are not the same (AVX2 vs AVX-512 give other
    bf16 bits); unrecorded on either side: not known to differ."""
    ka, kb = ra.get("cpu_kernels"), rb.get("cpu_kernels")
    return device_where(ra) == device_where(rb) == "cpu" and ka is not None and kb is not None and ka != kb


def device_difference(a: tuple[str, dict], b: tuple[str, dict]) -> str:
    """"" when two computations ((label, {"device", "gpu_name"})) ran on the same kind of device
    and GPU model, else a sentence saying where each ran. A CUDA run whose GPU model was not
    recorded counts as another GPU: nothing says its kernels were these."""
    (la, ra), (lb, rb) = a, b
    if _cpu_kernels_differ(ra, rb):
        return (f"report, not error: {la} ran on CPU kernels {ra['cpu_kernels']}, {lb} on {rb['cpu_kernels']}, "
                "which may round differently")
    wa, wb = device_where(ra), device_where(rb)
    if wa == wb and "not recorded" not in wa:
        return ""
    return f"report, not error: {la} ran on {wa}, {lb} on {wb}, whose kernels may round differently"


def kernel_bound(checks: Sequence[Check], a: tuple[str, dict], b: tuple[str, dict]) -> list[Check]:
    """Checks comparing a computation of run `a` with one of run `b`, bit for bit: on another
    device or GPU model the kernels differ, and so may the bits with nothing broken, so there
    they become reports whose detail says why (an audit of a GPU run on a CPU never fails on
    them); on the same kind of device they stay as made (errors)."""
    why = device_difference(a, b)
    if not why:
        return list(checks)
    return [replace(c, severity="report", detail=f"{c.detail}; {why}" if c.detail else why, device_note=why)
            for c in checks]


# ---------------------------------------------------------------- tokenizer and capture
def _ids(name: str, what: str, got: list, want: list) -> Check:
    return Check(name, what, mismatches(got, want), 0, "error", diff_detail(got, want))


def tokenizer_retokenize(tokenizer_json: Path | None, tokenizer, text: str, add_special_tokens: bool,
                         stored_ids: list[int]) -> Check:
    """The tokenize stage encoded through transformers' tokenizer; this encodes with the `tokenizers`
    library straight from the snapshot's tokenizer.json (else from the loaded tokenizer's backend)."""
    from tokenizers import Tokenizer
    if tokenizer_json is not None and Path(tokenizer_json).is_file():
        raw = _raw_tokenizer(tokenizer_json)
    else:
        raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoded = raw.encode(text, add_special_tokens=add_special_tokens).ids
    return _ids("tokenizer_retokenize", "tokens.parquet ids vs prompt.text encoded by the `tokenizers` library "
                "from tokenizer.json (not transformers' wrapper)", encoded, stored_ids)


@read_once
def _raw_tokenizer(tokenizer_json: Path):
    """tokenizer.json read once per process and file version (0.4 s for Qwen's 152k vocabulary, and a set
    checks every prompt with it)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokenizer_json))


def tokenizer_round_trip(tokenizer, text: str, stored_ids: list[int], chat: bool = False) -> Check:
    """chat: the text is a rendered chat template, whose special tokens are text: all ids decode back to it."""
    special = set() if chat else set(tokenizer.all_special_ids)
    decoded = tokenizer.decode([i for i in stored_ids if i not in special], skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)
    what = "the rendered chat prompt vs decode(all tokens.parquet ids)" if chat else \
        "prompt.text vs decode(tokens.parquet ids without special tokens)"
    return _ids("tokenizer_round_trip", f"{what} (characters)", decoded, text)


def tokenizer_bytes(tokenizer, text: str, stored: Stored, chat: bool = False) -> Check:
    """tokens.parquet's bytes, joined, are the prompt's UTF-8 bytes (one leading space a
    SentencePiece dummy prefix adds is allowed; a rendered chat prompt's special tokens are part of
    it); each token's bytes that are UTF-8 on their own are what the tokenizer decodes that id to."""
    content = [b or b"" for b, sp in zip(stored.token_bytes, stored.token_special) if chat or not sp]
    joined, want = b"".join(content), text.encode("utf-8")
    bad = [] if joined in (want, b" " + want) else ["joined bytes"]
    for pos, (i, b) in enumerate(zip(stored.token_ids, stored.token_bytes)):
        try:
            alone = (b or b"").decode("utf-8")
        except UnicodeDecodeError:
            continue
        if tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) != alone:
            bad.append(f"position {pos}")
    return Check("tokenizer_bytes", "tokens.parquet piece bytes vs the prompt's UTF-8 bytes (joined) and vs "
                 "decode([id]) (each token that is UTF-8 alone) (mismatches)", len(bad), 0, "error",
                 ", ".join(bad[:5]) or f"{len(joined)} bytes")


def chat_template(tokenizer, prompt, stored_ids: list[int]) -> list[Check]:
    """A chat prompt: the stored ids (the rendered text, encoded) vs what the template gives when it
    tokenizes itself, `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`."""
    if not prompt.chat:
        return []
    return [_ids("chat_template_ids", "tokens.parquet ids vs apply_chat_template(messages, tokenize=True, "
                 "add_generation_prompt=True)", stored_ids, tokenization.chat_template_ids(tokenizer, prompt))]


def tokenizer_expected_ids(tokenizer, family: str, expected: list[int] | None, text: str,
                           stored_ids: list[int]) -> list[Check]:
    """Stored ids == prompt.expected_token_ids.<family>: an error when the expected ids decode to
    prompt.text (the tokenizer now segments this very text differently), a report when they do
    not (they were written for another text: stale after a `prompt.text` override, or mistyped)."""
    if expected is None:
        return []
    try:
        own = tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
    except (IndexError, OverflowError, TypeError, ValueError):   # ids the tokenizer does not have
        own = False
    what = f"tokens.parquet ids vs prompt.expected_token_ids.{family}" + (
        "" if own else " (report: those ids do not decode to prompt.text)")
    return [Check("tokenizer_expected_ids", what, mismatches(stored_ids, expected), 0, "error" if own else "report",
                  diff_detail(stored_ids, expected))]


def logits_finite(captured_logits: torch.Tensor, positions: list[int]) -> Check:
    """Count of NaN / +inf logits in the capture, naming the positions (and first ids) that have them.

    -inf is a masked id (a model may rule ids out; generate accepts it): counted in the detail
    only. The forward and logits stages record non-finite logits as computed; probs and
    trajectories refuse them, so this check is where such a run is recorded as failed.
    """
    logits, found, masked = captured_logits[0], {}, 0           # [R, V]; row -> (count, first ids)
    for start in range(0, logits.shape[0], 64):     # 64 rows at a time: a bool mask of [R, V] summed in
        chunk = logits[start:start + 64]            # int64 was this stage's largest allocation
        bad = chunk.isnan() | (chunk == float("inf"))
        bad |= ~chunk.isfinite().any(dim=-1, keepdim=True)          # a row masked whole has no distribution
        masked += int((chunk == -float("inf")).count_nonzero())
        for r in bad.any(dim=-1).nonzero().flatten().tolist():
            found[start + r] = (int(bad[r].count_nonzero()), bad[r].nonzero().flatten()[:3].tolist())
    rows = sorted(found)
    shown = rows if len(rows) <= 3 else [rows[0], rows[1], rows[-1]]
    per_row = [f"position {positions[r]}: {found[r][0]} ids (first: {found[r][1]})" for r in shown]
    detail = f"positions {_ranges([positions[r] for r in rows])} ({len(rows)} of {len(positions)}); " + \
        "; ".join(per_row) if rows else f"{logits.numel()} values, none NaN or +inf; {masked} masked (-inf)"
    return Check("logits_finite", "count of NaN / +inf values among the captured logits vs 0 (-inf = a masked id, "
                 "allowed, unless a whole position is)", sum(n for n, _ in found.values()), 0, "error", detail)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def outputs_missing(stage: str) -> Check:
    """A stage whose outputs the checks need did not complete: its checks could not run."""
    return Check(f"{stage}_outputs", f"artifacts/{stage} vs the files its checks read (present?)", math.nan, 0,
                 "error",
                 f"artifacts/{stage} is missing: the {stage} stage did not complete (see logits_finite), "
                 f"so its checks did not run")


def capture_input_ids(tensors: dict, stored_ids: list[int]) -> Check:
    return _ids("capture_input_ids", "input_ids in capture.safetensors vs tokens.parquet ids",
                tensors["input_ids"][0].tolist(), stored_ids)


def logits_file(path: Path, captured_logits: torch.Tensor, positions: list[int]) -> list[Check]:
    """logits.parquet (float32) == the captured logits in every cell; T x V rows, each position once.

    One row group (= one whole position, as written) at a time, against that captured row
    widened alone: memory stays one row (bf16 is exact in float32).
    """
    ref = captured_logits[0]                                        # [R, V], computed dtype
    row_of, seen, n_rows, worst, worst_at, bad = {p: i for i, p in enumerate(positions)}, [], 0, 0.0, "", 0
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["position", "token_id", "logit"])
        pos, ids, val = (t[c].to_numpy() for c in ("position", "token_id", "logit"))
        n_rows, p = n_rows + len(pos), int(pos[0]) if len(pos) else -1
        if p not in row_of or (pos != p).any() or not np.array_equal(ids, np.arange(ref.shape[1])):
            bad += 1
            continue
        seen.append(p)
        want = ref[row_of[p]].float().numpy()
        if (d := max_abs(val, want)) > worst:
            worst, worst_at = d, f"position {p}, first differing id {int(np.argmax(val != want))}"
    bad += len(seen) - len(set(seen)) + len(set(positions) - set(seen))
    return [Check("logits_file_rows", f"logits.parquet rows vs T x V = {ref.numel()} of the capture, one whole "
                  "position per row group, each position once", abs(n_rows - ref.numel()) + bad, 0, "error",
                  f"{n_rows} rows, {bad} bad, repeated or missing positions"),
            Check("logits_file_exact", "logits.parquet float32 vs the logits in capture.safetensors, all cells",
                  worst, 0, "error", worst_at)]


# ---------------------------------------------------------------- recomputations
def lm_head(model, tensors: dict, severity: str) -> list[Check]:
    return [Check("final_norm_recompute", "the model's final norm on the stored last resid_post vs stored "
                  "final_norm_out, all positions", recompute.final_norm_recompute(model, tensors), 0, severity,
                  "max abs diff"),
            Check("lm_head_recompute", "the model's lm_head on stored final_norm_out vs stored logits, all positions",
                  recompute.lm_head_recompute(model, tensors[capture.act_name("final_norm_out")],
                                              tensors[capture.act_name("logits")]), 0, severity, "max abs diff")]


def layer0_attention(model, tensors: dict, severity: str) -> list[Check]:
    return [Check(f"layer0_attention_{k}", f"captured layer-0 attention step {k} vs recomputed (the model's modules "
                  "and HF's eager ops) from the captured step before it", d, 0, severity, "max abs diff")
            for k, d in recompute.layer0_attention_recompute(model, tensors).items()]


def residual_adds(model, tensors: dict) -> list[Check]:
    # An elementwise add rounds the same on every device: an error check wherever it runs. None for
    # a model captured at the residual-stream level (no attn_out / mlp_out to add).
    out = []
    for i in range(len(capture.decoder_layers(model))):
        if not (d := recompute.residual_adds_recompute(model, tensors, i)):
            continue
        sums = " and ".join(f"{k}" for k in d)
        out.append(Check(f"residual_adds_layer{i}", f"layer {i}: captured {sums} vs the family's residual adds "
                         "(resid_pre + attn_out, resid_mid + mlp_out; layer 0's input from embed)",
                         max(d.values()), 0, "error", ", ".join(f"{k} {v:g}" for k, v in d.items())))
    return out


def future_attention(tensors: dict) -> list[Check]:
    return [Check(f"future_attention_layer{i}", f"layer {i}: largest captured attention weight on a future position "
                  "vs 0 (causal)",
                  w, 0, "error", "max over heads and query positions")
            for i, w in sorted(recompute.future_attention_max(tensors).items())]


def fresh_forward(model, tensors: dict, positions: str, severity: str) -> list[Check]:
    """A hook-free forward pass in this process vs the captured logits; a second one only when they differ.

    `capture_transparent`: the first fresh pass vs the capture. `repeat_deterministic`: the
    computation gives the same bits when run again. When the first pass equals the capture bit
    for bit it already has (the forward stage's pass in its process, this one here), and a
    second pass here would prove the same thing again, so none runs. When they differ, a
    second pass here tells a capture (hooks, another process or device) that changed the
    numbers from a computation that does not repeat. The detail says which case applied.
    """
    ids, stored = tensors["input_ids"], tensors[capture.act_name("logits")]
    first = capture.plain_forward_logits(model, ids, positions)
    transparent = max_abs(first, stored)
    if transparent == 0:
        repeat, how = 0.0, "one pass: it equals the stored capture (the forward stage's process) bit for bit"
    else:
        repeat, how = max_abs(capture.plain_forward_logits(model, ids, positions), first), \
            "two passes in this process: the first differs from the stored capture"
    return [Check("capture_transparent", "the captured logits vs a fresh plain forward (no hooks, this process), "
                  "bit for bit", transparent, 0, severity, f"positions={positions}"),
            Check("repeat_deterministic", "a fresh plain forward run again, bit for bit: vs the stored capture "
                  "when they agree, else vs a second pass here", repeat, 0, severity, how)]


# ---------------------------------------------------------------- all of them
def run_all(stored: Stored, model, tokenizer, cfg: dict, device: torch.device, eos_ids: set[int],
            tokenizer_json: Path | None = None) -> list[Check]:
    """Every check, in pipeline order. cfg: the typed sections model, prompt, probs, sampling, checks;
    tokenizer_json: the snapshot's, for the second encoding of the prompt.

    A missing probs or trajectories stage (`Stored.missing`) replaces its checks with one
    failed `<stage>_outputs` check; the others run as usual.
    """
    ids, tensors, m, p_cfg, prompt = stored.token_ids, stored.tensors, cfg["model"], cfg["probs"], cfg["prompt"]
    # Where each compared computation ran: the stored runs, and this process (the checks stage or an audit).
    here, fwd, traj = ("this check", here_record(model, device)), ("forward", stored.devices["forward"]), \
        ("trajectories", stored.devices["trajectories"])
    mode = "all" if len(stored.logit_positions) == len(ids) else "last"
    transparent, repeat = fresh_forward(model, tensors, mode, "error")
    rows = {p: logits_io.read_position(stored.logits, p)
            for p in probs.resolve_positions(p_cfg.positions, len(ids), stored.logit_positions)}
    text, add = tokenization.prompt_for(tokenizer, prompt, m.tokenizer.add_special_tokens)   # as tokenize did
    out = [
        tokenizer_retokenize(tokenizer_json, tokenizer, text, add, ids),
        tokenizer_round_trip(tokenizer, text, ids, prompt.chat),
        tokenizer_bytes(tokenizer, text, stored, prompt.chat),
        *chat_template(tokenizer, prompt, ids),
        *tokenizer_expected_ids(tokenizer, m.tokenizer.family, prompt.expected_ids_for(m.tokenizer.family),
                                text, ids),
        capture_input_ids(tensors, ids),
        logits_finite(tensors[capture.act_name("logits")], stored.logit_positions),
        *logits_file(stored.logits, tensors[capture.act_name("logits")], stored.logit_positions),
        *kernel_bound([*lm_head(model, tensors, "error"), *layer0_attention(model, tensors, "error")], fwd, here),
        *residual_adds(model, tensors),
        *future_attention(tensors),
        *kernel_bound([transparent], fwd, here), repeat,      # repeat: never device-bound (see fresh_forward)
        *tables.fp32_sums(rows, p_cfg.temperatures, p_cfg.fp32_sum_tolerance),
    ]
    if stored.table is None:
        out.append(outputs_missing("probs"))
    else:
        out += [*tables.fp64_tables(stored.table, rows, p_cfg.temperatures),
                *tables.table_columns(stored.table, rows),
                *tables.filtered(stored.filtered, rows, probs.filters(p_cfg, cfg["sampling"]),
                                 lambda f: decode.generate_warpers(model, f.settings))]
        if stored.probs_prompt_metrics is not None:
            path, prompt_id, vocab = stored.probs_prompt_metrics
            out += next_token.check(path, prompt_id, len(ids) - 1, stored.last_row(), p_cfg.temperatures,
                                        probs.filters(p_cfg, cfg["sampling"]), vocab)
    if stored.steps is None:
        return out + [outputs_missing("trajectories")]
    steps, recorded = read_parquet(stored.steps).to_pylist(), read_json(stored.trajectories)
    if stored.step_logits is not None:
        rows = logits_io.read_step_logits(stored.step_logits)
    else:           # not stored (`sampling.step_logits`): re-derived here by the stage's own decoding
        rows, _ = trajectories.rederive_step_logits(model, ids, cfg["sampling"], recorded)
    step_rows = {(k["branch"], k["kv_cache"], k["step"]): row for k, _, row in rows}
    hashes = step_logits_sha256(rows, recorded, "stored" if stored.step_logits else "re-derived", "error")
    own = [*greedy_argmax(steps, step_rows), *what_if_branches(steps, step_rows, cfg["sampling"], eos_ids)]
    if stored.step_logits is None:  # rows decoded here: on another kernel path they may differ and follow
        hashes, own = kernel_bound(hashes, traj, here), kernel_bound(own, traj, here)   # another prefix
    one_row = recompute.lm_head_rows(model, tensors[capture.act_name("final_norm_out")], 1)[0, -1].float().cpu()
    return out + [
        *hashes,
        *kernel_bound(step1_logits(step_rows, one_row.numpy(), stored.last_row(), "error"), traj, here),
        *own,
        *kv_cache(steps, step_rows, cfg["checks"].kv_cache_atol),
        *kernel_bound(generate_parity(model, ids, steps, step_rows, cfg["sampling"], eos_ids, device, "error"),
                      traj, here),
        *kernel_bound(what_if_generate(model, ids, steps, step_rows, cfg["sampling"], eos_ids, "error"), traj, here),
        *(loops(read_parquet(stored.prompt_metrics[0], filters=[("prompt_id", "=", stored.prompt_metrics[1])])
                .to_pylist(), steps) if stored.prompt_metrics else []),
    ]
