"""Hugging Face checkpoints in (`python -m jaxtrain.hf import`), and the tensor table both directions share
(export: hf_export.py); see docs/huggingface.md.

Import checks every tensor from the file headers before writing anything, then places one
tensor at a time onto its sharding."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.core import files
from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_deepseek, hf_gemma3, hf_gptoss, hf_source, hf_fields as F, hf_rope

SUPPORTED = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text")
QWEN3 = ("qwen3", "qwen3_moe")
INDEX = "model.safetensors.index.json"
HF_KEPT = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
           "vocab.json", "merges.txt")  # the last two: Qwen3's slow-tokenizer files beside tokenizer.json
# non-weights some checkpoints carry (recomputed), and DeepSeek's MTP layer's copies of the shared embedding and head
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embed_tokens.weight", "shared_head.head.weight")
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}
READABLE = ("F32", "BF16", "F16", hf_gptoss.MXFP4)


def safetensors_api():
  try:
    import safetensors
  except ImportError:
    raise UserError("Hugging Face import/export needs the 'safetensors' package: pip install safetensors") from None
  return safetensors


# -- config.json <-> model.* keys -----------------------------------------------------------


def model_keys(hf: dict, where: str) -> dict[str, Any]:
  """config.json -> jaxtrain model.* keys; a UserError naming the first field we cannot represent."""
  mt = hf.get("model_type")
  if mt not in SUPPORTED:
    raise UserError(f"{where}: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
  if mt == hf_gemma3.FAMILY:  # its own fields throughout (rope per layer kind, its activation's name)
    return hf_gemma3.model_keys(hf, where)
  windows = _window_keys(hf, where)
  false = lambda v: v is False  # noqa: E731
  for field, ok, allowed in (("hidden_act", lambda v: v == "silu", "silu"), ("attention_bias", false, "false"),
                             ("mlp_bias", false, "false"), ("attn_logit_softcapping", None, "null")):
    if mt == "gpt_oss" and field == "attention_bias":  # its q/k/v/o biases: model.attention_bias
      continue
    if hf.get(field) is not None and not (ok and ok(hf[field])):
      raise UserError(f"{where}: {field}={hf[field]!r} is not supported; allowed: {allowed}")
  size = lambda field, default=F.REQUIRED: F.get(hf, field, where, "int", default, least=1)  # noqa: E731
  D, H = size("hidden_size"), size("num_attention_heads")
  keys: dict[str, Any] = {
      "vocab_size": size("vocab_size"), "d_model": D, "n_layers": size("num_hidden_layers"), "n_heads": H,
      "n_kv_heads": size("num_key_value_heads", H), "head_dim": size("head_dim", D // H),
      "d_ff": size("intermediate_size"), "norm_eps": F.get(hf, "rms_norm_eps", where, "number", 1e-6),
      "tie_embeddings": F.get(hf, "tie_word_embeddings", where, "bool", False),
      **hf_rope.model_keys(hf_rope.parameters(hf, where), where),  # default, llama3 or yarn RoPE in every family
  }
  if mt == "deepseek_v3":
    keys.update(hf_deepseek.model_keys(hf, where))
  if mt == "gpt_oss":
    keys.update(hf_gptoss.model_keys(hf, where))
  if mt == "mixtral":  # HF Mixtral never drops tokens; router_aux_loss_coef means the same under the hf convention
    keys.update(moe_experts=size("num_local_experts", 8), moe_top_k=size("num_experts_per_tok", 2), moe_every=1,
                moe_dropless=True, moe_aux_convention="hf",
                moe_aux_weight=F.get(hf, "router_aux_loss_coef", where, "number", 0.001, least=0), moe_z_weight=0.0)
  keys.update(_qwen3_keys(hf, where) if mt in QWEN3 else {})
  return {**keys, **windows}


def _window_keys(hf: dict, where: str) -> dict[str, Any]:
  """model.sliding_window and model.layer_types as `transformers` applies them: Mistral and Mixtral window every
  layer; Qwen3 only with use_sliding_window, the layers its layer_types (else max_window_layers on) name, Qwen3-MoE
  every layer then; a layer_types list where a family has one."""
  mt = hf["model_type"]
  if mt == "deepseek_v3" or (mt in QWEN3 and not F.get(hf, "use_sliding_window", where, "bool", False)):
    return {}  # a sliding_window these carry is not applied
  W = F.get(hf, "sliding_window", where, "int", None, least=1)
  if W is None:
    return {}
  if mt == "llama":  # its `transformers` model has no window: the field would be read as something it is not
    raise UserError(f"{where}: sliding_window={W} is not supported for model_type='llama'; allowed: null (a "
                    "windowed Llama-shaped checkpoint is model_type='mistral')")
  n = F.get(hf, "num_hidden_layers", where, "int", least=1)
  types = (F.get(hf, "layer_types", where, "list", None) if mt == "qwen3" else
           hf_gptoss.window_types(hf, where) if mt == "gpt_oss" else None)
  if mt == "qwen3" and types is None:
    first = F.get(hf, "max_window_layers", where, "int", 28, least=0)
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
  types = types or ["sliding_attention"] * n
  allowed = ("full_attention", "sliding_attention")
  if len(types) != n or any(t not in allowed for t in types):
    raise UserError(f"{where}: layer_types={types!r} is not supported; allowed: {n} entries, each one of "
                    f"{', '.join(allowed)}")
  if "sliding_attention" not in types:
    return {}
  local = [t == "sliding_attention" for t in types]
  alternate = local == [i % 2 == 0 for i in range(n)]
  return {"sliding_window": W, "layer_types": "" if all(local) else "alternate" if alternate else
          ",".join("local" if x else "global" for x in local)}


def _qwen3_keys(hf: dict, where: str) -> dict[str, Any]:
  """Qwen3: q/k norms; Qwen3-MoE: fine-grained experts (HF never drops tokens) and which layers are dense."""
  keys: dict[str, Any] = {"qk_norm": True}
  if hf["model_type"] == "qwen3" and not hf.get("head_dim"):
    keys["head_dim"] = 128  # Qwen3Config's default (Qwen3-MoE's attention falls back to d_model / heads, as Llama)
  int_ = lambda field, default, least=1: F.get(hf, field, where, "int", default, least)  # noqa: E731
  X = int_("num_experts", int_("num_local_experts", 128, 0), 0) if hf["model_type"] == "qwen3_moe" else 0
  if not X:
    return keys
  n, step = hf["num_hidden_layers"], int_("decoder_sparse_step", 1)
  dense = sorted(F.get(hf, "mlp_only_layers", where, "ints", [], least=0))
  moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
  # jaxtrain's layer rule (moe_first_dense, moe_every) must give the same MoE layers
  first = next((k for k in range(n + 1) if moe == [i for i in range(k, n) if (i + 1) % step == 0]), None)
  if first is None:
    raise UserError(f"{where}: mlp_only_layers={dense} with decoder_sparse_step={step} is not supported; allowed: "
                    "the first k layers dense (mlp_only_layers=[0, ..., k-1])")
  keys.update(moe_experts=X, moe_top_k=int_("num_experts_per_tok", 8), moe_every=step, moe_first_dense=first,
              moe_expert_d_ff=int_("moe_intermediate_size", 768),
              moe_norm_top_k=F.get(hf, "norm_topk_prob", where, "bool", False),
              moe_dropless=True, moe_aux_convention="hf",
              moe_aux_weight=F.get(hf, "router_aux_loss_coef", where, "number", 0.001, least=0), moe_z_weight=0.0)
  return keys


def family(m) -> str:
  """The Hugging Face model_type a jaxtrain model exports as."""
  if m.attention_type == "mla":
    return "deepseek_v3"
  if m.attention_sinks or m.moe_bias:  # GPT-OSS alone has these
    return "gpt_oss"
  if hf_gemma3.is_gemma(m):
    return hf_gemma3.FAMILY
  if m.qk_norm:
    return "qwen3_moe" if m.moe_experts else "qwen3"
  return "mixtral" if m.moe_experts else "mistral" if m.sliding_window else "llama"


def _check_windows(m, fam: str) -> None:
  """What a family's checkpoint can say of windows and sinks: a per-layer list (dense Qwen3), every layer or none
  (Mistral, Mixtral, Qwen3-MoE); GPT-OSS any per-layer pattern, with sinks and its experts' biases (both always)."""
  if fam == "gpt_oss":
    for k, v in (("attention_sinks", True), ("moe_bias", True), ("mlp_activation", "swiglu_clamped")):
      if getattr(m, k) != v:
        raise UserError(f"model.{k}={getattr(m, k)!r}: a gpt_oss checkpoint always has it {v!r}; only that exports")
    return
  if m.attention_sinks:
    raise UserError(f"model.attention_sinks=true: a {fam} checkpoint has no attention sinks; it cannot export")
  if m.sliding_window and fam not in ("qwen3", hf_gemma3.FAMILY) and not all(m.layer_windows()):
    raise UserError(f"model.layer_types={m.layer_types!r}: a {fam} checkpoint windows every layer or none; only an "
                    "empty model.layer_types (every layer local) exports")


