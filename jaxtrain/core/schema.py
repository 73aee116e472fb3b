"""The config's schema: each section's keys with their type, default, meaning, bounds and whether they change
the math (`key`), and the tables over them (sections, renamed keys, fingerprint categories)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from jaxtrain.core import parse
from jaxtrain.core.errors import UserError


# The projections model.lora_targets may name: attention's q, k, v, o, MLA's q (its plain query projection), q_a,
# q_b (its low-rank query pair), kv_a, kv_b and o, and the SwiGLU MLP's (each expert's, the shared experts') gate,
# up, down.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "q_a", "q_b", "kv_a", "kv_b")

# Fingerprint categories (what --allow-mismatch names), and the category of each section's math keys.
MISMATCH_CATEGORIES = ("model", "train", "tokenizer", "data")
# What --allow-mismatch names: those and `optimizer`, a resume that switches optim.name (the new rule's state fresh)
OPTIMIZER_SWITCH = "optimizer"
ALLOW_MISMATCH = (*MISMATCH_CATEGORIES, OPTIMIZER_SWITCH)
SECTION_CATEGORY = {"model": "model", "optim": "train", "train": "train", "loss_scale": "train", "data": "data"}
TRACKERS = ("tensorboard", "wandb", "mlflow")  # what run.trackers may name
# The switch from before run.trackers: old spelling -> (the key it edits, the tracker it adds or removes).
SWITCHES = {"run.tensorboard": ("run.trackers", "tensorboard"), "train.tensorboard": ("run.trackers", "tensorboard")}
HANG_TIMEOUT_MIN_S = 1.0  # run.hang_timeout_s: the watchdog (run/watchdog.py) looks about once a second


def key(default: Any, doc: str, *, math: bool, min: float | None = None, max: float | None = None,  # noqa: A002
        open_min: bool = False, open_max: bool = False, content: bool = False, category: str | None = None):
  """A config field. `math`: part of the run's fingerprint; `content`: the files it names are fingerprinted."""
  return dataclasses.field(default=default, metadata={
      "doc": doc, "math": math, "min": min, "max": max, "open_min": open_min, "open_max": open_max,
      "content": content, "category": category})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = key(512, "Embedding rows; >= the tokenizer's vocabulary (pad up for sharding).", math=True, min=1)
  d_model: int = key(128, "Residual stream width.", math=True, min=1)
  n_layers: int = key(2, "Number of transformer blocks.", math=True, min=1)
  n_heads: int = key(8, "Query heads.", math=True, min=1)
  n_kv_heads: int = key(4, "Key/value heads (grouped-query attention); divides n_heads.", math=True, min=1)
  head_dim: int = key(16, "Width of one attention head.", math=True, min=1)
  d_ff: int = key(256, "Hidden width of the SwiGLU MLP.", math=True, min=1)
  rope_theta: float = key(10000.0, "RoPE base frequency.", math=True, min=1.0)
  rope_scaling: Literal["none", "linear", "llama3", "yarn"] = key(
      "none", "RoPE frequency scaling: none, linear (every frequency divided by rope_factor: Gemma 3's global "
      "layers), llama3 (Llama 3.1/3.2 long context) or yarn (DeepSeek-V3); the rope_* keys below.", math=True)
  rope_factor: float = key(8.0, "linear/llama3/yarn scaling: (low) frequencies are divided by this.", math=True,
                           min=1.0)
  rope_low_freq_factor: float = key(1.0, "llama3 scaling: wavelengths above original/this are fully scaled.",
                                    math=True, min=0.0)
  rope_high_freq_factor: float = key(4.0, "llama3 scaling: wavelengths below original/this are unscaled.",
                                     math=True, min=0.0)
  rope_original_max_position: int = key(8192, "llama3/yarn scaling: the context length the model was pretrained at.",
                                        math=True, min=1)
  # YaRN (DeepSeek-V3): model/rope.py; rope_factor is its context extension factor
  rope_beta_fast: float = key(32.0, "yarn scaling: rotations below which frequencies are fully interpolated "
                              "(the ramp's fast end).", math=True, min=0.0, open_min=True)
  rope_beta_slow: float = key(1.0, "yarn scaling: rotations above which frequencies are kept (the ramp's slow "
                              "end).", math=True, min=0.0, open_min=True)
  rope_mscale: float = key(0.0, "yarn scaling: mscale of the cos/sin factor mscale(factor, this) / "
                           "mscale(factor, rope_mscale_all_dim); 0 (with rope_mscale_all_dim 0) = 0.1 ln(factor) + 1.",
                           math=True, min=0.0)
  rope_mscale_all_dim: float = key(0.0, "yarn scaling: with rope_mscale, the cos/sin factor's denominator; MLA also "
                                   "multiplies its softmax scale by mscale(factor, this)^2 (DeepSeek-V3: 1.0); 0 = "
                                   "not.", math=True, min=0.0)
  rope_truncate: bool = key(True, "yarn scaling: the ramp's correction range floored/ceiled to whole dimensions "
                            "(Hugging Face's truncate; GPT-OSS: false).", math=True)
  # Multi-head latent attention (DeepSeek-V2/V3): model/mla.py
  attention_type: Literal["gqa", "mla"] = key(
      "gqa", "gqa: q/k/v projections of n_heads/n_kv_heads x head_dim; mla: multi-head latent attention (the "
      "q_lora_rank, kv_lora_rank, qk_*_head_dim, v_head_dim keys; head_dim and n_kv_heads unused).", math=True)
  q_lora_rank: int = key(0, "mla: rank of the low-rank query projection (with its RMSNorm); 0 = one plain "
                         "projection.", math=True, min=0)
  kv_lora_rank: int = key(32, "mla: width of the compressed key/value latent (what decoding caches).", math=True,
                          min=1)
  qk_nope_head_dim: int = key(16, "mla: per-head query/key width without RoPE.", math=True, min=1)
  qk_rope_head_dim: int = key(8, "mla: per-head query width with RoPE (the key's RoPE part is shared by all "
                              "heads); even.", math=True, min=2)
  v_head_dim: int = key(16, "mla: per-head value width.", math=True, min=1)
  norm_eps: float = key(1e-5, "RMSNorm epsilon (> 0).", math=True, min=0.0, open_min=True)
  tie_embeddings: bool = key(False, "Share the input embedding with the output projection.", math=True)
  qk_norm: bool = key(False, "Per-head RMSNorm of q and k over head_dim before RoPE (Qwen3; params q_norm/k_norm).",
                      math=True)
  init_std: float = key(0.02, "Std of the normal initializer of embeddings and projections.", math=True, min=0.0)
  dtype: Literal["bfloat16", "float16", "float32"] = key(
      "bfloat16", "Compute dtype. Parameters, Adam moments, logits and the loss are always float32.", math=True)
  fp8: Literal["none", "tensorwise"] = key(
      "none", "FP8 projection matmuls (docs/fp8.md): tensorwise = inputs and weights in e4m3, the output gradient in "
      "e5m2, each with a power-of-two scale from its current global amax; embedding, LM head, router, norms and "
      "attention scores stay in `dtype`; master weights and optimizer state are unchanged.", math=True)
  moe_experts: int = key(0, "Experts per mixture-of-experts layer; 0 = dense MLP in every layer.", math=True, min=0)
  moe_top_k: int = key(2, "Experts each token is routed to (weights renormalized over them unless "
                       "moe_norm_top_k=false).", math=True, min=1)
  moe_norm_top_k: bool = key(True, "Normalize the top-k routing weights to sum to 1; false = the raw router "
                             "scores (Hugging Face norm_topk_prob=false).", math=True)
  moe_every: int = key(1, "Layer i is MoE when (i + 1) % moe_every == 0; 1 = every layer.", math=True, min=1)
  moe_capacity_factor: float = key(1.25, "Expert capacity ceil(factor * G * top_k / experts) per group of G = "
                                   "moe_group_size tokens; 0 = C = G (never drop).", math=True, min=0.0)
  moe_aux_weight: float = key(0.01, "Weight of the load-balancing loss added to the training loss.", math=True, min=0.0)
  moe_z_weight: float = key(0.001, "Weight of the router z-loss added to the training loss.", math=True, min=0.0)
  moe_group_size: int = key(0, "Capacity group: this many tokens of consecutive positions (0 = one sequence, "
                            "train.seq_len); the same tokens drop on every mesh. Must fit the tokens each device "
                            "holds (see docs/moe.md).", math=True, min=0)
  moe_dropless: bool = key(False, "Dropless experts: tokens sorted by expert, grouped matmuls, no capacity "
                           "(moe_capacity_factor and moe_group_size are then unused).", math=True)
  moe_grouped_matmul: Literal["auto", "ragged_dot", "blocks"] = key(
      "auto", "Dropless kernel: ragged_dot (jax.lax.ragged_dot); blocks (batched matmuls over blocks of rows of one "
      "expert); auto = ragged_dot on TPU, blocks on CPU and GPU (whose ragged_dot multiplies by every expert).",
      math=False)
  moe_expert_d_ff: int = key(0, "Hidden width of each routed expert (fine-grained experts); 0 = d_ff.", math=True,
                             min=0)
  moe_shared_experts: int = key(
      0, "Always-on shared experts beside the routed ones (one SwiGLU of width n * expert width).", math=True, min=0)
  moe_first_dense: int = key(0, "The first k layers are dense MLPs whatever moe_every says.", math=True, min=0)
  moe_router: Literal["softmax", "sigmoid"] = key(
      "softmax", "Router scores: softmax over experts, or per-expert sigmoid (DeepSeek-V3); the top-k "
      "weights are normalized to sum to 1 either way unless moe_norm_top_k=false.", math=True)
  moe_n_group: int = key(1, "Group-limited routing (DeepSeek-V3): experts in this many equal groups, tokens "
                         "choose among the moe_topk_group groups with the best sum of their top-2 scores; 1 = off.",
                         math=True, min=1)
  moe_topk_group: int = key(1, "Groups a token's experts come from (with moe_n_group > 1).", math=True, min=1)
  moe_routed_scale: float = key(1.0, "Routed experts' weights are multiplied by this after normalization "
                                "(DeepSeek-V3's routed_scaling_factor).", math=True, min=0.0, open_min=True)
  moe_bias_rate: float = key(
      0.0, "Auxiliary-loss-free balancing: per-expert bias on the routing scores (selection only), moved by this "
      "much toward balance after every update; 0 = off (no bias).", math=True, min=0.0)
  moe_aux_convention: Literal["jaxtrain", "hf"] = key(
      "jaxtrain", "Load-balance loss: jaxtrain = mean over MoE layers of X*sum f*P; hf = Hugging Face's (top_k times "
      "that, f and P pooled over all MoE layers), so an HF router_aux_loss_coef carries over.", math=True)
  mtp_layers: int = key(0, "Multi-token prediction modules (DeepSeek-V3; model/mtp.py): 1 = one more decoder layer "
                        "predicting the token after next, sharing the embedding and output head; 0 = none.",
                        math=True, min=0, max=1)
  mtp_weight: float = key(0.0, "Weight of the multi-token-prediction loss (its mean cross-entropy) added to the "
                          "training loss; needs mtp_layers=1. The logged loss stays the next-token loss.", math=True,
                          min=0.0)
  attention_logits_dtype: Literal["float32", "bfloat16"] = key(
      "float32", "Dtype of the reference attention's L x L scores and softmax (bfloat16 halves their memory and "
      "traffic; see docs/gpu-compile.md for its accuracy). cuDNN, blocked and ring attention keep their own float32 "
      "statistics.",
      math=True)
  head_logits_dtype: Literal["float32", "bfloat16"] = key(
      "float32", "Dtype of the output head's logits and of their gradient entering the head's two backward "
      "matmuls (bfloat16: MaxText's choice, the head's three matmuls take bfloat16 operands); softmax, "
      "cross-entropy and the matmuls' sums stay float32.", math=True)
  sliding_window: int = key(
      0, "Sliding-window attention: a local layer's token sees itself and the window-1 tokens before it (Mistral, "
      "GPT-OSS, Gemma 3, Hugging Face's sliding_window); model.layer_types says which layers are local. Every "
      "kernel honours it (ring attention skips blocks wholly outside it; decoding keeps a local layer's last "
      "window tokens only). 0 = none: every layer global.", math=True, min=0)
  layer_types: str = key(
      "", "Which layers are local (windowed) with model.sliding_window > 0: empty = every layer (Mistral); "
      "alternate = every other, local first (GPT-OSS); a:b = a local then b global, repeated (5:1: Gemma 3); or a "
      "comma list of local/global, one per layer.", math=True)
  attention_sinks: bool = key(
      False, "Attention sinks (GPT-OSS): one learned logit per query head joins every softmax's denominator (param "
      "`sinks`, zero at init), so a query may attend to nothing. The reference kernel, ring attention and decoding "
      "take it; cuDNN cannot (the plan names the kernel that runs).", math=True)
  attention_bias: bool = key(
      False, "Biases on the q, k, v and output projections (GPT-OSS; params bq, bk, bv, bo, zero at init).",
      math=True)
  moe_bias: bool = key(
      False, "GPT-OSS experts: a learned router bias added to the router logits (param router_logit_bias) and biases "
      "on every expert's gate, up and down projections (b_gate, b_up, b_down); zero at init. Needs moe_experts > 0.",
      math=True)
  mlp_activation: Literal["swiglu", "swiglu_clamped", "gelu_tanh"] = key(
      "swiglu", "The gated MLP's (and every expert's) activation: swiglu = silu(gate) * up; swiglu_clamped (GPT-OSS) "
      "= g * sigmoid(swiglu_alpha * g) * (u + 1) with g = min(gate, swiglu_limit), u = up clipped to "
      "[-swiglu_limit, swiglu_limit]; gelu_tanh (Gemma, dense MLPs only) = gelu_tanh(gate) * up (GeGLU with the "
      "tanh-approximated GELU).", math=True)
  swiglu_alpha: float = key(1.702, "swiglu_clamped: the sigmoid's gain (GPT-OSS: 1.702); unused with swiglu.",
                            math=True, min=0.0, open_min=True)
  swiglu_limit: float = key(7.0, "swiglu_clamped: the clamp of gate (above) and up (both sides) (GPT-OSS: 7.0); "
                            "unused with swiglu.", math=True, min=0.0, open_min=True)
  # Gemma 3's departures from the Llama block (each off by default: the Llama math)
  norm_convention: Literal["scale", "one_plus"] = key(
      "scale", "What every RMSNorm (q/k norms included) multiplies the normalized x by: scale = its weight (init 1, "
      "Llama); one_plus = 1 + its weight (init 0, Gemma).", math=True)
  post_norms: bool = key(False, "Gemma 3: an RMSNorm also after the attention and after the MLP, on each one's "
                         "output before the residual add (params attn_post_norm, mlp_post_norm).", math=True)
  embed_scale: bool = key(False, "Gemma: token embeddings multiplied by sqrt(d_model), rounded to model.dtype as "
                          "transformers does.", math=True)
  rope_local_theta: float = key(
      0.0, "Gemma 3: the RoPE base of local (windowed) layers, unscaled (global layers keep rope_theta and "
      "rope_scaling). 0 = local layers rotate as global ones.", math=True, min=0.0)
  attention_scale: float = key(
      0.0, "The factor on the attention logits q.k; 0 = 1/sqrt(head_dim). Gemma 3: query_pre_attn_scalar**-0.5.",
      math=True, min=0.0)
  attention: Literal["auto", "xla", "cudnn", "blocked"] = key(
      "auto", "Attention kernel: auto = cuDNN fused where supported; else, on a GPU with train.seq_len > 512 "
      "(attention sinks, float32, a head width cuDNN refuses), blocked; else the XLA reference. xla = the reference "
      "(L x L scores); cudnn (error if unsupported); blocked = an online softmax over query x key blocks of 512 "
      "tokens (a quarter of shorter sequences) with a backward that recomputes each block: no L x L buffer, float32 "
      "statistics, key blocks outside a sliding window skipped. With sequence > 1 it is the kernel inside ulysses; "
      "ring runs cuDNN on each block pair where auto or cudnn would run cuDNN (no window or sinks; packed "
      "rows: the pair's segment mask as a bias), else the blocked math (cudnn is then an error).", math=False)
  sequence_attention: Literal["ring", "ulysses"] = key(
      "ring", "Attention with sequence > 1: ring (K/V blocks travel the ring, online softmax) or ulysses (all-to-alls "
      "reshard q/k/v to whole sequences on a share of the heads, model.attention runs, one all-to-all back; "
      "sequence x tensor must divide n_heads).", math=False)
  attention_max_segments: int = key(
      0, "cuDNN: most documents (segments) one row may hold. 0 = counted from the run's data before the step "
      "compiles: rows of one document take cuDNN's causal path (no mask), packed rows O(L) offsets (Hopper+) where "
      "their softmax statistics (4*M*heads*seq_len bytes per row and layer) cost no more than the L x L mask, "
      "else the mask. M > 0: offsets of at most M per row whatever they cost (data that holds more is refused); "
      "the plan line says which path runs.", math=False, min=0)
  # LoRA (docs/training.md#lora): adapters beside the targeted projections; the rest of the model frozen
  lora_rank: int = key(0, "LoRA: rank r of the low-rank adapters added to the model.lora_targets projections "
                       "(delta = x A B * lora_alpha / r, B zero at init); the base weights are then frozen (no "
                       "gradient, no float32 master, no Adam moments: stored in model.dtype). 0 = off.", math=True,
                       min=0)
  lora_alpha: float = key(16.0, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank (PEFT's "
                          "lora_alpha).", math=True, min=0.0, open_min=True)
  lora_targets: str = key("q,v", "LoRA: comma-separated projections that get adapters, any the attention has: "
                          "q, k, v, o (grouped-query); q (q_lora_rank 0) or q_a, q_b, and kv_a, kv_b, o (mla); and "
                          "gate, up, down (the MLP; with MoE every expert's and the shared experts').", math=True)
  lora_base_dtype: Literal["none", "nf4", "int8"] = key(
      "none", "QLoRA: the frozen base's decoder-layer projections (every expert's with MoE) stored quantized, "
      "each matrix alone, and dequantized to model.dtype one layer at a time where it runs: nf4 (4-bit NormalFloat, "
      "blocks of 64 with a float32 absmax each, bitsandbytes' codes) or int8 (per output channel); embedding, head "
      "and norms stay as LoRA keeps them. none = LoRA's model.dtype base. Needs model.lora_rank > 0.", math=True)
  # math: not the math, but the checkpoint's layout
  scan_layers: bool = key(False, "Stack the blocks' params on a leading `layers` axis and run them with one "
                          "jax.lax.scan (faster compiles); dense first layers (moe_first_dense) are a second stack, "
                          "`dense_layers`.", math=True)
  remat: Literal["none", "full", "save_dots", "save_named", "offload_named"] = key(
      "none", "Per-block rematerialization: none; full; save_dots (keep projection matmuls); save_named "
      "(keep q/k/v, attention output, MLP hidden); offload_named (those to pinned host memory).", math=False)

  def __post_init__(self):  # "q, v" is "q,v": one spelling for the fingerprint and the files that record it
    object.__setattr__(self, "lora_targets", ",".join(t.strip() for t in self.lora_targets.split(",")))

  def lora_target_names(self) -> tuple[str, ...]:
    """model.lora_targets as names (validated against LORA_TARGETS; an empty one refused); () when LoRA is off."""
    return tuple(parse.items(self.lora_targets, "model.lora_targets")) if self.lora_rank else ()

  def is_moe_layer(self, i: int) -> bool:
    """The one rule for which layers are mixture-of-experts layers."""
    return self.moe_experts > 0 and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0

  def moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.n_layers))

  def layer_windows(self) -> tuple[int, ...]:
    """The one rule for each layer's attention window: model.sliding_window for a local layer (model.layer_types),
    0 (the whole causal past) for a global one. A bad model.layer_types is a one-line error."""
    n, w, spec = self.n_layers, self.sliding_window, self.layer_types.strip()
    if not w:
      return (0,) * n
    allowed = "empty (all local), alternate, a:b (a local then b global) or a comma list of local/global per layer"
    if spec in ("", "alternate") or re.fullmatch(r"\d+:\d+", spec):
      a, b = (1, 0) if not spec else (1, 1) if spec == "alternate" else map(int, spec.split(":"))
      if a + b == 0:
        raise UserError(f"model.layer_types={spec!r}: a:b needs a + b > 0; allowed: {allowed}")
      return tuple(w if i % (a + b) < a else 0 for i in range(n))
    kinds = [t.strip() for t in spec.split(",")]
    if any(t not in ("local", "global") for t in kinds) or len(kinds) != n:
      why = (f"has {len(kinds)} entries for model.n_layers={n}" if set(kinds) <= {"local", "global"}
             else "is not a known pattern")
      raise UserError(f"model.layer_types={spec!r} {why}; allowed: {allowed}")
    return tuple(w if t == "local" else 0 for t in kinds)

  def window_choices(self) -> tuple[int, ...]:
    """The distinct windows of the layers (0: global), sorted: a scanned stack picks among these per layer."""
    return tuple(sorted(set(self.layer_windows())))

  def stacks(self) -> dict[str, range]:
    """The layers of each scanned stack (model.scan_layers): dense first layers (moe_first_dense) are their own
    `dense_layers` stack before the MoE `layers` (MaxText's two stacks); otherwise `layers` holds them all."""
    k = self.moe_first_dense if self.scan_layers and self.moe_experts else 0
    return {"dense_layers": range(k), "layers": range(k, self.n_layers)} if 0 < k < self.n_layers else {
        "layers": range(self.n_layers)}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  name: Literal["adamw", "muon"] = key(
      "adamw", "The update rule: adamw = AdamW on every trained parameter; muon = Muon (momentum orthogonalized by "
      "Newton-Schulz, its RMS matched to AdamW's: docs/training.md#muon) on the projection matrices, AdamW on the "
      "embedding, output head, norms and routers (the role table's `muon`).", math=True)
  muon_momentum: float = key(0.95, "Muon's (Nesterov) momentum, in [0, 1); optim.name=muon only.", math=True,
                             min=0.0, max=1.0, open_max=True)
  qk_clip: float = key(
      0.0, "MuonClip's QK-clip threshold tau (0 = off): after an applied update, each attention head whose largest "
      "logit q.k/sqrt(head_dim) in the step exceeded tau has its query and key weights scaled so that its logits "
      "shrink by tau/max (Kimi K2's rule; grouped-query keys stay, the query takes it all: docs/training.md#qk-clip). "
      "With muon or adamw; grouped-query attention without qk_norm; costs a forward of the layers per step. The "
      "largest logit per layer is logged (attn_max_logit/layerN).", math=True, min=0.0)
  lr: float = key(3e-3, "Peak learning rate.", math=True, min=0.0)
  warmup_steps: int = key(5, "Linear warmup steps, from lr/warmup_steps up to lr.", math=True, min=0)
  warmup_tokens: float = key(
      0.0, "Linear warmup in tokens (a number such as 2e8) (with the schedule in tokens, train.tokens): the update that brings the valid "
      "tokens of applied updates to T runs at lr * T / warmup_tokens until T reaches it; the alternative to "
      "warmup_steps (both set: refused); 0 = none.", math=True, min=0.0)
  lr_reference_batch: int = key(
      0, "Scale the learning rate with the global batch: lr x (batch / this), or its square root "
      "(optim.lr_batch_scaling), per step's batch under train.batch_ramp; printed at start. A rule of thumb (the "
      "linear rule of Goyal et al. for SGD, the square root for Adam), not a theorem. 0 = off.", math=True, min=0)
  lr_batch_scaling: Literal["linear", "sqrt"] = key(
      "linear", "How optim.lr_reference_batch scales the learning rate: linear = batch / reference; sqrt = its "
      "square root.", math=True)
  min_lr_ratio: float = key(0.1, "Cosine decay ends at lr * min_lr_ratio at the last step.", math=True, min=0.0,
                            max=1.0)
  weight_decay: float = key(0.1, "AdamW decoupled weight decay; applied to projection matrices only.", math=True,
                            min=0.0)
  b1: float = key(0.9, "Adam beta1, in [0, 1).", math=True, min=0.0, max=1.0, open_max=True)
  b2: float = key(0.95, "Adam beta2, in [0, 1).", math=True, min=0.0, max=1.0, open_max=True)
  eps: float = key(1e-8, "Adam epsilon (> 0).", math=True, min=0.0, open_min=True)
  grad_clip: float = key(1.0, "Clip the global gradient norm to this value (0 disables).", math=True, min=0.0)
  zero_stage: int = key(0, "What the data axis shards beyond the batch (ZeRO): 0 nothing; 1 the float32 master "
                        "weights and Adam moments (compute-dtype params replicated); 2 also the gradients and the "
                        "accumulation buffer. fsdp shards all of them (ZeRO-3) either way.", math=False, min=0, max=2)
  offload: Literal["none", "host"] = key("none", "host: the float32 master weights and Adam moments live in host "
                                         "memory (pinned_host) and are streamed to the device for the update.",
                                         math=False)
  state_dtype: Literal["float32", "bfloat16", "int8"] = key(
      "float32", "How Adam's two moments (and Muon's momentum) are kept between updates; the update's arithmetic "
      "and the master weights stay float32. bfloat16: rounded to bfloat16 (2+2 bytes per parameter); int8: "
      "bitsandbytes' 8-bit Adam, block-wise dynamic quantization, 256 values per float32 scale (1+1 bytes per "
      "parameter and 4/256 per moment for scales; parameters under 4096 values keep float32: "
      "docs/training.md#state-dtype). Changes the math (the stored moments are rounded).", math=True)
  in_backward: bool = key(
      False, "Apply each scanned layer's update inside the backward as soon as its gradient exists, so the layers' "
      "whole gradient is never held (jaxtrain.run.in_backward, docs/training.md#the-step). The "
      "update, clipping and skipped steps are the plain step's (equal to rounding): a first backward pass takes the "
      "global gradient norm and checks it is finite, a second applies the updates, so a step costs one backward "
      "more. One microbatch, no pipeline, AdamW, dense scanned layers, no LoRA, DPO, ZeRO or offload.", math=False)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = key(20, "Length of the LR schedule, and the run's length unless --steps stops it sooner or later.",
                   math=True, min=1)
  batch_size: int = key(16, "Global sequences per optimizer step (all microbatches, all ranks); with "
                        "train.batch_ramp its largest size (the memory bill and eval batches use it).", math=True,
                        min=1)
  batch_ramp: str = key(
      "", "Batch-size ramp-up, tokens:sequences pairs from 0, e.g. '0:256,1e9:512,2e9:1024': a step's global batch "
      "is the size at the tokens fed before it (sequences x seq_len, padding and skipped steps included, so the data "
      "order is the same on every mesh and resume); grown as rows per device, the microbatch count unchanged; each "
      "size divides over microbatches x data*fsdp*expert, the largest is train.batch_size; each size's step "
      "compiles once. Empty = train.batch_size throughout.", math=True)
  tokens: float = key(
      0.0, "The schedule in tokens (a number such as 2e12): the LR schedule's length in valid (non-masked) tokens of applied updates (skipped "
      "steps move it by nothing), and the run's length: the steps that feed this many tokens (sequences x seq_len). "
      "The alternative to train.steps (both set: refused); warmup is then optim.warmup_tokens. 0 = in steps.",
      math=True, min=0.0)
  seq_len: int = key(128, "Tokens per sequence.", math=True, min=2)
  microbatches: int = key(1, "Gradient-accumulation steps per optimizer step; divides batch_size. For MoE models "
                          "a math key (the aux loss and capacity groups follow the split).", math=False, min=1)
  seed: int = key(0, "Seed of the parameter init and of the data order.", math=True, min=0)
  max_skipped_in_a_row: int = key(10, "Abort the run after this many non-finite (skipped) steps in a row.",
                                  math=False, min=1)
  eval_interval: int = key(0, "Evaluate on the held-out split every N steps (0 = never); see data.eval_*.",
                           math=False, min=0)
  eval_tasks: str = key(
      "", "lm-eval-harness tasks (or groups) run during training every train.eval_tasks_interval steps, "
      "comma-separated (as jaxtrain.eval --tasks): in the training process, on the training mesh, with the live "
      "parameters (no second copy); their metrics logged as lm_eval/<task>/<metric> beside the held-out loss "
      "(metrics.jsonl, run.trackers) and written to <workdir>/eval/step_<N>.json. Names are checked before the run "
      "starts. Needs the lm-eval package. Does not change the math.", math=False)
  eval_tasks_interval: int = key(0, "Run train.eval_tasks every N steps (0 = never).", math=False, min=0)
  eval_tasks_limit: int = key(0, "At most this many documents per task of train.eval_tasks (0 = all; as "
                              "jaxtrain.eval --limit).", math=False, min=0)
  eval_include_path: str = key(
      "", "A folder of task YAMLs (over local files: nothing is downloaded) that train.eval_tasks may name besides "
      "lm-eval's own, as jaxtrain.eval --include-path; empty = lm-eval's tasks only.", math=False)
  loss_chunk_tokens: int = key(
      -1, "Cross-entropy in chunks of this many tokens per device (jaxtrain.model.loss): one chunk's float32 logits "
      "(chunk x vocab / tensor x 4 bytes, 0.5 GiB for 1024 tokens at a 128k vocabulary) instead of the whole "
      "batch's; 0 = the plain unchunked loss; -1 = chosen for the device (the plan line says what): on a CUDA GPU "
      "the fewest chunks whose logits stay within 1/32 of its memory, one where the whole microbatch's do (each "
      "chunk re-reads the head's float32 gradient; the plain loss's autodiff makes more passes over float32 "
      "logits); elsewhere 1024.", math=False, min=-1)
  objective: Literal["lm", "dpo"] = key(
      "lm", "What the step minimizes: lm = next-token cross-entropy; dpo = Direct Preference Optimization (TRL's "
      "sigmoid loss) on preference data (data prepare --chosen-field/--rejected-field) against the frozen starting "
      "model (jaxtrain.run.dpo, docs/training.md#dpo).", math=True)
  dpo_beta: float = key(0.1, "DPO's beta: the weight of the log-probability ratios to the reference model "
                        "(train.objective=dpo).", math=True, min=0.0, open_min=True)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  log_every: int = key(1, "Print a progress line every N steps (metrics.jsonl gets every step).", math=False, min=1)
  sequence_parallel: bool = key(False, "Megatron sequence parallelism: with tensor > 1, norms and residual adds run "
                                "split along the sequence.", math=False)
  xla_flags: Literal["none", "gpu-default"] = key(
      "none", "XLA/NCCL flag preset applied before the backend starts (jaxtrain.parallel.xla_flags); unknown flags are "
      "dropped.", math=False)
  xla_flags_extra: str = key("", "Extra XLA flags, space-separated (--xla_...=v), validated like the preset: one "
                             "this jaxlib does not know stops the command (see xla_flags_unknown).", math=False)
  xla_flags_unknown: Literal["error", "warn"] = key(
      "error", "A flag of run.xla_flags_extra that this jaxlib does not know: error = stop with one line naming it; "
      "warn = drop it with a warning and run. Does not change the math.", math=False)
  trackers: str = key(
      "tensorboard", "Where each step's scalars go besides metrics.jsonl (process 0), comma-separated, any of "
      "tensorboard (<workdir>/tb/), wandb (Weights & Biases: WANDB_PROJECT, default jaxtrain; WANDB_MODE; files in "
      "WANDB_DIR, default the workdir), mlflow (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, default jaxtrain); "
      "empty = none. wandb and mlflow also get the resolved config and the plan line; a job is one tracker run, its "
      "id kept in <workdir>/trackers.json, continued by every resume from a checkpoint; a tracker that cannot start "
      "or stops working is one warning line and the run goes on. The older run.tensorboard=true/false adds/removes "
      "tensorboard here (given with run.trackers in the same file or --set list: refused).", math=False)
  profile_steps: str = key("", "Steps to trace with jax.profiler into <workdir>/profile/, e.g. '5-7' or '3'; "
                           "empty = none.", math=False)
  fit_check: bool = key(True, "Before allocating, compare the memory bill with one device's memory (GPU: its "
                        "limit; CPU: host memory / devices) and stop with one line if it cannot fit.", math=False)
  hang_timeout_s: float = key(
      -1.0, "Hang watchdog: a process that completes no step for this long prints one line, logs its Python stacks "
      "and the step's collectives, and exits 3 (docs/training.md): -1 = automatic, max(300, 10 x the median step "
      "time so far); 0 = off; >= 1 = this many seconds (a shorter bound is refused: the watchdog looks about once "
      "a second).", math=False, min=-1.0)
  hang_first_step_s: float = key(
      1800.0, "Hang watchdog: the bound for the first step of a start or resume, which includes its compile (and, "
      "on GPUs, the NCCL set-up); with run.xla_flags=gpu-default, XLA's NCCL termination timeout is the larger "
      "bound plus 60 s.", math=False, min=1.0)

  def tracker_names(self) -> list[str]:
    """run.trackers as names (validated against TRACKERS)."""
    return parse.items(self.trackers, "run.trackers")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  schedule: Literal["gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv", "dualpipev"] = key(
      "1f1b", "Pipeline schedule when the mesh has pipeline > 1 (microbatches = train.microbatches): gpipe; "
      "1f1b (stashes at most `stages` microbatches); interleaved (1f1b over virtual_stages chunks per device, "
      "bubble / virtual_stages); looped-bfs (breadth-first over the chunks); zb-h1 (1f1b with the backward split "
      "into input and weight gradients, weight gradients filling the bubbles); zbv (zero-bubble V: 2 chunks per "
      "device, virtual_stages=2); dualpipev (DeepSeek's DualPipe on a V: ticks pair one microbatch's forward with "
      "another's backward so that each one's communication runs under the other's compute; virtual_stages=2, "
      "microbatches >= 2 x pipeline).", math=False)
  virtual_stages: int = key(1, "Model chunks per pipeline device: >= 2 for interleaved and looped-bfs, 2 for zbv "
                            "and dualpipev, else 1.", math=False, min=1)


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  mode: Literal["auto", "dynamic", "off"] = key("auto", "Dynamic loss scaling: auto = on for float16 compute only; "
                                                "dynamic = always; off = scale 1.0.", math=True)
  initial: float = key(2.0**15, "Initial loss scale.", math=True, min=1.0)
  growth_interval: int = key(2000, "Finite steps in a row after which the scale grows.", math=True, min=1)
  growth_factor: float = key(2.0, "Multiplier applied when the scale grows.", math=True, min=1.0)
  backoff_factor: float = key(0.5, "Multiplier applied after a non-finite step, in (0, 1).", math=True, min=0.0,
                              max=1.0, open_min=True, open_max=True)
  min: float = key(1.0, "Lower bound of the scale.", math=True, min=0.0)
  max: float = key(2.0**24, "Upper bound of the scale.", math=True, min=1.0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  interval: int = key(10, "Save every N steps (and always at the last step and on SIGTERM); 0 = only those.",
                      math=False, min=0)
  keep: int = key(3, "Committed checkpoints to keep (the newest ones).", math=False, min=1)
  keep_every: int = key(0, "Also keep every checkpoint whose step is a multiple of this (0 = none).", math=False, min=0)
  async_save: bool = key(True, "Write checkpoints in the background while training continues.", math=False)
  on_damaged: Literal["fallback", "stop"] = key(
      "fallback", "Latest checkpoint fails verification at resume: fallback = move it aside (warning) and resume from "
      "the newest one that verifies; stop = exit naming the good steps and the --resume-from to use.", math=False)
  verify: Literal["full", "sizes", "off"] = key(
      "full", "What a save records and a resume checks: full = every file's size and sha256; sizes = sizes only (no "
      "file read); off = only that the manifest is there (committed). Several processes share the hashing.", math=False)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  heartbeat_timeout_s: int = key(100, "A process silent this long counts as dead; the others then exit non-zero.",
                                 math=False, min=1)
  init_timeout_s: int = key(300, "How long processes wait for each other at start-up.", math=False, min=1)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = key("bundled", "'bundled' (shipped corpus), a prepared dir, or a .txt/.jsonl/.parquet file; "
                    "comma-separated prepared dirs make a mixture.", math=True, content=True)
  text_field: str = key("text", "Field holding the text in a raw .jsonl/.parquet source.", math=True)
  tokenizer: str = key("byte", "'byte', a path to a tokenizer.json, or a folder as Hugging Face saves a tokenizer (its "
                       "tokenizer.json, with the special tokens its tokenizer_config.json names); must be the one the "
                       "data was prepared with.",
                       math=True, content=True, category="tokenizer")
  weights: str = key("", "Mixture weights, comma-separated, one per source; empty = proportional to tokens.", math=True)
  eval_source: str = key("", "Held-out data (same forms as source); empty = hold out data.eval_fraction.", math=False)
  eval_fraction: float = key(0.0, "Fraction of each source's documents held out for evaluation (fixed split); "
                             "it removes them from training.", math=True, min=0.0, max=1.0, open_max=True)
  eval_batches: int = key(4, "Global batches per evaluation (the same ones every time).", math=False, min=1)
  workers: int = key(2, "Background threads building batches (0 = in the training thread).", math=False, min=0)
  prefetch: int = key(4, "Batches built ahead of the training loop.", math=False, min=1)
  verify: bool = key(True, "Check every shard's sha256 against the manifest when a prepared dir is opened "
                     "(several processes each hash a share).", math=False)


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)

  def to_dict(self) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}

