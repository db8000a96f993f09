"""The one table of model families: where each HF model_type keeps each piece, with no torch import.

`FAMILIES` maps a `config.model_type` to its `ModuleNames` (dotted HF attribute paths and the few
arithmetic facts a recompute needs). Adding a decoder is one entry here; the capture, the
recomputes and the memory estimate read only this table. A model_type that is not in it but
has attention layers gets `GENERIC`: the residual stream per layer (`resid_pre`, `resid_post`),
`final_norm_out` and the logits, its layer internals marked as not captured (`support`).
`support` decides from config.json alone (the validate stage calls it before any stage
runs), so an unsupported model is refused before DVC removes any output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pipeline.errors import UserError


@dataclass(frozen=True)
class ModuleNames:
    """Where one model family keeps each piece (dotted HF attribute paths), and how it adds them.

    None means the family has no such piece: its capture name is left out, and so is the check.
    """

    embed: str = "model.embed_tokens"
    pos_embed: str | None = None                   # learned position embeddings (GPT-2), added to embed
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    rotary: str | None = "model.rotary_emb"
    # Inside a decoder layer.
    ln1: str | None = "input_layernorm"            # None: attention reads the residual itself (OLMo 2)
    attn: str = "self_attn"
    attn_out: str = "self_attn"                    # output (first element) is added to the residual
    resid_mid_reader: str | None = "post_attention_layernorm"  # first module that reads resid_mid
    mlp_out: str = "mlp"
    post_attn_norm: str | None = None              # applied to o_proj output before the add
    # Inside the attention module: separate projections, or one fused projection.
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    qkv_proj: str | None = None                    # fused q/k/v projection (Phi-3, GPT-2, GPT-NeoX)
    o_proj: str = "o_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    # Where the q/k norms act: "bhtd" on [B, heads, T, hd] (Gemma 3), "bthd" on [B, T, heads, hd]
    # before the transpose (Qwen 3), "flat" on the projection output [B, T, heads*hd] (OLMo 2).
    qk_norm_at: str = "bhtd"
    rope_by_layer_type: bool = False               # rotary module takes the layer type (Gemma 3)
    attn_softcap: str | None = None                # attention attribute passed as `softcap`, if any
    final_softcap: str | None = None               # config attribute: final logit softcapping
    softmax_fp32: bool = True                      # eager softmax in float32 then cast back (GPT-2: in dtype)
    # Config attributes of the arithmetic around the residual stream (None: absent).
    parallel_residual: str | None = None           # resid_post = mlp_out + attn_out + resid_pre when true
    residual_multiplier: str | None = None         # resid += out * m (Granite)
    embedding_multiplier: str | None = None        # resid_pre of layer 0 = embed * m (Granite)
    logits_scaling: str | None = None              # logits = lm_head(x) / s (Granite)
    logit_scale: str | None = None                 # logits = lm_head(x) * s (Cohere)
    # The final norm's formula, written out by the lens check (pipeline/checks/lens.py) in numpy:
    # "rms" x / sqrt(mean(x^2) + eps) * w; "rms_plus_one" the same * (1 + w) (Gemma, Qwen 3.5);
    # "layer" (x - mean) / sqrt(var + eps) * w + b. `norm_eps`: the config attribute holding eps.
    norm_formula: str = "rms"
    norm_eps: str = "rms_norm_eps"
    norm_eps_value: float | None = None            # generic: the final norm module's own eps, where config.json
                                                   # has no `norm_eps` (found on the model: `find_generic`)
    head_fp32: bool = False                        # the arithmetic after lm_head in float32 (generic: BEAM's softcap)
    generic: bool = False                          # found by `find_generic`: residual stream only
    notes: tuple[str, ...] = field(default=())

    @property
    def fused(self) -> bool:
        return self.qkv_proj is not None

    def is_parallel(self, config: Any) -> bool:
        return bool(self.parallel_residual and getattr(config, self.parallel_residual, False))


LLAMA_LIKE = ModuleNames()
QWEN3 = ModuleNames(q_norm="q_norm", k_norm="k_norm", qk_norm_at="bthd",
                    notes=("RMSNorm on q and k per head, before the transpose and RoPE",))
GEMMA2 = ModuleNames(
    attn_out="post_attention_layernorm",
    resid_mid_reader="pre_feedforward_layernorm",
    mlp_out="post_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    attn_softcap="attn_logit_softcapping",
    final_softcap="final_logit_softcapping",
    norm_formula="rms_plus_one",
    notes=("attention and final logit softcapping; norms before and after attention and MLP",
           "`embed` includes the scale sqrt(hidden_size)"))
GEMMA3 = replace(
    GEMMA2, q_norm="q_norm", k_norm="k_norm", rope_by_layer_type=True,
    # Gemma3Attention has `attn_logit_softcapping` but does NOT pass it to the attention
    # function (Gemma 2 did), so no attention softcap here.
    attn_softcap=None,
    notes=("q/k RMSNorm per head; RoPE per layer type (local / global); final logit softcapping",
           "`embed` includes the scale sqrt(hidden_size)"))
OLMO2 = ModuleNames(
    ln1=None, attn_out="post_attention_layernorm", post_attn_norm="post_attention_layernorm",
    resid_mid_reader="mlp", mlp_out="post_feedforward_layernorm",
    q_norm="q_norm", k_norm="k_norm", qk_norm_at="flat",
    notes=("norm after attention and after the MLP, none before (no `ln1_out`)",
           "q/k RMSNorm over all heads, before the reshape"))
GRANITE = ModuleNames(
    residual_multiplier="residual_multiplier", embedding_multiplier="embedding_multiplier",
    logits_scaling="logits_scaling",
    notes=("residual adds scaled by residual_multiplier, embeddings by embedding_multiplier, "
           "logits divided by logits_scaling",))
PHI3 = ModuleNames(q_proj=None, k_proj=None, v_proj=None, qkv_proj="qkv_proj",
                   notes=("fused qkv_proj: `attn.qkv` and the attention's `attn.value` instead of attn.q/k/v",))
GPT2 = ModuleNames(
    embed="transformer.wte", pos_embed="transformer.wpe", layers="transformer.h", final_norm="transformer.ln_f",
    rotary=None, ln1="ln_1", attn="attn", attn_out="attn", resid_mid_reader="ln_2", mlp_out="mlp",
    q_proj=None, k_proj=None, v_proj=None, qkv_proj="c_attn", o_proj="c_proj", softmax_fp32=False,
    norm_formula="layer", norm_eps="layer_norm_epsilon",
    notes=("learned position embeddings (`pos_embed`), no RoPE", "fused c_attn: `attn.qkv` and `attn.value`",
           "eager softmax in the compute dtype"))
GPT_NEOX = ModuleNames(
    embed="gpt_neox.embed_in", layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
    rotary="gpt_neox.rotary_emb", attn="attention", attn_out="attention",
    q_proj=None, k_proj=None, v_proj=None, qkv_proj="query_key_value", o_proj="dense",
    parallel_residual="use_parallel_residual", norm_formula="layer", norm_eps="layer_norm_eps",
    notes=("parallel attention and MLP (use_parallel_residual): no `resid_mid`",
           "fused query_key_value: `attn.qkv` and `attn.value`; partial RoPE"))
SMOLLM3 = replace(LLAMA_LIKE, notes=("no RoPE on the layers no_rope_layers marks (NoPE)",))
# Residual stream only: the paths are found on the model (`find_generic`), these are placeholders.
GENERIC = ModuleNames(rotary=None, ln1=None, resid_mid_reader=None, q_proj=None, k_proj=None, v_proj=None,
                      generic=True, notes=("residual stream per layer, final norm output and logits; layer "
                                           "internals (attention weights, attn_out, mlp_out) not captured",))

FAMILIES: dict[str, ModuleNames] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": QWEN3,
    "mixtral": replace(LLAMA_LIKE, notes=("mixture of experts: `mlp_out` is the routed experts' sum",)),
    "qwen3_moe": replace(QWEN3, notes=(*QWEN3.notes, "mixture of experts: `mlp_out` is the routed experts' sum")),
    "gemma": replace(LLAMA_LIKE, norm_formula="rms_plus_one", notes=("`embed` includes the scale sqrt(hidden_size)",)),
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
    "gpt2": GPT2,
    "gpt_neox": GPT_NEOX,
    "olmo2": OLMO2,
    "granite": GRANITE,
    "smollm3": SMOLLM3,
    "starcoder2": replace(LLAMA_LIKE, norm_formula="layer", norm_eps="norm_epsilon",
                          notes=("LayerNorm with bias; q/k/v/o projections with bias",)),
}
# Decoders outside the table whose seeded toys the tests run through the whole chain at the residual-stream
# level: the newest generation (Qwen 3.5: gated attention mixed with linear-attention layers), a LayerNorm
# without bias and a logit scale (Cohere), LayerNorms with bias (StableLM, Falcon). The final norm's form
# and eps, and the head's scale or softcap, are read off the loaded model (capture.find_generic).
# (gemma4_text is refused by `support`: its sizes are per layer.)
GENERIC_TESTED = ("qwen3_5_text", "cohere", "stablelm", "falcon")
# What `model=tiny model.source.family=X` builds (pipeline/model/tiny.py), each proven by the tests.
TINY_FAMILIES = (*FAMILIES, *GENERIC_TESTED)
# Decoders the residual-stream tier cannot capture, each measured on a toy of its own config class
# (tests/integration/test_decoder_zoo.py): refused from config.json, before any stage's outputs are removed.
_NO_FINAL_NORM = ("its layers normalise after each residual add (post-LN) and no final norm follows them, so "
                  "there is no LM-head input to capture as final_norm_out")
REFUSED: dict[str, str] = {
    "bert-generation": _NO_FINAL_NORM,
    "openai-gpt": _NO_FINAL_NORM,
    "trocr": _NO_FINAL_NORM,
    "deepseek_v4": "its residual stream is hc_mult streams mixed between layers (hyper-connections), not one "
                   "[T, hidden] tensor per layer",
    "hy_v4": "its final norm does not read the last layer's output (the toy's final_norm_recompute is inf)",
    "dory": "its final norm (DoryL2Norm) is an L2 normalisation with no weight or eps, neither RMSNorm nor LayerNorm",
    "nanochat": "its final norm is an RMSNorm without a weight, and the lens and LM-head checks read the final "
                "norm's weight",
    "olmo": "its final norm (OlmoLayerNorm) is a LayerNorm without weight or bias, and the lens and LM-head "
            "checks read the final norm's weight",
    "nemotron": "its final norm (NemotronLayerNorm1P) is a LayerNorm scaled by 1 + weight, a form the lens's FP64 "
                "recompute does not write out",
    "hrm_text": "its layers are recurrent stacks run in cycles, not one list of num_hidden_layers decoder layers",
    "longcat_flash": "each of its decoder layers holds two attention and two MLP blocks, so there is no list of "
                     "num_hidden_layers decoder layers",
    "inkling_text": "it divides the final norm's output by logits_mup_width_multiplier before the LM head, so the "
                    "LM head does not read final_norm_out",
    "modernbert-decoder": "a prediction head (dense, activation, norm) sits between the final norm and the output "
                          "embedding, so the LM head does not read final_norm_out",
    "recurrent_gemma": "its forward returns no cache (a CausalLMOutput), and the trajectories' KV-cache path "
                       "extends the model's cache",
    "inkling2_text": "its forward fails in bfloat16 in the pinned transformers (a float32 matmul meets bfloat16)",
    "inkling2_loop_text": "its forward fails in bfloat16 in the pinned transformers (a float32 matmul meets "
                          "bfloat16)",
}
# Decoders with no attention layers at all: nothing to capture as attention, refused up front.
NO_ATTENTION = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")


# The names config.json files give the head and layer counts (transformers' attribute_map aliases).
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "attention_heads", "decoder_attention_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


@dataclass(frozen=True)
class Support:
    """What the capture does for one model_type: "full" (the family table), or "residual" (GENERIC)."""

    model_type: str
    level: str
    names: ModuleNames


def support(config: dict, where: str) -> Support:
    """From a config.json mapping: the family's entry, GENERIC for another attention decoder, or a
    one-line refusal naming the model_type. `where` names the config's file in the message."""
    model_type = config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    if model_type not in FAMILIES and text and text.get("model_type") in FAMILIES:
        model_type = text["model_type"]             # a multimodal wrapper around a known text model
    if not isinstance(model_type, str) or not model_type:
        raise UserError(f"{where} has no model_type: not a transformers model config")
    if model_type in FAMILIES:
        return Support(model_type, "full", FAMILIES[model_type])
    cfg = text or config
    if "per_layer_config" in cfg:
        raise UserError(f"model_type={model_type!r} ({where}) cannot be captured yet: its config sets head_dim and "
                        "other sizes per layer (per_layer_config), and the capture reads them as one value per model "
                        f"(supported: {', '.join(sorted(FAMILIES))}, or any decoder with one head size at the "
                        "residual-stream level)")
    if model_type in REFUSED:
        raise UserError(f"model_type={model_type!r} ({where}) cannot be captured: {REFUSED[model_type]} "
                        f"(supported: {', '.join(sorted(FAMILIES))}, or any decoder with attention layers at the "
                        "residual-stream level)")
    heads = next((cfg[k] for k in _HEADS if cfg.get(k)), None)
    layers = next((cfg[k] for k in _LAYERS if cfg.get(k)), None) or len(cfg.get("layers_block_type") or ())
    if model_type in NO_ATTENTION or not heads or not layers:
        raise UserError(f"model_type={model_type!r} ({where}) cannot be captured: it has no attention layers "
                        f"(supported: {', '.join(sorted(FAMILIES))}, or any decoder with attention layers at the "
                        "residual-stream level)")
    return Support(model_type, "residual", GENERIC)


