"""Capture every internal of ONE forward pass of a HF causal LM, by hooks on module paths.

Names follow one TransformerLens-style scheme built by `act_name`; where each family keeps each
piece is the table in `pipeline.model.families` (one entry per model_type). Shapes (batch B = 1,
T positions, H hidden, V = LM-head output size):

    embed                       [1, T, H]   embedding module output (Gemma: already * sqrt(H))
    pos_embed                   [1, T, H]   learned position embeddings (GPT-2 only)
    blocks.{i}.resid_pre        [1, T, H]   input of decoder layer i
    blocks.{i}.attn_out         [1, T, H]   what attention adds to the residual
    blocks.{i}.resid_mid        [1, T, H]   residual after the attention add (absent where attention
                                            and MLP run in parallel: GPT-NeoX)
    blocks.{i}.mlp_out          [1, T, H]   what the MLP adds to the residual
    blocks.{i}.resid_post       [1, T, H]   output of decoder layer i
    blocks.{i}.attn_weights     [1, heads, T, T]   for layer 0 and the configured layers
    final_norm_out              [1, T, H]   LM-head input (all positions, even with positions="last")
    logits                      [1, T or 1, V]     model output (after any final softcapping)

Layer 0 also gets what its attention recompute needs (`ATTN_INTERNALS`): ln1_out [1,T,H] (not
OLMo 2, whose attention reads the residual itself); attn.q / attn.k / attn.v [1,T,heads*hd]
(projection outputs), or attn.qkv where the family fuses them (Phi-3, GPT-2, GPT-NeoX) with
attn.value, the value the attention function got; the q/k norm outputs where the family has
them, at the place it applies them; attn.q_rot / attn.k_rot [1,heads,T,hd] and attn.mask
[1,1,T,T] exactly as passed to the attention function; attn.z [1,T,heads,hd] (its output,
before o_proj). A model_type outside the table gets the residual stream only (`find_generic`):
embed, resid_pre / resid_post per layer, final_norm_out, logits.

Why hooks and not `output_hidden_states`: HF's `hidden_states[-1]` is already after the
final norm. Post-RoPE q/k, the mask and the attention weights are recorded by routing the
model's attention call through a registered attention implementation that calls the very
function eager would have used and records its inputs and outputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pipeline.errors import bad_value
from pipeline.model.families import FAMILIES, GENERIC, ModuleNames, captured_pieces
from pipeline.model.names import ATTN_INTERNALS, GLOBAL_KINDS, LAYER_KINDS, act_name  # noqa: F401 (re-exported)


def family(model: nn.Module) -> ModuleNames:
    """The module-name table for this model: its `config.model_type`'s entry in `FAMILIES`, else
    the residual-stream paths found on the model (`find_generic`)."""
    model_type = model.config.model_type
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    found = getattr(model, "_nexttoken_generic", None)
    if found is None:
        found = find_generic(model)
        object.__setattr__(model, "_nexttoken_generic", found)     # found once per loaded model
    return found


def _path_of(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None) if module is not None else None


_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


def find_generic(model: nn.Module) -> ModuleNames:
    """`GENERIC` with the paths of this model: input embeddings, the decoder layers (the first
    ModuleList of num_hidden_layers modules), the final norm beside them, the output embeddings.
    A model where one is missing is refused in one line naming its model_type."""
    cfg = text_config(model)
    n = getattr(cfg, "num_hidden_layers", None)
    layers = next((name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n), None)

    def found(getter: str) -> str | None:
        get = getattr(model, getter, None)
        return _path_of(model, get()) if get else None
    embed, lm_head = found("get_input_embeddings"), found("get_output_embeddings")
    norm = _final_norm(model, layers, cfg) if layers else None
    missing = [what for what, path in (("decoder layers", layers), ("input embeddings", embed),
                                       ("final norm", norm), ("LM head", lm_head)) if path is None]
    if missing:
        raise bad_value("model_type", model.config.model_type,
                        f"a decoder whose {', '.join(missing)} can be found (supported families: {sorted(FAMILIES)})")
    # The head's arithmetic after lm_head, as the model's forward applies it: the pinned transformers'
    # decoders multiply by the model's `logit_scale` (Cohere), divide by config `logits_scaling` (Granite),
    # or softcap (Gemma); none of them is a module, so they are read off the model and its config.
    softcap = next((a for a in _SOFTCAPS if getattr(cfg, a, None) is not None), None)
    scale = "logit_scale" if isinstance(getattr(model, "logit_scale", None), int | float) else None
    scaling = "logits_scaling" if isinstance(getattr(cfg, "logits_scaling", None), int | float) else None
    formula, eps = final_norm_form(model.get_submodule(norm), model.config.model_type)
    return replace(GENERIC, embed=embed, layers=layers, final_norm=norm, lm_head=lm_head, final_softcap=softcap,
                   logit_scale=scale, logits_scaling=scaling, norm_formula=formula, norm_eps_value=eps,
                   head_fp32=_head_in_fp32(model, lm_head) if softcap or scale or scaling else False)


_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")     # the config attributes HF decoders softcap with


def _head_in_fp32(model: nn.Module, lm_head: str) -> bool:
    """Whether the model does its arithmetic after lm_head in float32 (BEAM's softcap), read off a 1-token
    probe: its logits come out float32 from a head of another dtype."""
    weight = model.get_submodule(lm_head).weight
    if weight.dtype == torch.float32:
        return False
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.get_input_embeddings().weight.device),
                    use_cache=False)
    return out.logits.dtype == torch.float32


_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")       # where torch's and HF's norm modules keep eps


def _final_norm(model: nn.Module, layers: str, cfg) -> str | None:
    """The final norm: a child of the layers' parent, registered after the layers, with an eps attribute and a
    1-d weight of the hidden size (found by what it is, so BioGPT's `layer_norm` and CTRL's `layernorm` need no
    list of names); else one of the usual names beside the layers."""
    parent = layers.rpartition(".")[0]
    children = list(model.get_submodule(parent).named_children())
    after = children[[n for n, _ in children].index(layers.rpartition(".")[2]) + 1:]
    width = getattr(cfg, "hidden_size", None)

    def is_norm(m: nn.Module) -> bool:
        w = getattr(m, "weight", None)
        return (any(isinstance(getattr(m, a, None), int | float) for a in _EPS_ATTRS) and isinstance(w, torch.Tensor)
                and w.ndim == 1 and w.shape[0] == width)
    found = next((name for name, m in after if is_norm(m)), None) or next(
        (k for k in _FINAL_NORMS if isinstance(getattr(model.get_submodule(parent), k, None), nn.Module)), None)
    return f"{parent}.{found}".lstrip(".") if found else None


def final_norm_form(norm: nn.Module, model_type: str) -> tuple[str, float]:
    """The final norm's formula (`ModuleNames.norm_formula`) and eps, read off the module itself: eps from
    its attribute, the formula from its output on a seeded probe (rows with a mean far from 0), the one
    of "rms", "rms_plus_one" and "layer" that its own weights (and bias) give in FP64, so RMSNorm and
    LayerNorm (with or without a bias, under any class name) need no list of config names. A norm that
    matches none is refused in one line."""
    eps = next((float(v) for a in _EPS_ATTRS if isinstance(v := getattr(norm, a, None), int | float)), None)
    weight = getattr(norm, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        raise bad_value("model_type", model_type, "a decoder whose final norm has a 1-d weight and an eps attribute "
                                                  f"({', '.join(_EPS_ATTRS)}); {type(norm).__name__} has not")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.shape[0], generator=generator, dtype=torch.float64) * 2.0 + 1.5
    with torch.inference_mode():
        y = norm(x.to(device=weight.device, dtype=weight.dtype)).double().cpu()
    w, x = weight.detach().double().cpu(), x.to(weight.dtype).double()
    b = getattr(norm, "bias", None)
    b = b.detach().double().cpu() if isinstance(b, torch.Tensor) else 0.0
    centred = x - x.mean(-1, keepdim=True)
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    candidates = {"rms": rms * w, "rms_plus_one": rms * (1.0 + w),
                  "layer": centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps) * w + b}
    error = {k: float((y - c).abs().max() / c.abs().max().clamp_min(1e-30)) for k, c in candidates.items()}
    formula = min(error, key=error.get)
    if not error[formula] < 0.02:       # bf16 rounds to 2**-8 relative; a wrong formula is off by O(1)
        raise bad_value("model_type", model_type, "a decoder whose final norm is an RMSNorm or a LayerNorm "
                                                  f"({type(norm).__name__} matches neither: relative errors "
                                                  + ", ".join(f"{k} {v:.3g}" for k, v in error.items()) + ")")
    return formula, eps


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(family(model).layers)


def text_config(model: nn.Module):
    """The config that holds the decoder's sizes and multipliers (a multimodal wrapper's text part)."""
    get = getattr(model.config, "get_text_config", None)
    return get() if get else model.config


def _layer0_internals(names: ModuleNames) -> list[str]:
    """Layer 0's internals in `ATTN_INTERNALS` order, those this family has (attn_weights apart)."""
    if names.generic:
        return []
    has = {"ln1_out": names.ln1 is not None, "attn.q": not names.fused, "attn.k": not names.fused,
           "attn.v": not names.fused, "attn.qkv": names.fused, "attn.q_norm_out": names.q_norm is not None,
           "attn.k_norm_out": names.k_norm is not None, "attn.value": names.fused}
    return [k for k in ATTN_INTERNALS if has.get(k, True)]