def hf_config(cfg, base: dict, dtype: str, tokenizer=None) -> dict:
  """The exported config.json; fields of `base` (the imported one) that jaxtrain does not model are kept."""
  m = cfg.model
  moe, fam = m.moe_experts > 0 and m.attention_type != "mla", family(m)
  if fam == "mixtral" and m.moe_every != 1:
    raise UserError(f"model.moe_every={m.moe_every}: a Mixtral checkpoint has MoE in every layer; only 1 exports")
  plain = (("moe_shared_experts", 0), ("moe_router", "softmax"), ("moe_bias_rate", 0.))
  if fam == "mixtral":
    plain += (("moe_first_dense", 0), ("moe_norm_top_k", True))
  for k, v in plain:
    if moe and getattr(m, k) != v:
      raise UserError(f"model.{k}={getattr(m, k)!r}: a {fam} checkpoint cannot hold it; only {v!r} exports")
  if fam == "mixtral" and m.moe_expert_d_ff not in (0, m.d_ff):
    raise UserError(f"model.moe_expert_d_ff={m.moe_expert_d_ff}: Mixtral experts are d_ff={m.d_ff} wide; only 0 or "
                    f"{m.d_ff} exports")
  _check_windows(m, fam)
  for k, v in (("mlp_activation", "swiglu"), ("attention_bias", False)):  # GPT-OSS's alone (family: its sinks)
    if fam not in ("gpt_oss", hf_gemma3.FAMILY) and getattr(m, k) != v:
      raise UserError(f"model.{k}={getattr(m, k)!r}: a {fam} checkpoint cannot hold it; only {v!r} exports")
  if fam == hf_gemma3.FAMILY:
    return _with_tokenizer(hf_gemma3.hf_config(cfg, {k: v for k, v in base.items() if k not in (
        "rope_parameters", "torch_dtype", "dtype", "transformers_version")} | {"torch_dtype": dtype}), tokenizer)
  drop = ("rope_parameters", "rope_scaling", "rope_theta", "original_max_position_embeddings", "partial_rotary_factor",
          "torch_dtype", "dtype", "architectures", "model_type", "transformers_version", "sliding_window",
          "num_local_experts", "num_experts", "layer_types")  # the rope fields: hf_rope.hf_rope's alone count
  out = {k: v for k, v in base.items() if k not in drop}
  arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
          "qwen3": "Qwen3ForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM",
          "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}[fam]
  out.update(
      architectures=[arch], model_type=fam,
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
      num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, hidden_act="silu",
      rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, torch_dtype=dtype,
      rope_scaling=hf_rope.hf_rope(m))
  if m.rope_scaling != "none":  # the extended context
    out.setdefault("max_position_embeddings", int(m.rope_original_max_position * m.rope_factor))
  out.setdefault("max_position_embeddings", max(8192, cfg.train.seq_len))
  window = m.sliding_window or None
  if fam == "mixtral":
    out.update(num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, sliding_window=window,
               router_aux_loss_coef=m.moe_aux_weight, output_router_logits=False)
  elif fam in ("llama", "mistral"):
    out.update(attention_bias=False, mlp_bias=False, **({"sliding_window": window} if window else {}))
  elif fam in QWEN3:  # Qwen3 (dense or MoE): its sliding layers by name (dense Qwen3), or every layer
    out.update(attention_bias=False, use_sliding_window=bool(window), sliding_window=window)
    if fam == "qwen3":
      out.update(layer_types=["sliding_attention" if w else "full_attention" for w in m.layer_windows()])
    if moe:
      out.update(num_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, norm_topk_prob=m.moe_norm_top_k,
                 moe_intermediate_size=m.moe_expert_d_ff or m.d_ff, decoder_sparse_step=m.moe_every,
                 mlp_only_layers=list(range(m.moe_first_dense)), router_aux_loss_coef=m.moe_aux_weight,
                 output_router_logits=False)
  elif fam == "gpt_oss":
    out = hf_gptoss.hf_config(cfg, out)
  else:  # DeepSeek-V3: the Llama fields above, then its own
    out = hf_deepseek.hf_config(cfg, out)
  return _with_tokenizer(out, tokenizer)


