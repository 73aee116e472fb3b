"""Gemma 3's text model (`model_type` gemma3_text, Gemma3ForCausalLM) for interop/hf.py: its config.json fields <->
model.* keys, and its four norms a block.

Gemma 3 is the Llama block with: (1 + w) RMSNorms (norm_convention=one_plus; the stored w is the same tensor both
sides), norms after attention and MLP too (post_norms), q/k norms, a GELU-tanh gated MLP, embeddings times
sqrt(d_model), local layers with their own unscaled RoPE base (rope_local_theta) beside global ones with
rope_theta and rope_scaling, and the logits scaled by query_pre_attn_scalar**-0.5 (attention_scale)."""

from __future__ import annotations

from typing import Any

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_fields as F

FAMILY = "gemma3_text"
ARCH = "Gemma3ForCausalLM"
LOCAL, GLOBAL = "sliding_attention", "full_attention"
DEFAULT_THETA = {GLOBAL: 1_000_000.0, LOCAL: 10_000.0}  # Gemma3TextConfig's where config.json leaves them out
# The model keys a Gemma 3 checkpoint fixes (export refuses a model without them)
FIXED = {"norm_convention": "one_plus", "post_norms": True, "qk_norm": True, "mlp_activation": "gelu_tanh",
         "embed_scale": True, "attention_type": "gqa", "moe_experts": 0, "attention_sinks": False}


def model_keys(hf: dict, where: str) -> dict[str, Any]:
  """config.json -> model.* keys; a UserError naming the first field jaxtrain cannot represent."""
  for field, allowed in (("hidden_activation", ("gelu_pytorch_tanh",)), ("attention_bias", (False,)),
                         ("final_logit_softcapping", (None,)), ("attn_logit_softcapping", (None,)),
                         ("use_bidirectional_attention", (False, None))):
    if field in hf and hf[field] not in allowed:
      raise UserError(f"{where}: {field}={hf[field]!r} is not supported for {FAMILY}; allowed: "
                      f"{' or '.join('null' if a is None else repr(a).lower() for a in allowed)}")
  size = lambda field, default=F.REQUIRED: F.get(hf, field, where, "int", default, least=1)  # noqa: E731
  n, E = size("num_hidden_layers"), size("head_dim", 256)
  H = size("num_attention_heads")
  scalar = F.get(hf, "query_pre_attn_scalar", where, "number", 256, least=0)
  if scalar <= 0:
    raise UserError(f"{where}: query_pre_attn_scalar={scalar!r} is not supported; allowed: a number > 0")
  keys: dict[str, Any] = {
      "vocab_size": size("vocab_size"), "d_model": size("hidden_size"), "n_layers": n, "n_heads": H,
      "n_kv_heads": size("num_key_value_heads", H), "head_dim": E, "d_ff": size("intermediate_size"),
      "norm_eps": F.get(hf, "rms_norm_eps", where, "number", 1e-6),
      "tie_embeddings": F.get(hf, "tie_word_embeddings", where, "bool", True),
      "attention_scale": 0.0 if scalar == E else float(scalar) ** -0.5, **FIXED}
  del keys["attention_type"], keys["moe_experts"], keys["attention_sinks"]  # the defaults already
  types = _layer_types(hf, where, n)
  rope = _rope(hf, where)
  keys.update(_global_rope(rope[GLOBAL], where))
  if LOCAL in types:
    keys.update(sliding_window=F.get(hf, "sliding_window", where, "int", 4096, least=1),
                layer_types=_pattern(types))
    keys["rope_local_theta"] = _theta(rope[LOCAL], where)
    if rope[LOCAL].get("rope_type", "default") != "default":
      raise UserError(f"{where}: rope_parameters.{LOCAL}.rope_type={rope[LOCAL]['rope_type']!r} is not supported; "
                      "allowed: default")
  return keys


def _layer_types(hf: dict, where: str, n: int) -> list[str]:
  """Each layer's kind as transformers reads it: layer_types, else every sliding_window_pattern-th layer global."""
  types = F.get(hf, "layer_types", where, "list", None)
  if types is None:
    p = F.get(hf, "sliding_window_pattern", where, "int", 6, least=1)
    types = [LOCAL if (i + 1) % p else GLOBAL for i in range(n)]
  if len(types) != n or any(t not in (LOCAL, GLOBAL) for t in types):
    raise UserError(f"{where}: layer_types={types!r} is not supported; allowed: {n} entries, each one of "
                    f"{GLOBAL}, {LOCAL}")
  return types


