"""One-shot GPU check (`make gpu-check`): the whole record on tiny_qwen2 on a GPU, against the CPU.

    python -m bench.gpu_check                 # the first GPU, then the same on the CPU, compared
    python -m bench.gpu_check --device cpu    # CPU only (what CI runs, so the script cannot rot)

Needs only torch, transformers, tokenizers, safetensors, numpy, pyarrow and pandas (and what
transformers itself imports): no Hydra, omegaconf, DVC, pydantic, psutil, accelerate or PyYAML,
no network, no tokenizer and no prepared artifacts, from a plain checkout. It builds
tiny_qwen2 from its seed (conf/model/tiny.yaml, tiny_qwen2's base, read by `read_conf`, a reader of
the small YAML subset conf/ uses), saves it as the pipeline's prepare_model does and loads it with
the pipeline's loader, feeds the article's 25 token ids (conf/prompt), and runs the library
code the stages run: the capture, the layer-0 and LM-head recomputes, the residual adds, the
plain forwards (transparent, repeatable), the FP64 table, both branches with and without the
KV cache, and `generate` parity; then prints every figure, the bf16 KV-cache vs full-prefix
max |logit diff| per step, each device's times, and what differs between the GPU and the CPU.
With two GPUs or more it also splits the model over two and checks the capture is unchanged.

Runtime: seconds on a GPU (tiny model); `--max-seconds` (default 420) stops it in any case.
Exit status: 0 when everything ran, whatever the numbers (a numerical finding is printed as
FINDING, never an exit status); 1 on a pipeline error or timeout, with the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pipeline.checks import recompute
from pipeline.checks.verdicts import max_abs
from pipeline.model import capture, decode, loader, memory, tiny
from pipeline.numerics import sampling

REPO = Path(__file__).resolve().parents[1]
CONF = {"model": REPO / "conf/model/tiny.yaml", "prompt": REPO / "conf/prompt/temperature_question.yaml",
        "capture": REPO / "conf/capture/default.yaml", "sampling": REPO / "conf/sampling/reference.yaml",
        "checks": REPO / "conf/checks/default.yaml", "probs": REPO / "conf/probs/default.yaml"}
# Qwen2.5 base's <|endoftext|>, which prepare_model makes tiny_qwen2's eos from the tokenizer
# (tests/integration/test_gpu_check.py holds it to the prepared snapshot's).
EOS_ID = 151643
DTYPE = torch.bfloat16


# ---------------------------------------------------------------- conf/ without PyYAML
def read_conf(path: Path) -> dict:
    """The YAML subset conf/ uses: nested mappings by indentation, scalars (int, float, null,
    true/false, plain or double-quoted strings), flow lists of scalars over one or more lines,
    and block lists of scalars or one-line flow mappings. tests/integration/test_gpu_check.py holds it
    to yaml.safe_load on every file read here."""
    root: dict = {}
    stack: list[tuple[int, dict]] = [(-1, root)]
    opened: tuple[dict, str] = (root, "")         # the last key with no value on its line
    lines = iter(path.read_text(encoding="utf-8").splitlines())
    for raw in lines:
        line = _uncomment(raw)
        if not line.strip():
            continue
        indent, text = len(line) - len(line.lstrip()), line.strip()
        if text.startswith("- "):                 # an item of the list under the opened key
            parent, key = opened
            parent[key] = parent[key] if isinstance(parent[key], list) else []
            parent[key].append(_scalar(text[2:].strip()))
            continue
        key, _, value = text.partition(":")
        value = value.strip()
        while value.startswith("[") and value.count("[") > value.count("]"):
            value += " " + _uncomment(next(lines)).strip()
        while stack[-1][0] >= indent:
            stack.pop()
        if value:
            stack[-1][1][key] = _scalar(value)
        else:
            stack[-1][1][key] = {}
            opened = (stack[-1][1], key)
            stack.append((indent, stack[-1][1][key]))
    return root


def _uncomment(line: str) -> str:
    quoted = False
    for i, ch in enumerate(line):
        quoted ^= ch == '"' and (i == 0 or line[i - 1] != "\\")
        if ch == "#" and not quoted and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(v: str):
    if v.startswith("["):
        return [_scalar(x.strip()) for x in v[1:-1].split(",") if x.strip()]
    if v.startswith("{"):
        return {k.strip(): _scalar(x.strip()) for k, _, x in (item.partition(":") for item in v[1:-1].split(","))}
    if v.startswith('"'):
        return json.loads(v)            # YAML's double-quoted escapes, as conf/ uses them, are JSON's
    if v in ("null", "~", "true", "false"):
        return {"null": None, "~": None, "true": True, "false": False}[v]
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def settings() -> dict:
    conf = {name: read_conf(path) for name, path in CONF.items()}
    src, s = conf["model"]["source"], conf["sampling"]
    return {"architecture": src["architecture"], "seed": src["seed"],
            "ids": conf["prompt"]["known"]["expected_token_ids"]["qwen2"],
            "attention_layers": tuple(conf["capture"]["attention_layers"]),
            "temperatures": conf["probs"]["temperatures"], "kv_cache_atol": conf["checks"]["kv_cache_atol"],
            "sum_tolerance": {"FP64": conf["probs"]["fp64_sum_tolerance"], "FP32": conf["probs"]["fp32_sum_tolerance"]},
            "branches": {"sample": sampling.SamplingSettings(s["temperature"], s["top_k"], s["top_p"]),
                         "greedy": sampling.SamplingSettings(0.0, 0, 1.0)},
            "sampling_seed": s["seed"], "max_new_tokens": s["max_new_tokens"]}


def build_snapshot(conf: dict, dest: Path) -> Path:
    """tiny_qwen2 from its seed, saved as prepare_model saves it (float32 safetensors)."""
    tiny.build(conf["architecture"], conf["seed"], EOS_ID).save_pretrained(dest)
    return dest


# ---------------------------------------------------------------- one device
class Clock:
    def __init__(self, device: torch.device):
        self.device, self.times = device, {}

    def __call__(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
        return out


def record(snapshot: Path, device: torch.device, conf: dict, device_map: dict | None = None) -> dict:
    """Everything the stages compute on `device`, and the checks' figures on it."""
    clock, ids = Clock(device), conf["ids"]
    if device_map is None:
        model = clock("load", loader.load_model, snapshot, DTYPE, device, "eager", False)
    else:
        from transformers import AutoModelForCausalLM
        model = clock("load", lambda: AutoModelForCausalLM.from_pretrained(
            snapshot, dtype=DTYPE, attn_implementation="eager", device_map=device_map, local_files_only=True).eval())
    spec = capture.CaptureSpec(attention_layers=conf["attention_layers"], positions="all")
    input_ids = torch.tensor([ids])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tensors = clock("capture", capture.run_capture, model, input_ids, spec)
    out = {"device": loader.device_record(model, device), "tensors": tensors, "figures": {}, "times": clock.times,
           "estimate": memory.estimate(snapshot, DTYPE, len(ids), spec)}
    if device.type == "cuda":
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    fig, logits = out["figures"], tensors["logits"]
    fig["lm_head_recompute"] = clock("recompute", recompute.lm_head_recompute, model, tensors["final_norm_out"],
                                     logits)
    for step, d in clock("recompute", recompute.layer0_attention_recompute, model, tensors).items():
        fig[f"layer0_attention_{step}"] = d
    n_layers = len(capture.decoder_layers(model))
    fig["residual_adds (all layers)"] = max(max(recompute.residual_adds_recompute(model, tensors, i).values())
                                            for i in range(n_layers))
    fig["future_attention (max weight)"] = max(recompute.future_attention_max(tensors).values())
    first = clock("plain forward", capture.plain_forward_logits, model, input_ids, "all")
    second = clock("plain forward", capture.plain_forward_logits, model, input_ids, "all")
    fig["capture_transparent"], fig["repeat_deterministic"] = max_abs(first, logits), max_abs(second, first)
    last = logits[0, -1]
    out["table"] = clock("fp64 table", sampling.probability_table, last, list(conf["temperatures"]))
    one_row = recompute.lm_head_rows(model, tensors["final_norm_out"], 1)[0, -1]   # step 1 is one row, as generate
    runs = {}
    for branch, s in conf["branches"].items():
        for kv in (False, True):
            runs[(branch, kv)] = clock("decode", decode.run_branch, model, ids, s, conf["max_new_tokens"],
                                       conf["sampling_seed"], kv, {EOS_ID})
            fig[f"step1_logits_{branch}{'_kv' if kv else ''}"] = max_abs(runs[(branch, kv)][0].logits, one_row)
    out["runs"] = {k: [s.token_id for s in v] for k, v in runs.items()}
    out["kv_vs_full"] = {b: kv_diffs(runs[(b, False)], runs[(b, True)]) for b in conf["branches"]}
    fig["greedy_tokens_argmax (steps differing)"] = sum(st.token_id != int(torch.argmax(st.logits))
                                                        for kv in (False, True) for st in runs[("greedy", kv)])
    for branch, s in conf["branches"].items():     # as the checks stage: generate with its KV cache
        ref = clock("generate", decode.generate_reference, model, ids, s, conf["max_new_tokens"],
                    conf["sampling_seed"], kv_cache=True, eos_ids={EOS_ID})
        fig[f"generate_parity_{branch} (ids differing)"] = sum(a != b for a, b in zip(ref.ids,
                                                                                       out["runs"][(branch, True)]))
        fig[f"generate_logits_{branch}"] = max(max_abs(st.logits, row) for st, row in zip(runs[(branch, True)],
                                                                                          ref.logits))
    return out