@dataclass(frozen=True)
class CaptureSpec:
    """What to capture beyond the always-captured set (from a validated CaptureConfig). Range
    checks need the model: `resolve_layers`."""

    attention_layers: tuple[int, ...]
    positions: str  # "all" | "last" (logits of every prompt position, or of the last only)

    def resolve_layers(self, num_layers: int) -> tuple[int, ...]:
        """Sorted, non-negative layers whose attention weights are stored (layer 0 always)."""
        resolved = {0}
        for i in self.attention_layers:
            if not -num_layers <= i < num_layers:
                raise bad_value("capture.attention_layers", i,
                                f"integers in [{-num_layers}, {num_layers - 1}] for this model "
                                f"with {num_layers} layers")
            resolved.add(i % num_layers)
        return tuple(sorted(resolved))


def capture_names(model: nn.Module, spec: CaptureSpec) -> list[str]:
    """The exact ordered list of names `run_capture` returns for this model and spec."""
    names = family(model)
    num_layers = len(decoder_layers(model))
    attn_layers = spec.resolve_layers(num_layers)
    parallel = names.is_parallel(text_config(model))
    order = [act_name("embed")] + ([act_name("pos_embed")] if names.pos_embed else [])
    for i in range(num_layers):
        order.append(act_name("resid_pre", i))
        if names.generic:
            order.append(act_name("resid_post", i))
            continue
        if i == 0:
            order += [act_name(k, 0) for k in _layer0_internals(names)]
        elif i in attn_layers:
            order.append(act_name("attn_weights", i))
        order += [act_name(k, i) for k in ("attn_out", "resid_mid", "mlp_out", "resid_post")
                  if not (parallel and k == "resid_mid")]
    return order + [act_name("final_norm_out"), act_name("logits")]