def _pattern(types: list[str]) -> str:
  """model.layer_types for the kinds: empty (all local), a:b where the kinds repeat it, else the list."""
  local = [t == LOCAL for t in types]
  if all(local):
    return ""
  for period in range(1, len(local) + 1):
    a = sum(local[:period])
    if local[:a] == [True] * a and all(x == (i % period < a) for i, x in enumerate(local)):
      return f"{a}:{period - a}"
  return ",".join("local" if x else "global" for x in local)


def _rope(hf: dict, where: str) -> dict[str, dict]:
  """{layer kind: its rope dict} as Gemma3TextConfig builds them: rope_parameters by kind, the old rope_scaling
  onto the global one, rope_theta and rope_local_base_freq where the dicts lack a base."""
  given = hf.get("rope_parameters") or {}
  if not isinstance(given, dict) or (given and not set(given) <= {LOCAL, GLOBAL}):
    raise UserError(f"{where}: rope_parameters={given!r} is not supported; allowed: a dict per layer kind "
                    f"({GLOBAL}, {LOCAL})")
  out = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in (GLOBAL, LOCAL)}
  if isinstance(hf.get("rope_scaling"), dict):
    out[GLOBAL].update(hf["rope_scaling"])
  out[GLOBAL].setdefault("rope_theta", hf.get("rope_theta", DEFAULT_THETA[GLOBAL]))
  out[LOCAL].setdefault("rope_theta", hf.get("rope_local_base_freq", DEFAULT_THETA[LOCAL]))
  return out


def _theta(rope: dict, where: str) -> float:
  v = rope.get("rope_theta")
  if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1:
    raise UserError(f"{where}: rope_theta={v!r} is not supported; allowed: a number >= 1")
  return float(v)


def _global_rope(rope: dict, where: str) -> dict[str, Any]:
  """The global layers' RoPE: default, or linear (every frequency / factor), as Gemma 3's 4B-27B."""
  kind = rope.get("rope_type", rope.get("type", "default"))
  keys: dict[str, Any] = {"rope_theta": _theta(rope, where)}
  if kind == "default":
    return keys
  if kind != "linear":
    raise UserError(f"{where}: rope type {kind!r} is not supported for {FAMILY}; allowed: default, linear")
  factor = rope.get("factor")
  if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
    raise UserError(f"{where}: factor={factor!r} is not supported; allowed: a number >= 1")
  return {**keys, "rope_scaling": "linear", "rope_factor": float(factor)}


def is_gemma(m) -> bool:
  """Whether a model exports as Gemma 3: its post-sublayer norms say so (no other family has them)."""
  return m.post_norms


def hf_config(cfg, out: dict) -> dict:
  """Fills the exported config.json `out` (the kept fields of the imported one) for gemma3_text."""
  m = cfg.model
  for k, v in FIXED.items():
    if getattr(m, k) != v:
      raise UserError(f"model.{k}={getattr(m, k)!r}: a {FAMILY} checkpoint (model.post_norms=true) cannot hold it; "
                      f"only {v!r} exports")
  if m.rope_scaling not in ("none", "linear"):
    raise UserError(f"model.rope_scaling={m.rope_scaling!r}: a {FAMILY} checkpoint takes none or linear")
  full = {"rope_type": "default" if m.rope_scaling == "none" else "linear", "rope_theta": m.rope_theta}
  if m.rope_scaling == "linear":
    full["factor"] = m.rope_factor
  local = {"rope_type": "default", "rope_theta": m.rope_local_theta} if m.rope_local_theta else dict(full)
  scalar = m.head_dim if not m.attention_scale else m.attention_scale ** -2
  scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar
  out.update(
      architectures=[ARCH], model_type=FAMILY, vocab_size=m.vocab_size, hidden_size=m.d_model,
      intermediate_size=m.d_ff, num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
      num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_activation="gelu_pytorch_tanh",
      rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, attention_bias=False,
      query_pre_attn_scalar=scalar, final_logit_softcapping=None, attn_logit_softcapping=None,
      sliding_window=m.sliding_window or out.get("sliding_window") or 4096,
      layer_types=[LOCAL if w else GLOBAL for w in m.layer_windows()],
      rope_parameters={GLOBAL: full, LOCAL: local})
  out.setdefault("max_position_embeddings", max(8192, cfg.train.seq_len))
  for k in ("rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern", "hidden_act"):
    out.pop(k, None)
  return out


def norm_rows(cfg) -> list[tuple]:
  """A Gemma block's four norms (HF's post_attention_layernorm is the attention's output norm, not the MLP's input
  norm as in Llama): (path inside a block, HF suffix, HF shape, None)."""
  D = cfg.d_model
  return [(("attn_norm", "scale"), "input_layernorm.weight", (D,), None),
          (("attn_post_norm", "scale"), "post_attention_layernorm.weight", (D,), None),
          (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (D,), None),
          (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", (D,), None)]