def kv_diffs(full: list, cached: list) -> list[float]:
    """max |logit diff| per step, up to and including the first step whose chosen ids differ."""
    diffs = []
    for a, b in zip(full, cached):
        diffs.append(max_abs(a.logits, b.logits))
        if a.token_id != b.token_id:
            break
    return diffs


# ---------------------------------------------------------------- printing
def environment(device: torch.device) -> list[str]:
    import transformers
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"CUDA {torch.version.cuda}, cuDNN {cudnn}"]
    for i in range(loader.gpu_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
                     f"{torch.cuda.mem_get_info(i)[0] / 2**30:.1f} GiB free")
    lines.append("determinism flags as found (this script sets none): " + ", ".join(
        f"{k}={v}" for k, v in determinism_flags().items()))
    return lines


def determinism_flags() -> dict:
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    probes = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled,
        "cudnn.deterministic": lambda: c.deterministic, "cudnn.benchmark": lambda: c.benchmark,
        "cudnn.allow_tf32": lambda: c.allow_tf32, "matmul.allow_tf32": lambda: m.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction": lambda: m.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": lambda: m.allow_fp16_reduced_precision_reduction,
        "preferred_blas_library": lambda: str(torch.backends.cuda.preferred_blas_library()).split(".")[-1],
        "float32_matmul_precision": torch.get_float32_matmul_precision,
        "CUBLAS_WORKSPACE_CONFIG": lambda: os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch_threads": torch.get_num_threads,
    }
    out = {}
    for name, probe in probes.items():
        try:
            out[name] = probe()
        except (AttributeError, RuntimeError) as e:     # a flag this torch does not have
            out[name] = f"n/a ({type(e).__name__})"
    return out


