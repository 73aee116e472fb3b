"""DeepSeek-V3 (`model_type` deepseek_v3) for interop/hf.py: its config.json fields <-> model.* keys and the
tensor rows of an MLA block (and of the multi-token-prediction layer checkpoints keep at index num_hidden_layers).

DeepSeek lays each RoPE part out in interleaved pairs (x0, x1), (x2, x3), ...; jaxtrain rotates halves. Import
permutes those weight rows to (x0, x2, ..., x1, x3, ...) (evens, then odds), which makes the half rotation compute
exactly what the interleaved one does; export permutes them back."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_fields as F, hf_rope


def model_keys(hf: dict, where: str) -> dict[str, Any]:
  """The deepseek_v3 fields beyond the Llama ones (HF's router is dropless, sigmoid, bias-corrected)."""
  for field, want in (("rope_interleave", True), ("scoring_func", "sigmoid"),
                      ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
    if field in hf and hf[field] != want:
      raise UserError(f"{where}: {field}={hf[field]!r} is not supported; allowed: {want!r}")
  if hf_rope.parameters(hf, where)["rope_type"] == "llama3":  # export takes none or yarn (HF's softmax mscale)
    raise UserError(f"{where}: rope type 'llama3' is not supported for deepseek_v3; allowed: default, yarn")
  def int_(field, default=F.REQUIRED, least=1):
    return F.get(hf, field, where, "int", default, least)
  rope_dim = int_("qk_rope_head_dim", least=2)
  return {"attention_type": "mla", "q_lora_rank": int_("q_lora_rank", 0, 0), "kv_lora_rank": int_("kv_lora_rank"),
          "qk_nope_head_dim": int_("qk_nope_head_dim"), "qk_rope_head_dim": rope_dim,
          "v_head_dim": int_("v_head_dim"), "n_kv_heads": int_("num_attention_heads"), "head_dim": rope_dim,
          "moe_experts": int_("n_routed_experts"), "moe_top_k": int_("num_experts_per_tok"), "moe_every": 1,
          "moe_first_dense": int_("first_k_dense_replace", 0, 0), "moe_expert_d_ff": int_("moe_intermediate_size"),
          "moe_shared_experts": int_("n_shared_experts", 0, 0), "moe_router": "sigmoid",
          "moe_n_group": int_("n_group", 1), "moe_topk_group": int_("topk_group", 1),
          "moe_routed_scale": F.get(hf, "routed_scaling_factor", where, "number", 1.0),
          "moe_norm_top_k": F.get(hf, "norm_topk_prob", where, "bool", True), "moe_bias_rate": 1e-3,
          "moe_capacity_factor": 0.0, "moe_dropless": True, "moe_aux_weight": 0.0, "moe_z_weight": 0.0}


def hf_config(cfg, out: dict) -> dict:
  """Fills the exported config.json `out` (already holding the kept and Llama fields) for deepseek_v3."""
  m = cfg.model
  if m.moe_experts and (m.moe_every != 1 or m.moe_router != "sigmoid" or m.moe_bias_rate <= 0):
    raise UserError("a deepseek_v3 checkpoint routes with sigmoid scores and a correction bias in every layer "
                    "from moe_first_dense on: only model.moe_every=1, moe_router=sigmoid, moe_bias_rate>0 export")
  for k in ("num_key_value_heads", "rope_scaling", "num_local_experts", "router_aux_loss_coef", "mlp_bias",
            "sliding_window"):
    out.pop(k, None)
  out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=m.n_heads,
             q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
             qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_rope_head_dim,
             qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim, rope_interleave=True, attention_bias=False,
             num_nextn_predict_layers=m.mtp_layers,
             rope_parameters={**(hf_rope.hf_rope(m) or {"rope_type": "default"}), "rope_theta": m.rope_theta})
  if m.rope_scaling == "llama3":
    raise UserError(f"model.rope_scaling={m.rope_scaling}: a deepseek_v3 checkpoint takes none or yarn")
  if m.moe_experts:
    out.update(n_routed_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, first_k_dense_replace=m.moe_first_dense,
               moe_intermediate_size=m.moe_expert_d_ff or m.d_ff, n_shared_experts=m.moe_shared_experts,
               n_group=m.moe_n_group, topk_group=m.moe_topk_group, routed_scaling_factor=m.moe_routed_scale,
               norm_topk_prob=m.moe_norm_top_k)
  else:  # all dense: every layer before first_k_dense_replace
    out.update(first_k_dense_replace=m.n_layers, n_routed_experts=1, num_experts_per_tok=1)
  return out


def mtp_keys(hf: dict, headers: dict) -> dict[str, Any]:
  """model.mtp_layers=1 where the checkpoint holds the multi-token-prediction layer (index num_hidden_layers)."""
  return {"mtp_layers": 1} if f"model.layers.{hf['num_hidden_layers']}.eh_proj.weight" in headers else {}


def mtp_rows(cfg) -> list[tuple]:
  """The MTP module's rows (as `block_rows`, paths from the model root) under model.layers.{n_layers}; its copies of
  the embedding and output head (embed_tokens, shared_head.head) are the main model's, not stored twice."""
  D = cfg.d_model
  rows = [(("mtp", "enorm", "scale"), "enorm.weight", (D,), None), (("mtp", "hnorm", "scale"), "hnorm.weight", (D,), None),
          (("mtp", "eh_proj"), "eh_proj.weight", (D, 2 * D), (2 * D, D)),
          (("mtp", "head_norm", "scale"), "shared_head.norm.weight", (D,), None)]
  rows += [(("mtp", "block", *p), s, *rest) for p, s, *rest in block_rows(cfg, cfg.is_moe_layer(cfg.n_layers))]
  return [(p, f"model.layers.{cfg.n_layers}.{s}", *rest) for p, s, *rest in rows]


def _deinterleave(n: int) -> np.ndarray:
  return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def rope_rows(total: int, group: int, start: int, R: int) -> np.ndarray:
  """HF row of each of our rows for a weight of `total` rows in groups (heads) of `group` whose rows
  [start, start + R) are a RoPE part."""
  perm = np.arange(total)
  for g in range(0, total, group):
    perm[g + start:g + start + R] = g + start + _deinterleave(R)
  return perm


def block_rows(cfg, moe: bool) -> list[tuple]:
  """(path inside a block, HF suffix ({x}: the expert), HF shape, our shape or None, HF row order or None)."""
  D, H, Q, C = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  N, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  qrows = rope_rows(H * (N + R), N + R, N, R)
  rows = ([(("attn", "wq_a"), "self_attn.q_a_proj.weight", (Q, D), (D, Q)),
           (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", (Q,), None),
           (("attn", "wq_b"), "self_attn.q_b_proj.weight", (H * (N + R), Q), (Q, H, N + R), qrows)] if Q else
          [(("attn", "wq"), "self_attn.q_proj.weight", (H * (N + R), D), (D, H, N + R), qrows)])
  rows += [(("attn", "wkv_a"), "self_attn.kv_a_proj_with_mqa.weight", (C + R, D), (D, C + R),
            rope_rows(C + R, C + R, C, R)),
           (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", (C,), None),
           (("attn", "wkv_b"), "self_attn.kv_b_proj.weight", (H * (N + V), C), (C, H, N + V)),
           (("attn", "wo"), "self_attn.o_proj.weight", (D, H * V), (H, V, D)),
           (("attn_norm", "scale"), "input_layernorm.weight", (D,), None),
           (("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), None)]
  F, X = (cfg.moe_expert_d_ff or cfg.d_ff) if moe else cfg.d_ff, cfg.moe_experts
  mats = lambda F: (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))  # noqa: E731
  if moe:
    rows += [(("mlp", "router"), "mlp.gate.weight", (X, D), (D, X))]
    if cfg.moe_bias_rate > 0:
      rows.append((("mlp", "router_bias"), "mlp.gate.e_score_correction_bias", (X,), None))
    rows += [(("mlp", f"w_{p}"), f"mlp.experts.{{x}}.{p}_proj.weight", s, s[::-1]) for p, s in mats(F)]
    if cfg.moe_shared_experts:
      Fs = cfg.moe_shared_experts * F
      rows += [(("mlp", "shared", f"w_{p}"), f"mlp.shared_experts.{p}_proj.weight", s, s[::-1])
               for p, s in mats(Fs)]
  else:
    rows += [(("mlp", f"w_{p}"), f"mlp.{p}_proj.weight", s, s[::-1]) for p, s in mats(F)]
  return rows
