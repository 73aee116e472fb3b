"""Cross-key checks of a loaded config that do not depend on the mesh (`validate`, which `config.from_dict` runs):
each a one-line UserError naming the values and what is allowed."""

from __future__ import annotations

from jaxtrain.core import parse, ramp as ramp_lib
from jaxtrain.core.dependent import value_of
from jaxtrain.core.errors import UserError
from jaxtrain.core.schema import (ALTERNATIVES, HANG_TIMEOUT_MIN_S, LORA_TARGETS, TRACKERS, Config, ModelConfig,
                                  OptimConfig)


def validate(cfg: Config) -> None:
  """Cross-key checks that do not depend on the mesh."""
  m, t = cfg.model, cfg.train
  if -1 < cfg.run.hang_timeout_s < 0 or 0 < cfg.run.hang_timeout_s < HANG_TIMEOUT_MIN_S:
    raise UserError(f"run.hang_timeout_s={cfg.run.hang_timeout_s:g}: use -1 (automatic), 0 (off) or a number of "
                    f"seconds >= {HANG_TIMEOUT_MIN_S:g}")
  if m.n_heads % m.n_kv_heads:
    raise UserError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}")
  if m.moe_experts and m.moe_top_k > m.moe_experts:
    raise UserError(f"model.moe_top_k={m.moe_top_k} must be at most model.moe_experts={m.moe_experts}")
  if m.scan_layers and m.moe_experts and m.moe_every != 1:  # a dense prefix scans as its own stack; this cannot
    raise UserError(f"model.scan_layers=true needs identical layers; model.moe_every={m.moe_every} mixes dense "
                    "and MoE layers after moe_first_dense (use moe_every=1 or scan_layers=false)")
  if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
    raise UserError(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                    f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
  if m.moe_experts and (m.moe_experts % m.moe_n_group or m.moe_topk_group > m.moe_n_group
                        or m.moe_top_k > m.moe_topk_group * (m.moe_experts // m.moe_n_group)):
    raise UserError(f"model.moe_n_group={m.moe_n_group} must divide model.moe_experts={m.moe_experts}, with "
                    f"model.moe_topk_group={m.moe_topk_group} <= it and room for moe_top_k={m.moe_top_k} experts")
  if m.mtp_weight > 0 and not m.mtp_layers:
    raise UserError(f"model.mtp_weight={m.mtp_weight} needs model.mtp_layers=1 (the module it trains)")
  if m.attention_type == "mla" and m.qk_rope_head_dim % 2:
    raise UserError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
  if m.head_dim % 2:
    raise UserError(f"model.head_dim={m.head_dim} must be even (RoPE rotates pairs)")
  m.layer_windows()  # a bad model.layer_types: one line
  if m.attention_type == "mla" and (m.sliding_window or m.attention_sinks):
    what = f"model.sliding_window={m.sliding_window}" if m.sliding_window else "model.attention_sinks=true"
    raise UserError(f"{what} is for grouped-query attention, not model.attention_type=mla (use gqa)")
  if m.attention_type == "mla" and m.attention_bias:
    raise UserError("model.attention_bias=true is for grouped-query attention, not model.attention_type=mla (use gqa)")
  if m.moe_bias and not m.moe_experts:
    raise UserError("model.moe_bias=true needs model.moe_experts > 0 (it biases the router and the experts)")
  if m.attention_type == "mla" and m.attention_scale:
    raise UserError(f"model.attention_scale={m.attention_scale:g} is for grouped-query attention, not "
                    "model.attention_type=mla (its softmax scale is its own; use 0)")
  if m.mlp_activation == "gelu_tanh" and m.moe_experts:
    raise UserError(f"model.mlp_activation={m.mlp_activation!r} is for dense MLPs; with model.moe_experts="
                    f"{m.moe_experts} the experts are SwiGLU: allowed: swiglu, swiglu_clamped")
  check_lora(cfg)
  check_trackers(cfg)
  check_eval_tasks(cfg)
  check_optim(cfg)
  check_in_backward(cfg)
  if not cfg.data.text_field.strip():
    raise UserError(f"data.text_field={cfg.data.text_field!r}: must name a field of a raw source's records")
  ls = cfg.loss_scale
  if not ls.min <= ls.initial <= ls.max:
    raise UserError(f"loss_scale.initial={ls.initial} must lie within [loss_scale.min={ls.min}, "
                    f"loss_scale.max={ls.max}]")
  if t.batch_size % t.microbatches:
    raise UserError(f"train.microbatches={t.microbatches} must divide train.batch_size={t.batch_size}")
  check_schedule(cfg)


def check_schedule(cfg: Config) -> None:
  """The run's length and warmup said once (in steps or in tokens), and the batch ramp's sizes."""
  t, o = cfg.train, cfg.optim
  for a, b in ALTERNATIVES:
    va, vb = value_of(cfg, a), value_of(cfg, b)
    if vb and va != value_of(Config(), a):
      raise UserError(f"{a}={va} and {b}={vb:g} both set; give one (a later --set of one replaces the other)")
  if o.warmup_tokens and not t.tokens:
    raise UserError(f"optim.warmup_tokens={o.warmup_tokens:g} needs the schedule in tokens: set train.tokens (its "
                    "length), or use optim.warmup_steps")
  points = ramp_lib.parse_ramp(t.batch_ramp)
  if not points:
    return
  sizes = [n for _, n in points]
  if max(sizes) != t.batch_size:
    raise UserError(f"train.batch_size={t.batch_size} must be train.batch_ramp's largest size {max(sizes)} (the "
                    "memory bill and eval batches use it); set it or leave it to the ramp")
  if bad := [n for n in sizes if n % t.microbatches]:
    raise UserError(f"train.batch_ramp={t.batch_ramp!r}: size {bad[0]} does not divide into train.microbatches="
                    f"{t.microbatches}")


def check_optim(cfg: Config) -> None:
  """Muon's combinations, refused in one line: a key of Muon's set without it, or a layout it has no path for."""
  o = cfg.optim
  check_qk_clip(cfg)
  if o.name != "muon":
    if o.muon_momentum != OptimConfig.muon_momentum:
      raise UserError(f"optim.muon_momentum={o.muon_momentum} applies to optim.name=muon only (optim.name="
                      f"{o.name!r})")
    return
  if o.offload != "none":
    raise UserError(f"optim.name='muon' with optim.offload={o.offload!r} is not supported yet (the streamed update "
                    "runs AdamW unit by unit; Muon keeps its state on the device)")
  if cfg.model.lora_rank:
    raise UserError(f"optim.name='muon' with model.lora_rank={cfg.model.lora_rank} is not supported (LoRA trains "
                    "low-rank adapters, which Muon does not orthogonalize; use optim.name=adamw)")


def check_qk_clip(cfg: Config) -> None:
  """QK-clip's combinations it has no rule or pass for, refused in one line."""
  o, m = cfg.optim, cfg.model
  if not o.qk_clip:
    return
  why = {"model.attention_type='mla'": (m.attention_type == "mla", "MLA's per-head and shared rotary parts need "
                                        "their own rule"),
         "model.qk_norm=true": (m.qk_norm, "the norm undoes a scale of W_q and W_k; it bounds the logits itself"),
         f"model.lora_rank={m.lora_rank}": (m.lora_rank > 0, "W_q and W_k are the frozen base"),
         f"optim.offload={o.offload!r}": (o.offload != "none", "the streamed update holds the weights on the host"),
         f"model.mtp_layers={m.mtp_layers}": (m.mtp_layers > 0, "the MTP block's attention has no pass yet"),
         f"model.sliding_window={m.sliding_window}": (m.sliding_window > 0, "the max-logit pass sees the whole past"),
         "model.attention_sinks=true": (m.attention_sinks, "the max-logit pass has no sink"),
         "model.attention_bias=true": (m.attention_bias, "the rescale of W_q and W_k leaves the q/k biases")}
  for what, (bad, reason) in why.items():
    if bad:
      raise UserError(f"optim.qk_clip={o.qk_clip:g} with {what} is not supported ({reason})")
def check_in_backward(cfg: Config) -> None:
  """What the update in the backward runs with (jaxtrain.run.in_backward), the rest refused in one line."""
  o, m, t = cfg.optim, cfg.model, cfg.train
  if not o.in_backward:
    return
  refused = (("train.microbatches", t.microbatches, t.microbatches > 1, "a layer's gradient is whole only after "
              "the last microbatch"),
             ("model.scan_layers", "false", not m.scan_layers, "the update runs in the scan over the layers"),
             ("model.moe_experts", m.moe_experts, m.moe_experts > 0, "the dense layers only, so far"),
             ("model.lora_rank", m.lora_rank, m.lora_rank > 0, "not with LoRA's frozen base, so far"),
             ("train.objective", t.objective, t.objective != "lm", "the language-model objective only"),
             ("optim.name", repr(o.name), o.name != "adamw", "AdamW's elementwise update only"),
             ("optim.zero_stage", o.zero_stage, o.zero_stage > 0, "the state stays where the step computes"),
             ("optim.offload", repr(o.offload), o.offload != "none", "the state stays where the step computes"),
             ("optim.state_dtype", repr(o.state_dtype), o.state_dtype != "float32", "float32 moments only, so far"),
             ("optim.qk_clip", o.qk_clip, o.qk_clip > 0, "QK-clip's pass is the plain step's"),
             ("train.tokens", t.tokens, t.tokens > 0, "the schedule by applied updates only, so far"),
             ("optim.lr_reference_batch", o.lr_reference_batch, o.lr_reference_batch > 0,
              "the schedule by applied updates only, so far"),
             ("model.sliding_window", m.sliding_window, m.sliding_window > 0, "global attention only, so far"))
  for name, value, bad, why in refused:
    if bad:
      raise UserError(f"optim.in_backward=true with {name}={value} is not supported ({why}); set "
                      f"optim.in_backward=false")
  if o.b2 and o.b1 ** 2 >= o.b2:
    raise UserError(f"optim.in_backward=true needs optim.b1**2 < optim.b2 (here b1={o.b1}, b2={o.b2}): the update "
                    "is guarded by a bound known before it runs, which does not exist otherwise")


def check_lora(cfg: Config) -> None:
  """LoRA's targets, and the combinations it does not support yet, refused in one line."""
  m = cfg.model
  if m.lora_base_dtype != "none" and not m.lora_rank:
    raise UserError(f"model.lora_base_dtype={m.lora_base_dtype!r} quantizes LoRA's frozen base: set model.lora_rank "
                    "> 0 (or model.lora_base_dtype=none)")
  if not m.lora_rank:
    return
  names = m.lora_target_names()
  bad = [t for t in names if t not in LORA_TARGETS]
  if bad or not names or len(set(names)) != len(names):
    raise UserError(f"model.lora_targets={m.lora_targets!r}: name each projection once, any of: "
                    f"{', '.join(LORA_TARGETS)}")
  _check_lora_targets(m, names)
  refused = (("model.mtp_layers", m.mtp_layers, m.mtp_layers > 0), ("model.fp8", m.fp8, m.fp8 != "none"),
             ("optim.offload", cfg.optim.offload, cfg.optim.offload != "none"))
  for name, value, unsupported in refused:
    if unsupported:
      raise UserError(f"model.lora_rank={m.lora_rank} with {name}={value!r} is not supported yet (LoRA trains "
                      f"attention, MLP and expert projections, with the optimizer state on the device)")


def check_trackers(cfg: Config) -> None:
  names = cfg.run.tracker_names()
  bad = [n for n in names if n not in TRACKERS]
  if bad or len(set(names)) != len(names):
    raise UserError(f"run.trackers={cfg.run.trackers!r}: {'unknown tracker ' + bad[0] if bad else 'a tracker named twice'}"
                    f"; name each once, comma-separated, any of: {', '.join(TRACKERS)} (empty = none)")


def check_eval_tasks(cfg: Config) -> None:
  """train.eval_tasks's combinations, refused in one line (the task names are checked by the run, with lm-eval)."""
  t = cfg.train
  if not t.eval_tasks_interval:
    return
  names = parse.items(t.eval_tasks, "train.eval_tasks")
  if not names:
    raise UserError(f"train.eval_tasks_interval={t.eval_tasks_interval} needs train.eval_tasks (the lm-eval tasks "
                    "to run, comma-separated)")
  refused = (("optim.offload", cfg.optim.offload, cfg.optim.offload != "none", "the parameters live in host memory"),
             ("model.lora_base_dtype", cfg.model.lora_base_dtype, cfg.model.lora_base_dtype != "none",
              "the KV-cached decoder reads a dense base"))
  for name, value, unsupported, why in refused:
    if unsupported:
      raise UserError(f"train.eval_tasks={t.eval_tasks!r} with {name}={value!r} is not supported yet ({why}; "
                      "evaluate the checkpoints with python -m jaxtrain.eval instead)")


def _check_lora_targets(m: ModelConfig, names) -> None:
  """Every target is a projection this attention has (q, k, v, o; MLA's q or q_a, q_b, and kv_a, kv_b, o)."""
  if m.attention_type == "mla":
    has = {"o", "kv_a", "kv_b", *(("q_a", "q_b") if m.q_lora_rank else ("q",))}
  else:
    has = {"q", "k", "v", "o"}
  bad = [t for t in names if t not in has | {"gate", "up", "down"}]
  if bad:
    raise UserError(f"model.lora_targets={m.lora_targets!r}: {', '.join(bad)} not in model.attention_type="
                    f"{m.attention_type!r} (q_lora_rank={m.q_lora_rank}); its projections: "
                    f"{', '.join(t for t in LORA_TARGETS if t in has)}, gate, up, down")
