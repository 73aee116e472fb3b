"""RoPE between config.json and the model.rope_* keys, for every family interop/hf.py supports: each one's rotary
embedding in `transformers` takes its frequencies and its cos/sin factor from the shared rope functions
(modeling_rope_utils), so default, llama3 and yarn mean the same everywhere. Import reads the fields as
`transformers` 5 does (standardize_rope_params, _compute_llama3_parameters, _compute_yarn_parameters), defaults
included; a variant jaxtrain cannot compute (model/rope.py) is a one-line UserError."""

from __future__ import annotations

import math
import numbers
from typing import Any

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_fields as F

# transformers' defaults where config.json leaves the field out: (default_theta, max_position_embeddings)
DEFAULTS = {"llama": (10000.0, 2048), "mistral": (10000.0, 131072), "mixtral": (1000000.0, 131072),
            "qwen3": (10000.0, 32768), "qwen3_moe": (10000.0, 32768), "deepseek_v3": (10000.0, 4096),
            "gpt_oss": (150000.0, 131072)}
SCALED = ("llama3", "yarn")  # the types with an original context
LAYER_TYPES = ("full_attention", "sliding_attention")  # keys of rope_parameters given per layer type


def parameters(hf: dict, where: str) -> dict[str, Any]:
  """The rope parameters transformers computes with: rope_scaling (the old name) before rope_parameters; rope_theta
  and partial_rotary_factor from the top level where the dict lacks them; a top-level
  original_max_position_embeddings before the dict's, else max_position_embeddings where the dict lacks one."""
  theta, max_position = DEFAULTS[hf["model_type"]]
  max_position = F.get(hf, "max_position_embeddings", where, "int", max_position, least=1)
  layer_types = F.get(hf, "layer_types", where, "list", [])
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if not isinstance(rope, dict) or any(k in LAYER_TYPES or k in layer_types for k in rope):
    raise UserError(f"{where}: rope_parameters={rope!r} is not supported; allowed: one dict for every layer")
  rope = dict(rope)
  rope.setdefault("rope_theta", hf.get("rope_theta", theta))
  if hf.get("partial_rotary_factor") is not None:
    rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
  rope.setdefault("rope_type", rope.get("type", "default"))
  if rope["rope_type"] in SCALED:
    if "original_max_position_embeddings" in hf:
      rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings", max_position)
    if rope["rope_type"] == "yarn" and "factor" in rope and rope["factor"] is None:  # the context's extension
      original = _number(rope, "original_max_position_embeddings", where, "an integer >= 1", 1)
      rope["factor"] = max_position / original
  return rope


def _number(rope: dict, field: str, where: str, allowed: str, least: float = 0.0, open_min: bool = False) -> float:
  v = rope.get(field)
  ok = (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        and (v > least if open_min else v >= least))
  if field not in rope:
    raise UserError(f"{where}: {rope['rope_type']} rope needs a numeric {field}")
  if not ok:
    raise UserError(f"{where}: {field}={v!r} is not supported; allowed: {allowed}")
  return float(v)


def model_keys(rope: dict, where: str) -> dict[str, Any]:
  """`parameters` -> model.rope_* keys."""
  kind = rope["rope_type"]
  keys: dict[str, Any] = {"rope_theta": _number(rope, "rope_theta", where, "a number >= 1", 1.0)}
  if kind == "default":
    return keys
  if kind not in SCALED:
    raise UserError(f"{where}: rope type {kind!r} is not supported; allowed: default, llama3, yarn")
  if rope.get("partial_rotary_factor", 1) != 1:  # its frequencies would cover part of the head
    raise UserError(f"{where}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported; allowed: 1")
  original = _number(rope, "original_max_position_embeddings", where, "an integer >= 1", 1)
  if original != int(original):
    raise UserError(f"{where}: original_max_position_embeddings={original!r} is not supported; allowed: an integer")
  keys.update(rope_scaling=kind, rope_factor=_number(rope, "factor", where, "a number >= 1", 1.0),
              rope_original_max_position=int(original))
  if kind == "llama3":
    keys.update(rope_low_freq_factor=_number(rope, "low_freq_factor", where, "a number >= 0"),
                rope_high_freq_factor=_number(rope, "high_freq_factor", where, "a number >= 0"))
    return keys
  return {**keys, **_yarn_keys(rope, where)}


def _yarn_keys(rope: dict, where: str) -> dict[str, Any]:
  """_compute_yarn_parameters: betas 0 or absent are 32 and 1; mscale counts only with mscale_all_dim."""
  truncate = rope.get("truncate", True)
  if not isinstance(truncate, bool):
    raise UserError(f"{where}: truncate={truncate!r} is not supported; allowed: true or false (or left out)")
  if rope.get("attention_factor") is not None:  # jaxtrain derives the cos/sin factor from factor and the mscales
    raise UserError(f"{where}: attention_factor={rope['attention_factor']!r} is not supported; allowed: null (or "
                    "left out: derived from factor, mscale, mscale_all_dim)")
  out: dict[str, Any] = {"rope_truncate": truncate}
  for field, key, default in (("beta_fast", "rope_beta_fast", 32.0), ("beta_slow", "rope_beta_slow", 1.0),
                              ("mscale", "rope_mscale", 0.0), ("mscale_all_dim", "rope_mscale_all_dim", 0.0)):
    given = rope.get(field) is not None and rope[field] != 0
    out[key] = _number(rope, field, where, "a number > 0", 0.0, True) if given else default
  return out


def hf_rope(m) -> dict[str, Any] | None:
  """model.rope_* -> the rope_scaling of config.json (rope_theta beside it), None for plain RoPE."""
  if m.rope_scaling == "none":
    return None
  out: dict[str, Any] = {"rope_type": m.rope_scaling, "factor": m.rope_factor,
                         "original_max_position_embeddings": m.rope_original_max_position}
  if m.rope_scaling == "llama3":
    return {**out, "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor}
  out.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, **({} if m.rope_truncate else {"truncate": False}))
  return {**out, **{k: v for k, v in (("mscale", m.rope_mscale), ("mscale_all_dim", m.rope_mscale_all_dim)) if v}}