def report(run: dict, conf: dict) -> list[str]:
    dev, fig = run["device"], run["figures"]
    lines = [f"== {dev['device']}" + (f" ({dev['gpu_name']})" if dev["gpu_name"] else "")]
    est = run["estimate"]
    mem = f"memory guard estimate on this device {est.on_device(torch.device(dev['device'])) / 2**20:.1f} MiB"
    if "peak_gpu_bytes" in run:
        mem += f", measured peak GPU allocation {run['peak_gpu_bytes'] / 2**20:.1f} MiB"
    lines.append(f"capture: {len(run['tensors'])} tensors, {sum(t.nbytes for t in run['tensors'].values()) / 2**20:.1f}"
                 f" MiB (estimated {est.captured / 2**20:.1f} MiB); {mem}")
    lines.append("checks stage figures (exact checks: tolerance 0; a nonzero value here is a FINDING):")
    for name, value in fig.items():
        rng = name.startswith("generate_parity_sample") and dev["device"] != "cpu"
        note = "  (a report here: on CUDA generate draws from the device RNG)" if rng else "  FINDING"
        lines.append(f"  {name:44s} {value:<12g}{note if value else ''}")
    t = run["table"]
    top = torch.argsort(run["tensors"]["logits"][0, -1].float(), descending=True, stable=True)[:3].tolist()
    lines.append(f"FP64 table at the last position, top ids {top}:")
    for temp, tab in t.items():
        over = [f"{k} > {tol:g}" for k, err, tol in (("FP64", tab.sum_err64, conf["sum_tolerance"]["FP64"]),
                                                     ("FP32", tab.sum_err32, conf["sum_tolerance"]["FP32"]))
                if not err <= tol]
        lines.append(f"  T={temp:g}: p64 {[f'{tab.p64[i]:.4f}' for i in top]}, |sum-1| FP64 {tab.sum_err64:.3g}, "
                     f"FP32 {tab.sum_err32:.3g}" + (f"  FINDING ({', '.join(over)}; FP32 is a report check)"
                                                    if over else ""))
    lines.append(f"branches ({conf['max_new_tokens']} new tokens, seed {conf['sampling_seed']}):")
    for (branch, kv), got in run["runs"].items():
        lines.append(f"  {branch:6s} {'kv cache   ' if kv else 'full prefix'} ids {got}")
    atol = conf["kv_cache_atol"]
    for branch, diffs in run["kv_vs_full"].items():
        worst = max(diffs, default=0.0)
        lines.append(f"  KV cache vs full prefix, {branch}: max |logit diff| per step {[f'{d:g}' for d in diffs]}"
                     + (f"  FINDING (report check: > kv_cache_atol {atol:g})" if worst > atol else ""))
    lines.append("times: " + ", ".join(f"{k} {v:.3f} s" for k, v in run["times"].items())
                 + f"; total {sum(run['times'].values()):.2f} s")
    return lines


