"""GPT-OSS (`model_type` gpt_oss) for interop/hf.py: its config.json fields <-> model.* keys and the tensor rows of
its block.

GPT-OSS fuses each layer's experts into 3-D tensors stored (in, out): gate_up_proj (X, D, 2F) with gate and up
interleaved along the last axis (gate at the even columns, up at the odd), its bias (X, 2F) likewise; down_proj
(X, F, D) and its bias as ours. Our w_gate/w_up are each one half of that tensor (`Tensor.fused`).

The released checkpoints store the experts' matrices in MXFP4 (OCP microscaling): `<name>_blocks` (X, out, G, 16)
uint8, two 4-bit e2m1 values a byte (low nibble first), and `<name>_scales` (X, out, G) uint8, one e8m0 exponent
(2^(s - 127)) shared by each block of 32 values along the input. Import dequantizes them exactly (every value is
a float32) into the (X, in, out) tensor `transformers` computes with."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_fields as F, hf_rope

ALPHA, LIMIT = 1.702, 7.0  # GptOssConfig's defaults


def model_keys(hf: dict, where: str) -> dict[str, Any]:
  """The gpt_oss fields beyond the Llama ones: biased attention and experts, sinks, the clamped SwiGLU, every layer
  MoE (HF never drops tokens), its windows (alternating unless layer_types says otherwise)."""
  quant = hf.get("quantization_config")
  method = quant.get("quant_method") if isinstance(quant, dict) else quant
  if quant and method != "mxfp4":
    raise UserError(f"{where}: quantization_config.quant_method={method!r} is not supported; allowed: mxfp4 (the "
                    "experts dequantized on import) or none")
  if hf_rope.parameters(hf, where)["rope_type"] == "llama3":
    raise UserError(f"{where}: rope type 'llama3' is not supported for gpt_oss; allowed: default, yarn")
  int_ = lambda field, default=F.REQUIRED: F.get(hf, field, where, "int", default, least=1)  # noqa: E731
  num = lambda field, default: F.get(hf, field, where, "number", default, least=0.0)  # noqa: E731
  return {"attention_bias": F.get(hf, "attention_bias", where, "bool", True), "attention_sinks": True,
          "moe_experts": int_("num_local_experts", 128), "moe_top_k": int_("num_experts_per_tok", 4), "moe_every": 1,
          "moe_bias": True, "mlp_activation": "swiglu_clamped", "swiglu_alpha": num("swiglu_alpha", ALPHA),
          "swiglu_limit": num("swiglu_limit", LIMIT), "moe_dropless": True, "moe_capacity_factor": 0.0,
          "moe_aux_convention": "hf", "moe_aux_weight": num("router_aux_loss_coef", 0.001), "moe_z_weight": 0.0}


MXFP4 = "MXFP4"  # the dtype tag of a dequantized tensor in the headers
E2M1 = np.array([s * (m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))  # sign, 2 exponent bits (bias 1), 1 mantissa
                 for s in (1, -1) for e in range(4) for m in range(2)], np.float32)


def dequantize(blocks, scales) -> np.ndarray:
  """MXFP4 (blocks (..., R, G, 16) uint8, scales (..., R, G) uint8) -> float32 (..., G * 32, R): input-major, as
  the unquantized tensor is stored."""
  *lead, R, G, B = blocks.shape
  if tuple(scales.shape) != (*lead, R, G):
    raise UserError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match")
  vals = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1).reshape(*lead, R, G, 2 * B)
  out = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(*lead, R, G * 2 * B)
  return np.ascontiguousarray(np.swapaxes(out, -1, -2))


def unpack_headers(headers: dict) -> dict:
  """The headers with each `<name>_blocks`/`<name>_scales` pair as the one tensor `<name>` they dequantize to (its
  dtype MXFP4: `read` decodes it); a lone half is left, to be refused as unexpected."""
  out = dict(headers)
  for name in [n.removesuffix("_blocks") for n in headers if n.endswith("_blocks")]:
    if f"{name}_scales" in headers:
      f, (*lead, R, G, B), _ = out.pop(f"{name}_blocks")
      out.pop(f"{name}_scales")
      out[name] = (f, (*lead, G * 2 * B, R), MXFP4)
  return out


def read(st, name: str) -> np.ndarray:
  """The dequantized tensor `name` from the open safetensors file `st`."""
  return dequantize(st.get_tensor(f"{name}_blocks"), st.get_tensor(f"{name}_scales"))


def window_types(hf: dict, where: str) -> list[str]:
  """GptOssConfig's layer_types: given, or sliding first then full, alternating."""
  n = F.get(hf, "num_hidden_layers", where, "int", least=1)
  types = F.get(hf, "layer_types", where, "list", None)
  return types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def hf_config(cfg, out: dict) -> dict:
  """Fills the exported config.json `out` (already holding the kept and Llama fields) for gpt_oss."""
  m = cfg.model
  need = (("moe_every", 1), ("moe_first_dense", 0), ("moe_shared_experts", 0), ("moe_router", "softmax"),
          ("moe_norm_top_k", True), ("moe_bias_rate", 0.0), ("moe_routed_scale", 1.0), ("moe_n_group", 1))
  for k, v in need:
    if getattr(m, k) != v:
      raise UserError(f"model.{k}={getattr(m, k)!r}: a gpt_oss checkpoint cannot hold it; only {v!r} exports")
  if m.moe_expert_d_ff not in (0, m.d_ff) or m.qk_norm or m.tie_embeddings or m.rope_scaling == "llama3":
    raise UserError("a gpt_oss checkpoint has experts d_ff wide, no q/k norm, an untied head and default or yarn "
                    "RoPE: model.moe_expert_d_ff, qk_norm, tie_embeddings or rope_scaling cannot export")
  for k in ("rope_scaling", "rope_theta", "mlp_bias", "head_dim", "quantization_config"):  # written unquantized
    out.pop(k, None)
  out.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=m.head_dim,
             attention_bias=m.attention_bias, num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k,
             swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, router_aux_loss_coef=m.moe_aux_weight,
             output_router_logits=False, sliding_window=m.sliding_window or None,
             layer_types=["sliding_attention" if w else "full_attention" for w in m.layer_windows()],
             rope_parameters={**(hf_rope.hf_rope(m) or {"rope_type": "default"}), "rope_theta": m.rope_theta})
  return out