def captured_pieces(names: ModuleNames, parallel: bool = False) -> dict[str, bool]:
    """Which optional pieces of the naming scheme this family's capture has (facts.json, the README)."""
    full = not names.generic
    return {"pos_embed": names.pos_embed is not None, "ln1_out": full and names.ln1 is not None,
            "attn.q/k/v": full and not names.fused and names.q_proj is not None,
            "attn.qkv (fused)": full and names.fused, "q/k norm": full and names.q_norm is not None,
            "attn_out": full, "resid_mid": full and not parallel, "mlp_out": full,
            "attn_weights": full, "final_softcap": names.final_softcap is not None}


_TABLE_PIECES = ("pos_embed", "ln1_out", "attn.q/k/v", "attn.qkv (fused)", "q/k norm", "resid_mid", "attn_weights",
                 "final_softcap")


def markdown_table() -> str:
    """The family table of docs/models.md, made from `FAMILIES` (a test keeps the page in step)."""
    def row(model_type: str, names: ModuleNames, level: str) -> str:
        pieces = captured_pieces(names, parallel=names.parallel_residual is not None)
        return (f"| `{model_type}` | {level} | " + " | ".join("yes" if pieces[c] else "-" for c in _TABLE_PIECES)
                + " | " + "; ".join(names.notes) + " |")
    head = ["| model_type | capture | " + " | ".join(_TABLE_PIECES) + " | notes |",
            "|---|---|" + "---|" * len(_TABLE_PIECES) + "---|"]
    return "\n".join([*head, *(row(t, n, "full") for t, n in FAMILIES.items()),
                      *(row(t, GENERIC, "residual") for t in GENERIC_TESTED)]) + "\n"
