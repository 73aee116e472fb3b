"""Model FLOPs per token and MFU. One formula, shared by the trainer and (later) inspect.

Training FLOPs per token = 3 x forward (backward costs twice the forward):
  forward matmuls: 2 x (every projection weight: q, k, v, o, gate, up, down, lm_head;
                   for a MoE layer the router and top_k experts' gate/up/down)
  forward attention: 2 x 2 x seq_len x n_heads x head_dim per layer (QK^T and PV),
                     halved because causal masking skips the upper triangle.
The embedding lookup is a gather, not a matmul, and is excluded. MFU counts every
position of the batch (padding too: the device computes it) against the peak.
"""

from __future__ import annotations

from jaxtrain.config import ModelConfig

# Peak dense bf16 FLOP/s per device (no sparsity), by substring of jax's device_kind.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,   # SXM; the PCIe card is lower (756e12) and reports "H100 PCIe"
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def matmul_params(m: ModelConfig) -> int:
  """Weights that take part in a matmul per token (everything but norms and the lookup)."""
  attn = m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
  mlp = 3 * m.d_model * m.d_ff
  # A MoE layer runs top_k experts per token, plus the router.
  n_moe = sum((i + 1) % m.moe_every == 0 for i in range(m.n_layers)) if m.moe_experts else 0
  moe_extra = (m.moe_top_k - 1) * mlp + m.d_model * m.moe_experts
  return m.n_layers * (attn + mlp) + n_moe * moe_extra + m.d_model * m.vocab_size


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
  forward = 2 * matmul_params(m) + m.n_layers * 2 * 2 * seq_len * m.n_heads * m.head_dim / 2
  return 3 * forward


def peak_flops(device_kind: str) -> float | None:
  """Longest table key contained in the device kind; None where unknown (e.g. CPU)."""
  hits = [k for k in PEAK_BF16_FLOPS if k.lower() in device_kind.lower()]
  return PEAK_BF16_FLOPS[max(hits, key=len)] if hits else None
