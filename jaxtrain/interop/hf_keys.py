"""config.json <-> model.* keys: what a Hugging Face config says in jaxtrain's keys (import), and the
config.json a jaxtrain model exports as; each family's own keys in its module (hf_deepseek, hf_gemma3, ...)."""

from __future__ import annotations

from typing import Any

from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf_deepseek, hf_gemma3, hf_gptoss, hf_fields as F, hf_rope

SUPPORTED = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma3_text")
QWEN3 = ("qwen3", "qwen3_moe")


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
