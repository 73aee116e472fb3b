"""The tensor table: the one name and layout map between jaxtrain's parameters and a Hugging Face
checkpoint's tensors, which import (hf.py) and export (hf_export.py) share."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_deepseek, hf_gemma3, hf_gptoss
from jaxtrain.interop.hf_keys import family

@dataclasses.dataclass
class Tensor:
  """One jaxtrain parameter and its HF tensors: `names` has the parameter's stacked dimensions
  (scanned layers, experts) as its shape. HF stores (out, in); ours is (in, out) reshaped to
  `ours` (heads split), or the same array when `ours` is None. Both rotate RoPE halves, so q/k
  need no permutation."""
  path: tuple
  names: np.ndarray  # object array of HF names
  hf_shape: tuple[int, ...]
  ours: tuple[int, ...] | None
  rows: np.ndarray | None = None  # the HF row of each of our rows (MLA's RoPE parts), None: the same order
  # (start, step): ours is the HF tensor's columns start::step of its last axis, which it shares with other
  # parameters (GPT-OSS's interleaved gate_up_proj); `to_hf` gives that part alone, the export interleaves
  fused: tuple[int, int] | None = None

  def to_ours(self, w):
    w = w if self.rows is None else w[self.rows]
    w = w if self.fused is None else w[..., self.fused[0]::self.fused[1]]
    return w if self.ours is None else w.T.reshape(self.ours)

  def to_hf(self, a):
    a = a if self.ours is None else a.reshape(self.hf_shape[::-1]).T
    return a if self.rows is None else a[np.argsort(self.rows)]


def _block(cfg, moe: bool) -> list[tuple]:
  """(path inside a block, HF suffix ({x}: the expert), HF shape, our shape or None)."""
  if cfg.attention_type == "mla":
    return hf_deepseek.block_rows(cfg, moe)
  if family(cfg) == "gpt_oss":
    return hf_gptoss.block_rows(cfg, moe)
  D, H, K, E, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  rows = [(("attn", f"w{p}"), f"self_attn.{p}_proj.weight", hf, ours) for p, hf, ours in (
      ("q", (H * E, D), (D, H, E)), ("k", (K * E, D), (D, K, E)), ("v", (K * E, D), (D, K, E)),
      ("o", (D, H * E), (H, E, D)))]
  rows += hf_gemma3.norm_rows(cfg) if hf_gemma3.is_gemma(cfg) else [
      (("attn_norm", "scale"), "input_layernorm.weight", (D,), None),
      (("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), None)]
  if cfg.qk_norm:
    rows += [(("attn", f"{p}_norm", "scale"), f"self_attn.{p}_norm.weight", (E,), None) for p in "qk"]
  qwen = family(cfg) == "qwen3_moe"  # Qwen3-MoE names its experts like dense MLPs; Mixtral w1/w3/w2
  if moe:
    F = cfg.moe_expert_d_ff or F
    rows.append((("mlp", "router"), "mlp.gate.weight" if qwen else "block_sparse_moe.gate.weight",
                 (cfg.moe_experts, D), (D, cfg.moe_experts)))
  for p, expert, shape in (("gate", "w1", (F, D)), ("up", "w3", (F, D)), ("down", "w2", (D, F))):
    suffix = (f"mlp.experts.{{x}}.{p}_proj.weight" if qwen else f"block_sparse_moe.experts.{{x}}.{expert}.weight"
              ) if moe else f"mlp.{p}_proj.weight"
    rows.append((("mlp", f"w_{p}"), suffix, shape, shape[::-1]))
  return rows


def table(cfg) -> list[Tensor]:
  """Every jaxtrain parameter of `cfg` (a ModelConfig) with its HF tensors, in export order."""
  one = lambda n: np.array(n, dtype=object)  # noqa: E731

  def names(suffix, layers):
    xs = range(cfg.moe_experts) if "{x}" in suffix else None
    per = [[f"model.layers.{i}.{suffix.format(x=x)}" for x in xs] if xs else f"model.layers.{i}.{suffix}"
           for i in layers]
    return one(per if cfg.scan_layers else per[0])

  out = [Tensor(("embed",), one("model.embed_tokens.weight"), (cfg.vocab_size, cfg.d_model), None)]
  if cfg.scan_layers:  # each stack's layers alike (validated): one stacked parameter per block parameter
    out += [Tensor((name, *p), names(s, idx), *rest)
            for name, idx in cfg.stacks().items() for p, s, *rest in _block(cfg, cfg.is_moe_layer(idx.start))]
  else:
    out += [Tensor(("layers", i, *p), names(s, [i]), *rest)
            for i in range(cfg.n_layers) for p, s, *rest in _block(cfg, cfg.is_moe_layer(i))]
  out.append(Tensor(("final_norm", "scale"), one("model.norm.weight"), (cfg.d_model,), None))
  if cfg.mtp_layers:
    out += [Tensor(p, one([name.format(x=x) for x in range(cfg.moe_experts)] if "{x}" in name else name), *rest)
            for p, name, *rest in hf_deepseek.mtp_rows(cfg)]
  if not cfg.tie_embeddings:
    V, D = cfg.vocab_size, cfg.d_model
    out.append(Tensor(("lm_head",), one("lm_head.weight"), (V, D), (D, V)))
  return out


# LoRA: our adapter of weight `w` -> the HF module PEFT targets (its name in adapter_config.json's target_modules)
LORA_MODULES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w_gate": "gate_proj",
                "w_up": "up_proj", "w_down": "down_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj",
                "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj"}


def lora_table(cfg) -> list[Tensor]:
  """Every LoRA adapter of `cfg` (a ModelConfig) as PEFT saves it: A (r, in) and B (out, r) named
  base_model.model.<the base weight's module>.lora_A/B.weight; ours A (*in, r), B (r, *out), B's rows in the
  weight's HF row order (MLA's RoPE parts). MoE experts' adapters are refused: transformers fuses the experts into
  3-D parameters, which a PEFT LoRA on modules cannot address."""
  from jaxtrain.model import lora
  names = cfg.lora_target_names()
  experts = [t for t in names if t in ("gate", "up", "down")] if cfg.moe_experts else []
  if experts:
    raise UserError(f"--adapter with model.lora_targets={cfg.lora_targets!r}: {', '.join(experts)} adapt the MoE "
                    f"experts (model.moe_experts={cfg.moe_experts}), which a PEFT adapter cannot express on "
                    "transformers' fused expert parameters; export merged (without --adapter)")
  targets = {lora.WEIGHTS[t] for t in names}
  out, r = [], cfg.lora_rank
  for t in table(cfg):
    if t.path[-1] not in targets:
      continue
    split = next(i for i in range(len(t.ours) + 1) if math.prod(t.ours[:i]) == t.hf_shape[1])  # input dims
    peft = np.vectorize(lambda n, x: f"base_model.model.{n.removesuffix('.weight')}.lora_{x}.weight", otypes=[object])
    at = (*t.path[:-1], t.path[-1] + lora.SUFFIX)
    out += [Tensor((*at, "lora_a"), peft(t.names, "A"), (r, t.hf_shape[1]), (*t.ours[:split], r)),
            Tensor((*at, "lora_b"), peft(t.names, "B"), (t.hf_shape[0], r), (r, *t.ours[split:]), t.rows)]
  return out