def _copy(t: torch.Tensor) -> torch.Tensor:
    # Made outside inference mode so callers get ordinary tensors (inference tensors refuse
    # in-place edits and use in autograd-tracked code); the dtype is kept, bit-exact.
    with torch.inference_mode(False):
        return t.detach().to(device="cpu", copy=True).contiguous()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _keep(t: torch.Tensor, taken: set[int], copy: bool = False) -> torch.Tensor:
    """t itself (detached) where that is safe to hand out, else a CPU copy (see `_Recorder`)."""
    t = t.detach()
    if copy or t.device.type != "cpu" or t.is_inference() or not t.is_contiguous() or _storage(t) in taken:
        return _copy(t)
    return t


def _first(output):
    return output[0] if isinstance(output, tuple) else output


class _Recorder:
    """Collects tensors by name during one forward pass.

    Keeps the tensor the model computed, not a copy (the pass runs under no_grad, so these
    are ordinary tensors): nothing is held twice, and the logits [1, T, V] (the largest
    tensor by far) are not duplicated. A copy is made only where keeping the tensor itself
    would alias: off the CPU; an inference tensor (the caller's inference_mode); a
    non-contiguous view; storage the model owns (a parameter or buffer); storage already
    recorded under another name (resid_post of layer i IS resid_pre of layer i+1, and
    `embed` the input of layer 0), so every returned tensor owns its storage. In-place work
    after the hook would change a kept tensor: `changed` finds it by the version counters,
    and `run_capture` then records the pass again copying everything, as it happens.
    """

    def __init__(self, attn_layer_of: dict[int, int], attn_layers: tuple[int, ...], base_impl: str,
                 owned: set[int], copy: bool, keep_value: bool = False):
        self.keep_value = keep_value            # a fused projection: the value input is recorded itself
        self.tensors: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.attn_layer_of = attn_layer_of      # id(attention module) -> layer index
        self.attn_layers = attn_layers
        self.base_impl = base_impl
        self.taken = set(owned)                 # storages a kept tensor must not share
        self.copy = copy

    def put(self, name: str, t: torch.Tensor) -> None:
        if name in self.tensors:
            raise RuntimeError(f"{name} captured twice: one forward pass expected")
        t = _keep(t, self.taken, self.copy)
        self.taken.add(_storage(t))
        self.tensors[name] = t
        self.versions[name] = t._version

    def changed(self) -> list[str]:
        """Names whose tensor was modified in place after it was recorded."""
        return [name for name, t in self.tensors.items() if t._version != self.versions[name]]

    def attention(self, module, query, key, value, mask, z, weights) -> None:
        layer = self.attn_layer_of.get(id(module))
        if layer is None:       # the generic tier records no attention internals
            return
        if layer == 0:
            self.put(act_name("attn.q_rot", 0), query)
            self.put(act_name("attn.k_rot", 0), key)
            if self.keep_value:
                self.put(act_name("attn.value", 0), value)
            if mask is not None:
                self.put(act_name("attn.mask", 0), mask)
            self.put(act_name("attn.z", 0), z)
        if layer in self.attn_layers:
            if weights is None:
                raise RuntimeError(f"layer {layer}: the attention function returned no weights")
            self.put(act_name("attn_weights", layer), weights)


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("nexttoken_recorder", default=None)
_RECORDING_IMPL = "nexttoken_recording"


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """Calls exactly what `get_interface(base, eager_attention_forward)` would, and records it."""
    recorder = _ACTIVE.get()
    if recorder is None:
        raise RuntimeError(f"attn_implementation {_RECORDING_IMPL!r} is only valid inside run_capture")
    # The model's forward resolves `eager_attention_forward` from its own modeling file's
    # globals at call time; look it up in the same place (unwrap: forward is decorated).
    eager = inspect.unwrap(type(module).forward).__globals__["eager_attention_forward"]
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(recorder.base_impl, eager)
    z, weights = inner(module, query, key, value, attention_mask, **kwargs)
    recorder.attention(module, query, key, value, attention_mask, z, weights)
    return z, weights