# Keys that moved when [train] was split by concern: old name -> new name.
_NO_OLD_NAME = {"hang_timeout_s", "hang_first_step_s", "trackers"}  # [run] keys added after it was split from [train]
_NO_OLD_OPTIM_NAME = {"name", "muon_momentum", "qk_clip", "warmup_tokens", "lr_reference_batch",
                      "lr_batch_scaling"}  # [optim] keys added after it was split from [train]
RENAMED = {f"train.{k}": f"optim.{k}" for k in dataclasses.asdict(OptimConfig()) if k not in _NO_OLD_OPTIM_NAME} | {
    f"train.{k}": f"run.{k}" for k in dataclasses.asdict(RunConfig()) if k not in _NO_OLD_NAME}


def fields(section: str) -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def all_keys() -> dict[str, dataclasses.Field]:
  """Every key as 'section.name' -> its field (with the declaration in `metadata`)."""
  return {f"{s}.{n}": f for s in SECTIONS for n, f in fields(s).items()}


def category(dotted: str) -> str | None:
  """The fingerprint category of a math key; None for a key that only steers the run."""
  meta = all_keys()[dotted].metadata
  return (meta["category"] or SECTION_CATEGORY[dotted.partition(".")[0]]) if meta["math"] else None


# Keys that say one thing two ways (the run's length, the warmup): given in a later layer than its alternative
# (--set train.tokens over a preset's steps), a key replaces it; in one layer, both given are refused (`validate`).
ALTERNATIVES = (("train.steps", "train.tokens"), ("optim.warmup_steps", "optim.warmup_tokens"))