def _with_tokenizer(out: dict, tokenizer) -> dict:
  """The tokenizer's special ids where the kept config.json does not name them."""
  if tokenizer is not None:
    out.setdefault("eos_token_id", tokenizer.eos_id)
    if tokenizer.bos_id is not None:
      out.setdefault("bos_token_id", tokenizer.bos_id)
  return out


# -- the tensor table: the one name/layout map that import and export share ----------------------


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


# -- import --------------------------------------------------------------------------------------


def _hf_index(t: Tensor, index: tuple) -> tuple | None:
  """The HF (out, in) slices holding our part `index` of one tensor, or None if they are not contiguous ranges.
  Ours is the transpose (in, out) reshaped: each HF dimension is a run of our dimensions merged."""
  if t.rows is not None or t.fused is not None or (t.ours is not None and len(t.hf_shape) < 2):
    return None  # permuted rows, interleaved columns, a vector split into heads: read whole, then cut
  if t.ours is None:
    return index
  n_in, split = t.hf_shape[1], 0
  while math.prod(t.ours[:split]) < n_in:
    split += 1

  def merged(slices, sizes):
    start, count, partial = 0, 1, False
    for s, n in zip(slices, sizes):
      r = range(*s.indices(n))
      if partial and len(r) != n:  # a cut dimension inside a cut one: strided in the file
        return None
      start, count, partial = start * n + r.start, count * len(r), partial or len(r) > 1
    return slice(start, start + count)
  rows, cols = merged(index[split:], t.ours[split:]), merged(index[:split], t.ours[:split])
  return None if rows is None or cols is None else (rows, cols)