def _configs(model: nn.Module) -> list:
    """Every distinct config object the model's modules read `_attn_implementation` from."""
    seen = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@contextlib.contextmanager
def _recording_attention_impl(model: nn.Module, recorder: _Recorder):
    """Route attention through `_recording_attention`, restoring the implementation afterwards.

    The two registrations stay in transformers' global registries (they have no unregister);
    they are inert: the name is only ever selected here, and only `config` is switched back.
    """
    # Same mask function as the base implementation: an implementation missing from the
    # mask mapping would get NO mask at all.
    AttentionInterface.register(_RECORDING_IMPL, _recording_attention)
    AttentionMaskInterface.register(_RECORDING_IMPL, ALL_MASK_ATTENTION_FUNCTIONS[recorder.base_impl])
    originals = [(cfg, cfg._attn_implementation) for cfg in _configs(model)]
    token = _ACTIVE.set(recorder)
    try:
        for cfg, _ in originals:
            cfg._attn_implementation = _RECORDING_IMPL
        yield
    finally:
        for cfg, impl in originals:
            cfg._attn_implementation = impl
        _ACTIVE.reset(token)


def _hook_plan(model: nn.Module, recorder: _Recorder) -> list[tuple[nn.Module, str, object]]:
    """(module, "pre" | "post", hook fn) for every module-path capture."""
    names = family(model)

    def post(name, pick=_first):
        return lambda module, args, output: recorder.put(name, pick(output))

    def pre(name):
        return lambda module, args, kwargs: recorder.put(name, args[0] if args else kwargs["hidden_states"])

    sub = model.get_submodule
    plan = [(sub(names.embed), "post", post(act_name("embed"))),
            (sub(names.final_norm), "post", post(act_name("final_norm_out")))]
    if names.pos_embed:
        plan.append((sub(names.pos_embed), "post", post(act_name("pos_embed"))))
    parallel = names.is_parallel(text_config(model))
    for i, layer in enumerate(decoder_layers(model)):
        ls = layer.get_submodule
        plan += [(layer, "pre", pre(act_name("resid_pre", i))), (layer, "post", post(act_name("resid_post", i)))]
        if names.generic:
            continue
        plan += [(ls(names.attn_out), "post", post(act_name("attn_out", i))),
                 (ls(names.mlp_out), "post", post(act_name("mlp_out", i)))]
        if not parallel:
            plan.append((ls(names.resid_mid_reader), "pre", pre(act_name("resid_mid", i))))
    if names.generic:
        return plan
    layer0, attn0 = decoder_layers(model)[0], decoder_layers(model)[0].get_submodule(names.attn)
    if names.ln1 is not None:
        plan.append((layer0.get_submodule(names.ln1), "post", post(act_name("ln1_out", 0))))
    for kind, path in layer0_projections(names):
        plan.append((attn0.get_submodule(path), "post", post(act_name(kind, 0))))
    return plan


