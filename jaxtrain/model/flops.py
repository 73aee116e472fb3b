"""Model FLOPs per token and MFU. One formula, shared by the trainer, inspect and bench.

Training FLOPs per token = 3 x forward: 2 x every matmul weight a token passes (the
embedding lookup is a gather: excluded) + 2 x 2 x seq_len x n_heads x head_dim per layer
for QK^T and PV, halved by causal masking (a local layer: its window's keys, `attended_keys`). MFU counts
padding too (the device computes it).
"""

from __future__ import annotations

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import mla


def matmul_params(m: ModelConfig) -> int:
  """Weights that take part in a matmul per token (everything but norms and the lookup)."""
  attn = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
  if m.attention_type == "mla":
    attn = mla.attention_matmul_params(m)
  mlp = 3 * m.d_model * m.d_ff
  # A MoE layer runs top_k routed experts and the shared ones per token, plus the router.
  n_moe = m.moe_layers()
  expert = 3 * m.d_model * (m.moe_expert_d_ff or m.d_ff)
  moe = m.d_model * m.moe_experts + (m.moe_top_k + m.moe_shared_experts) * expert
  return m.n_layers * attn + (m.n_layers - n_moe) * mlp + n_moe * moe + m.d_model * m.vocab_size


def attended_keys(seq_len: int, window: int) -> float:
  """Keys a query attends to on average: seq_len / 2 causally; with a sliding window, the window (less its
  triangle at the start of the row)."""
  if not window or window >= seq_len:
    return seq_len / 2
  return window - window * (window - 1) / (2 * seq_len)  # query i sees min(i + 1, window) keys


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
  qk_v = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) if m.attention_type == "mla" else 2 * m.head_dim
  keys = sum(attended_keys(seq_len, w) for w in m.layer_windows())  # local layers count their window only
  forward = 2 * matmul_params(m) + 2 * keys * m.n_heads * qk_v
  return 3 * forward


def fp8_label(mode: str) -> str:
  """How bench and inspect name an FP8 run beside its compute dtype ("" for model.fp8=none)."""
  return "" if mode == "none" else f", FP8 projections (model.fp8={mode})"


FP8_MFU_NOTE = "MFU of an FP8 run keeps the bf16 peak as its denominator (FP8 GEMMs may run up to 2x faster)"