def read_headers(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
  """{tensor name: (file, shape, dtype)} from the safetensors headers (no tensor data read)."""
  safetensors = safetensors_api()
  index = hf_dir / INDEX
  if index.is_file():
    try:
      files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
      raise UserError(f"{index}: not a valid safetensors index ({e})") from None
    for f in files:
      if not (hf_dir / f).is_file():
        raise UserError(f"{hf_dir}: shard {f} is missing ({INDEX} names it)")
  else:
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not files:
      raise UserError(f"{hf_dir}: no *.safetensors file (only safetensors weights are read)")
  out = {}
  for f in files:
    try:
      with safetensors.safe_open(str(hf_dir / f), framework="numpy") as st:
        for name in st.keys():
          sl = st.get_slice(name)
          out[name] = (hf_dir / f, tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for damaged files)
      raise UserError(f"{hf_dir / f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
  return out


def own_head(headers: dict) -> bool:
  """Whether the checkpoint's lm_head.weight is a head of its own: present and not equal to the embedding.
  transformers (5.x, PreTrainedModel.tie_weights) ties a tie_word_embeddings=true model's head to its embedding
  only where the checkpoint lacks the head or holds the same values; a different head is kept, untied."""
  if "lm_head.weight" not in headers or "model.embed_tokens.weight" not in headers:
    return False
  (fa, sa, _), (fb, sb, _) = headers["model.embed_tokens.weight"], headers["lm_head.weight"]
  if sa != sb or len(sa) != 2:
    return True
  safe_open = safetensors_api().safe_open
  rows = max(1, 2**24 // max(1, sa[1]))  # 64 MB of float32 per side at a time
  with safe_open(str(fa), framework="numpy") as a, safe_open(str(fb), framework="numpy") as b:
    ea, hb = a.get_slice("model.embed_tokens.weight"), b.get_slice("lm_head.weight")
    for r in range(0, sa[0], rows):  # compared as values (bfloat16 and float16 widen exactly), as torch.equal does
      part = slice(r, min(r + rows, sa[0]))  # safetensors does not clip a slice
      if not np.array_equal(ea[part].astype(np.float32), hb[part].astype(np.float32)):
        return True
  return False


def check_tensors(tensors: list[Tensor], headers: dict, hf_dir: Path, tied: bool, head: bool = False) -> None:
  """Every tensor present with the shape config.json implies; nothing we would silently drop (`head`: the
  checkpoint's lm_head.weight differs from its embedding, so a tied model would drop it)."""
  want = {n: t.hf_shape for t in tensors for n in t.names.flat}
  for name, shape in want.items():
    if name not in headers:
      raise UserError(f"{hf_dir}: tensor {name} is missing")
    _, got, dtype = headers[name]
    if got != shape:
      raise UserError(f"{hf_dir}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")
    if dtype not in READABLE:
      raise UserError(f"{hf_dir}: tensor {name} has dtype {dtype}; readable: {', '.join(READABLE)}")
  if tied and head:
    raise UserError(f"{hf_dir}: lm_head.weight differs from model.embed_tokens.weight; model.tie_embeddings=true "
                    "would drop it (leave tie_embeddings false: the head is imported as its own)")
  for name in headers:
    if name not in want and not name.endswith(IGNORED_SUFFIXES) and not (tied and name == "lm_head.weight"):
      what = "biases are not supported" if name.endswith(".bias") else "not part of a model jaxtrain represents"
      raise UserError(f"{hf_dir}: unexpected tensor {name} ({what})")


def toml_text(sections: dict[str, dict], header: str) -> str:
  def value(v):
    if isinstance(v, bool):
      return "true" if v else "false"
    return repr(v) if isinstance(v, (int, float)) else json.dumps(v)

  lines = [f"# {header}"]
  for section, keys in sections.items():
    if keys:
      lines += ["", f"[{section}]"] + [f"{k} = {value(v)}" for k, v in keys.items()]
  return "\n".join(lines) + "\n"


@dataclasses.dataclass
class ImportPlan:
  """Everything checked before a device starts: the config and where each tensor lies."""
  hf_dir: Path
  workdir: Path
  name: str
  cfg: Any
  toml: str
  headers: dict
  tokenizer: Path | None


def plan_import(hf_dir: str, workdir: str, overrides: list[str], name: str | None = None) -> ImportPlan:
  from jaxtrain.core import config
  from jaxtrain.run import checkpoint
  src, w = Path(hf_dir), Path(workdir)
  if not src.is_dir():
    raise UserError(f"{src} is not a directory (expected a Hugging Face checkpoint directory)")
  try:
    hf = json.loads((src / "config.json").read_text())
  except FileNotFoundError:
    raise UserError(f"{src}: config.json is missing") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{src / 'config.json'}: not valid JSON ({e})") from None
  except OSError as e:
    raise UserError(f"{src / 'config.json'}: cannot be read ({e})") from None
  if not isinstance(hf, dict):
    raise UserError(f"{src / 'config.json'}: must hold a JSON object of fields, not {type(hf).__name__}")
  tok = src / "tokenizer.json"
  headers = read_headers(src)
  model = model_keys(hf, str(src / "config.json"))
  if hf.get("model_type") == "deepseek_v3":
    model.update(hf_deepseek.mtp_keys(hf, headers))
  if hf.get("model_type") == "gpt_oss":  # MXFP4 experts: read dequantized
    headers = hf_gptoss.unpack_headers(headers)
  head = model["tie_embeddings"] and own_head(headers)
  if head:  # as transformers loads it: the checkpoint's own head, untied
    model["tie_embeddings"] = False
    print(f"note: {src / 'config.json'} has tie_word_embeddings=true but lm_head.weight differs from "
          "model.embed_tokens.weight: imported untied, with its own head (as transformers loads it)", file=sys.stderr)
  try:  # the model keys config.json implies, checked before any override
    config.from_dict({"model": model}, where=str(src / "config.json"))
  except UserError as e:
    raise UserError(f"{src / 'config.json'}: {e}") from None
  sections = {"model": model, "optim": {"lr": 1e-5, "warmup_steps": 10},
              "data": {"tokenizer": str(w.absolute() / "tokenizer.json") if tok.is_file() else "byte"}}
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "imported.toml"
    path.write_text(toml_text(sections, ""))
    cfg = config.load(str(path), overrides)
  for item in overrides:  # the written config records the overrides too
    dotted = item.partition("=")[0].strip()
    dotted = config.SWITCHES[dotted][0] if dotted in config.SWITCHES else config.RENAMED.get(dotted, dotted)
    section, _, key = dotted.partition(".")  # an old switch (run.tensorboard) as the list it edits
    sections.setdefault(section, {})[key] = getattr(getattr(cfg, section), key)
  sections["model"] = dataclasses.asdict(cfg.model)  # every model key explicit
  head = head or (cfg.model.tie_embeddings and own_head(headers))  # --set model.tie_embeddings=true
  check_tensors(table(cfg.model), headers, src, cfg.model.tie_embeddings, head)
  if checkpoint.committed_steps(w / "checkpoints"):
    raise UserError(f"--workdir {w} already holds checkpoints; import into a new directory")
  name = name if name is not None else src.absolute().name
  if Path(name).name != name or name in (".", ".."):  # WORKDIR/NAME.toml stays inside the workdir
    raise UserError(f"--name {name!r}: must be a plain file name (no directory part)")
  files.check_output_dir(w, "--workdir")
  arch = hf.get("architectures")
  arch = ", ".join(map(str, arch)) if isinstance(arch, list) else str(arch or "")
  text = toml_text(sections, f"Imported by `python -m jaxtrain.hf import {src}`: {hf['model_type']}, {arch}.")
  return ImportPlan(src, w, name, cfg, text, headers, tok if tok.is_file() else None)


def _stored_dtype(t: Tensor, headers: dict, ours) -> np.dtype:
  """The dtype a parameter is saved in: its tensors' own (one dtype, widening exactly to `ours`, the parameter's),
  so that the import holds and writes what it read; the first train casts it on restore."""
  import jax.numpy as jnp
  kinds = {headers[n][2] for n in t.names.flat}
  own = {"F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}.get(kinds.pop()) if len(kinds) == 1 else None
  return np.dtype(own) if own is not None and ours == np.float32 else np.dtype(ours)


def run_import(plan: ImportPlan, mesh) -> Path:
  """Places every tensor onto its sharding, in its own dtype, and commits a step-0 checkpoint of the parameters
  alone (no optimizer state: the first train creates it, checkpoint.PARAMS_ONLY); returns the config path."""
  import jax
  from jaxtrain import data
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import checkpoint, progress
  from jaxtrain.run import step as step_lib
  t0 = time.perf_counter()
  cfg, w = plan.cfg, plan.workdir
  is_writer = jax.process_index() == 0
  if is_writer:  # the source's digests, for an adapter export to check its base against (hf_source)
    weights = {f for f, _, _ in plan.headers.values()} | ({INDEX} if (plan.hf_dir / INDEX).is_file() else set())
    digests = hf_source.record(plan.hf_dir, weights)
    (w / "hf").mkdir(parents=True, exist_ok=True)
    for f in HF_KEPT:  # kept for export: token ids and fields jaxtrain does not model
      if (plan.hf_dir / f).is_file():
        shutil.copyfile(plan.hf_dir / f, w / "hf" / f)
    if plan.tokenizer is not None:
      shutil.copyfile(plan.tokenizer, w / "tokenizer.json")
    (w / f"{plan.name}.toml").write_text(plan.toml)
  setup = step_lib.Setup(cfg, mesh)
  cfg = setup.cfg  # with what the mesh implies (a pipeline's stacked layers)
  by_path = {t.path: t for t in table(cfg.model)}
  # LoRA: the base is read (QLoRA: quantized a tensor at a time), its adapters start fresh
  params, nread = _place_params(plan, by_path, *_frozen_base(setup))
  params = setup.with_adapters(params)
  ck = cfg.checkpoint
  # the params fill host memory on a CPU machine: orbax's compressed write buffers are kept to a window
  window = max([2**30] + [x.nbytes for x in jax.tree.leaves(params)])
  ckpts = checkpoint.Checkpoints(w / "checkpoints", ck.keep, ck.keep_every, async_save=False, is_writer=is_writer,
                                 verify=ck.verify, write_window=window)
  # A step-0 import took no step and read no data: later runs may change train settings and data.
  fp = {**checkpoint.fingerprint(cfg, data.tokenizer_digest(cfg), ""), "train": checkpoint.ANY,
        "data": checkpoint.ANY}
  body = {"contents": checkpoint.PARAMS_ONLY, "progress": vars(progress.Progress()),
          "data_state": {"version": 1, "step": 0}, "mesh": mesh_lib.describe(dict(mesh.shape)), "fingerprint": fp,
          "config": cfg.to_dict(), "seed": cfg.train.seed, "process_count": jax.process_count(),
          "imported_from": {"dir": str(plan.hf_dir.absolute()), "tensors": len(plan.headers),
                            **({"files": digests()} if is_writer else {})}}
  try:
    ckpts.save(0, {"params": params}, body)  # the manifest's digests: the one pass over what was written
  finally:
    ckpts.close()
  print(f"imported {len(plan.headers)} tensors ({nread / 2**30:.2f} GiB read) from {plan.hf_dir} in "
        f"{time.perf_counter() - t0:.1f}s: {setup.n_params:,} params, step-0 checkpoint (parameters only: the first "
        f"train creates the optimizer state) in {w / 'checkpoints' / '0'}")
  return w / f"{plan.name}.toml"


def _frozen_base(setup):
  """(abstract params to place, what to make of each placed one): the parameters, or LoRA's frozen base (as stored,
  but QLoRA's quantized weights placed dense on their compute sharding and quantized to their stored one as each
  arrives, so that one dense tensor at a time is held)."""
  import jax
  from jaxtrain.model import roles
  cfg, layout = setup.cfg.model, setup.layout

  def at(tree, path):
    for k in path:
      tree = tree[getattr(k, "key", getattr(k, "idx", k))]
    return tree

  @functools.cache  # one program per (role, sharding): the layers of an unscanned model share it
  def quantizer(role, sh):
    return jax.jit(lambda w: roles.quantized(role, w), out_shardings=sh)

  def finish(path, x):
    role = roles.of(cfg, path)
    return x if role.quant == "none" else quantizer(role, at(layout.stored, path))(x)
  return setup.base_abstract(), finish


def _place_params(plan: ImportPlan, by_path: dict, abstract_params, finish=None) -> tuple[Any, int]:
  """(params on their shardings, each in `_stored_dtype`, then `finish`(path, array) if given; bytes read): every
  device reads its own part."""
  import jax
  safe_open, nread = safetensors_api().safe_open, [0]

  def get(name, t, index, dtype):
    # Our part `index` of one HF tensor: only that part is read; the file is opened per read, so no mapping
    # outlives it.
    with safe_open(str(plan.headers[name][0]), framework="numpy") as st:
      if plan.headers[name][2] == hf_gptoss.MXFP4:
        hf_index, raw = None, hf_gptoss.read(st, name)  # decoded whole, then cut
      else:
        part = st.get_slice(name)
        hf_index = _hf_index(t, index)
        raw = part[hf_index] if hf_index is not None else part[:]
    nread[0] += raw.nbytes
    raw = raw.astype(dtype, copy=False)
    if hf_index is None:  # a part the file does not hold contiguously: cut from the whole tensor
      return np.ascontiguousarray(t.to_ours(raw)[index])
    return raw if t.ours is None else raw.T.reshape([len(range(*s.indices(n))) for s, n in zip(index, t.ours)])

  def shard(t, index, dtype):  # the part `index` (slices over our shape) of parameter t
    ns = t.names.ndim
    sub = np.asarray(t.names[index[:ns]], dtype=object)
    blocks = [get(n, t, index[ns:], dtype) for n in sub.flat]
    return np.stack(blocks).reshape(sub.shape + blocks[0].shape) if ns else blocks[0]

  def place(path, x):
    t = by_path[tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)]
    dtype = _stored_dtype(t, plan.headers, x.dtype)
    x = jax.make_array_from_callback(x.shape, x.sharding, lambda index: shard(t, index, dtype))
    return x if finish is None else finish(path, x)

  return jax.tree_util.tree_map_with_path(place, abstract_params), nread[0]