def compare(gpu: dict, cpu: dict) -> list[str]:
    """What differs between the GPU and the CPU run: reports in the pipeline (other kernels), never errors."""
    lines = [f"== {gpu['device']['device']} vs cpu (other kernels: the pipeline compares these as reports)"]
    worst = sorted(((max_abs(gpu["tensors"][k], cpu["tensors"][k]), k) for k in gpu["tensors"]), reverse=True)
    lines.append("captured tensors, max |GPU - CPU|: " + ", ".join(f"{k} {d:g}" for d, k in worst[:5])
                 + f"; {sum(d == 0 for d, _ in worst)} of {len(worst)} identical")
    for key, ids in gpu["runs"].items():
        same = ids == cpu["runs"][key]
        lines.append(f"  {key[0]} {'kv' if key[1] else 'full'}: ids {'the same' if same else 'DIFFER'} "
                     f"({ids} vs {cpu['runs'][key]})")
    for name in gpu["times"]:
        g, c = gpu["times"][name], cpu["times"].get(name, float("nan"))
        lines.append(f"  time {name:14s} GPU {g:8.3f} s   CPU {c:8.3f} s   CPU/GPU {c / g if g else float('nan'):.1f}x")
    g, c = sum(gpu["times"].values()), sum(cpu["times"].values())
    lines.append(f"  time total          GPU {g:8.3f} s   CPU {c:8.3f} s   CPU/GPU {c / g:.1f}x")
    return lines


def split_check(snapshot: Path, single: dict, conf: dict) -> list[str]:
    """Two GPUs: layer 0 on cuda:0, the rest (rotary included) on cuda:1; the capture must not change."""
    if loader.gpu_count() < 2:
        return [f"== split over 2 GPUs: skipped ({loader.gpu_count()} GPU here)"]
    if importlib.util.find_spec("accelerate") is None:
        return ["== split over 2 GPUs: skipped (accelerate, which places modules on devices, is not installed)"]
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                  "model.rotary_emb": 1, "lm_head": 1}
    run = record(snapshot, torch.device("cuda:0"), conf, device_map=device_map)
    diff = max(max_abs(run["tensors"][k], single["tensors"][k]) for k in single["tensors"])
    return [f"== split over cuda:0 and cuda:1: capture vs one GPU max |diff| {diff:g}"
            + ("" if diff == 0 else "  FINDING"), *report(run, conf)[1:]]


def _timeout(signum, frame):
    raise TimeoutError("--max-seconds reached")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU run the GPU is compared with")
    ap.add_argument("--max-seconds", type=int, default=420, help="stop (exit 1) after this long; default 420")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(args.max_seconds)
    try:
        device = loader.resolve_device(args.device, key="--device")
        conf = settings()
        print(f"nexttoken gpu-check: tiny_qwen2 (seed {conf['seed']}) on the article's {len(conf['ids'])} token ids, "
              f"bfloat16, eager attention, {device}")
        print("\n".join(environment(device)))
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            snapshot = build_snapshot(conf, Path(tmp))
            main_run = record(snapshot, device, conf)
            print("\n".join(report(main_run, conf)))
            if device.type == "cuda":
                print("\n".join(split_check(snapshot, main_run, conf)))
                if not args.no_cpu:
                    cpu_run = record(snapshot, torch.device("cpu"), conf)
                    print("\n".join(report(cpu_run, conf)))
                    print("\n".join(compare(main_run, cpu_run)))
    except Exception as e:   # a pipeline error (or the time limit): the only non-zero exit
        traceback.print_exc()
        print(f"gpu-check: pipeline error after {time.perf_counter() - started:.1f} s: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    print(f"gpu-check: finished in {time.perf_counter() - started:.1f} s (findings above are numbers, not errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