def block_rows(cfg, moe: bool) -> list[tuple]:
  """(path inside a block, HF suffix, HF shape, our shape or None, HF row order or None, fused (start, step) or
  None): GPT-OSS's attention (biases, sinks), norms and fused experts."""
  D, H, K, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  X, Fx = cfg.moe_experts, cfg.moe_expert_d_ff or cfg.d_ff
  if not moe:
    raise UserError("a gpt_oss checkpoint has experts in every layer: model.moe_experts > 0, moe_first_dense=0")
  rows = [(("attn", f"w{p}"), f"self_attn.{p}_proj.weight", hf, ours) for p, hf, ours in (
      ("q", (H * E, D), (D, H, E)), ("k", (K * E, D), (D, K, E)), ("v", (K * E, D), (D, K, E)),
      ("o", (D, H * E), (H, E, D)))]
  if cfg.attention_bias:
    rows += [(("attn", f"b{p}"), f"self_attn.{p}_proj.bias", (n * E,), (n, E))
             for p, n in (("q", H), ("k", K), ("v", K))]
    rows.append((("attn", "bo"), "self_attn.o_proj.bias", (D,), None))
  if cfg.attention_sinks:
    rows.append((("attn", "sinks"), "self_attn.sinks", (H,), None))
  rows += [(("attn_norm", "scale"), "input_layernorm.weight", (D,), None),
           (("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), None),
           (("mlp", "router"), "mlp.router.weight", (X, D), (D, X)),
           (("mlp", "w_gate"), "mlp.experts.gate_up_proj", (X, D, 2 * Fx), None, None, (0, 2)),
           (("mlp", "w_up"), "mlp.experts.gate_up_proj", (X, D, 2 * Fx), None, None, (1, 2)),
           (("mlp", "w_down"), "mlp.experts.down_proj", (X, Fx, D), None)]
  if cfg.moe_bias:
    rows += [(("mlp", "router_logit_bias"), "mlp.router.bias", (X,), None),
             (("mlp", "b_gate"), "mlp.experts.gate_up_proj_bias", (X, 2 * Fx), None, None, (0, 2)),
             (("mlp", "b_up"), "mlp.experts.gate_up_proj_bias", (X, 2 * Fx), None, None, (1, 2)),
             (("mlp", "b_down"), "mlp.experts.down_proj_bias", (X, D), None)]
  return rows