def layer0_projections(names: ModuleNames) -> list[tuple[str, str]]:
    """(capture kind, module path inside the attention) of layer 0's q/k/v projections (or the
    fused one) and q/k norms, in execution order; each only where the family has it."""
    return [(kind, path) for kind, path in (("attn.q", names.q_proj), ("attn.k", names.k_proj),
                                            ("attn.v", names.v_proj), ("attn.qkv", names.qkv_proj),
                                            ("attn.q_norm_out", names.q_norm),
                                            ("attn.k_norm_out", names.k_norm)) if path is not None]


@contextlib.contextmanager
def _hooks(plan):
    handles = []
    try:
        for module, when, fn in plan:
            if when == "pre":
                handles.append(module.register_forward_pre_hook(fn, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fn))
        yield
    finally:
        for h in handles:
            h.remove()


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: str):
    """The one forward call both the capture and the plain run make (same arguments, same
    grad mode). no_grad, not inference_mode: the outputs are ordinary tensors the caller can
    keep as they are (no copy to escape inference mode); the kernels, hence the bits, are
    the same either way."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    device = model.get_input_embeddings().weight.device
    model.eval()
    # use_cache=False: one prefill pass needs no cache; logits_to_keep=1 computes only the
    # last row of logits (HF slices the LM-head input, the final norm still sees every position).
    with torch.no_grad():
        return model(input_ids=input_ids.to(device), use_cache=False,
                     logits_to_keep=1 if positions == "last" else 0)


def _model_storages(model: nn.Module) -> set[int]:
    return {_storage(t) for t in (*model.parameters(), *model.buffers())}


def plain_forward_logits(model: nn.Module, input_ids: torch.Tensor, positions: str) -> torch.Tensor:
    """Logits of a forward pass with no hooks at all: [1, T or 1, V], CPU, computed dtype."""
    return _keep(_forward(model, input_ids, positions).logits, set())


def run_capture(model: nn.Module, input_ids: torch.Tensor, spec: CaptureSpec) -> dict[str, torch.Tensor]:
    """One forward pass; every activation in `capture_names(model, spec)` order, on CPU.

    Each tensor owns its storage and holds the exact values the model computed at that point
    (see `_Recorder`).
    """
    base_impl = model.config._attn_implementation
    if base_impl != "eager":
        raise bad_value("capture.attn_implementation", base_impl,
                        "eager (attention weights and the layer-0 recompute need it)")
    recorder = _record(model, input_ids, spec, base_impl, copy=False)
    if recorder.changed():          # the model edited a recorded tensor in place: copy as it goes
        recorder = _record(model, input_ids, spec, base_impl, copy=True)
    got, expected = recorder.tensors, capture_names(model, spec)
    if set(got) != set(expected):
        raise RuntimeError(f"capture mismatch: missing {sorted(set(expected) - set(got))}, "
                           f"unexpected {sorted(set(got) - set(expected))}")
    return {name: got[name] for name in expected}


def _record(model: nn.Module, input_ids: torch.Tensor, spec: CaptureSpec, base_impl: str, copy: bool) -> _Recorder:
    names = family(model)
    layers = decoder_layers(model)
    attn_modules = [] if names.generic else [layer.get_submodule(names.attn) for layer in layers]
    recorder = _Recorder({id(m): i for i, m in enumerate(attn_modules)}, spec.resolve_layers(len(layers)),
                         base_impl, _model_storages(model), copy, keep_value=names.fused)
    with _hooks(_hook_plan(model, recorder)), _recording_attention_impl(model, recorder):
        out = _forward(model, input_ids, spec.positions)
    # Logits come from the model output, not an lm_head hook: Gemma softcaps after lm_head.
    recorder.put(act_name("logits"), out.logits)
    return recorder


def model_facts(model: nn.Module, tokenizer_len: int) -> dict:
    """Shape facts the later stages and the manifest need (plain JSON types)."""
    names = family(model)
    cfg = text_config(model)
    embed = model.get_submodule(names.embed)
    lm_head = model.get_submodule(names.lm_head)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if not names.generic:       # the attention module's own figure, where the family table knows it
        attn = decoder_layers(model)[0].get_submodule(names.attn)
        head_dim = getattr(attn, "head_dim", getattr(attn, "head_size", head_dim))
    scale = getattr(embed, "scalar_embed_scale", None)
    parallel = names.is_parallel(cfg)
    facts = {
        "model_type": model.config.model_type,
        # "full": the family table's every piece; "residual": the residual stream only (`families.GENERIC`)
        "capture_level": "residual" if names.generic else "full",
        "captured_pieces": captured_pieces(names, parallel),
        "family_notes": list(names.notes),
        "num_layers": len(decoder_layers(model)),
        "hidden_size": cfg.hidden_size,
        "num_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": int(head_dim),
        "output_size": lm_head.weight.shape[0],
        "tokenizer_len": tokenizer_len,
        "lm_head_weight_shape": list(lm_head.weight.shape),
        "lm_head_has_bias": getattr(lm_head, "bias", None) is not None,
        # The storage actually shared, not just what the config claims.
        "tied_embeddings": lm_head.weight.data_ptr() == embed.weight.data_ptr(),
        "attn_implementation": model.config._attn_implementation,
        "dtype": str(lm_head.weight.dtype).removeprefix("torch."),
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "final_logit_softcapping": getattr(cfg, names.final_softcap) if names.final_softcap else None,
        "embed_scale": None if scale is None else float(scale),
        "embed_scale_note": "none: `embed` is the raw embedding row" if scale is None else (
            f"`embed` already includes the scale sqrt(hidden_size)={scale!r}, applied inside the "
            f"embedding module in the weight dtype (value used: {float(embed.embed_scale.to(embed.weight.dtype))!r})"),
    }
    for key in ("residual_multiplier", "embedding_multiplier", "logits_scaling"):
        if attr := getattr(names, key):
            facts[key] = float(getattr(cfg, attr))
    return facts
