"""Activation bytes per device: what a layer keeps for its backward under each remat policy and attention kernel,
a pipeline stage's stash and slots, and the step's transient workspace (the memory bill's activation lines,
analysis/memory.py; formulas in docs/inspect.md, "The memory bill")."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxtrain.model import flash, ops
from jaxtrain.parallel import pipeline, program, sharding


def dims(cfg, mesh) -> dict:
  """Per-device sizes the formulas use (see `activations`; the memory bill reads T and s)."""
  m = cfg.model
  split = {k: n // sharding.axis_ways(axis, n, mesh) for k, axis, n in (
      ("D", "act_embed", m.d_model), ("H", "act_heads", m.n_heads), ("K", "act_kv_heads", m.n_kv_heads),
      ("F", "act_mlp", m.d_ff), ("V", "act_vocab", m.vocab_size))}
  return dict(split, s=np.dtype(m.dtype).itemsize, c=np.dtype(m.attention_logits_dtype).itemsize, E=m.head_dim,
              L=cfg.train.seq_len, T=sharding.tokens_per_device(cfg, mesh), R=_kernel_kv_heads(cfg, mesh, split))


def _kernel_kv_heads(cfg, mesh, split) -> int:
  """KV heads per token and device that the attention kernel keeps: ulysses repeats them to the degree where fewer
  (the same bytes per token as the sequence-split layout otherwise)."""
  m = cfg.model
  if mesh is None or mesh.shape["sequence"] == 1 or m.sequence_attention != "ulysses":
    return split["K"]
  from jaxtrain.parallel import ulysses
  tp, sp = ulysses.head_ways(sharding.rules_for(cfg.run.sequence_parallel), m.n_heads, mesh)
  return m.n_kv_heads * ulysses.kv_repeat(m.n_heads, m.n_kv_heads, tp * sp) // tp


def layer_residuals(cfg, mesh, kernel: str = "xla", packed_segments: int = 0) -> dict[str, float]:
  """Bytes per token that one layer keeps for its backward pass with remat none, per kernel."""
  d, m = dims(cfg, mesh), cfg.model
  s, c, D, H, R, F, E, L, T = (d[k] for k in "scDHRFELT")
  out = {"norms": 2 * (8 + s) * D + 16, "qkvo": s * (2 * H + 2 * R) * E}  # R: K, or ulysses' repeated KV heads
  if kernel == "xla":
    out["attention_matrix"] = H * (L * (1 + 2 * c + s) + 2 * c)
  else:  # cudnn: per segment slot, else per row (ring: per row of its blocks)
    out["softmax_stats"] = 4 * H * max(packed_segments, 1) + (L if kernel == "cudnn" and not packed_segments else 0)
  if m.moe_experts:
    # router logits/probabilities (f32); per expert-buffer row (capacity slots, or the dropless exchange's
    # ep x bound rows: `buffer_rows` per token): dispatched and returned rows (dropless: and the blocks' padded
    # copy; within 8% of XLA:GPU on deepseek-v3 and qwen3-30b-a3b) and SwiGLU residuals
    from jaxtrain.parallel import expert_layout
    buf = expert_layout.buffer_rows(cfg, mesh)
    slots = buf["rows"] / buf["tokens"]
    share = m.moe_layers() / m.n_layers
    Fe = (m.moe_expert_d_ff or m.d_ff) * F // m.d_ff  # a routed expert's width, split as d_ff is
    row = (3 if m.moe_dropless else 2) * s * D + 6 * s * Fe
    out["mlp"] = (share * (3 * 4 * m.moe_experts + slots * row + 6 * s * Fe * m.moe_shared_experts)
                  + (1 - share) * 6 * s * F)
  else:
    out["swiglu"] = 6 * s * F
  return out


def saved_per_token(cfg, mesh, remat: str) -> dict[str, float]:
  """Bytes per token and layer that a checkpointing policy keeps (block input included)."""
  d = dims(cfg, mesh)
  s, D, H, K, F, E = (d[k] for k in "sDHKFE")
  out = {"block_inputs": s * D}
  dense_ffn = 1 - (cfg.model.moe_layers() / cfg.model.n_layers if cfg.model.moe_experts else 0)
  if remat == "save_dots":
    out["projections"] = s * (H + 2 * K) * E + s * D + dense_ffn * 2 * s * F
  elif remat == "save_named":
    out["named"] = s * (2 * H + 2 * K) * E + dense_ffn * s * F
  return out


def activations(cfg, mesh, remat: str = "none", kernel: str = "xla", packed_segments: int = 0,
                logits_residual: bool = True) -> dict[str, int]:
  """Activation bytes per device kept for the backward pass of one microbatch (all layers);
  `logits_residual`: jax.vjp's float32 exp of the logits (the compiled step's are transient)."""
  d = dims(cfg, mesh)
  n, T, s, D, E, V = cfg.model.n_layers, d["T"], d["s"], d["D"], d["E"], d["V"]
  per = layer_residuals(cfg, mesh, kernel, packed_segments) if remat == "none" else saved_per_token(cfg, mesh, remat)
  out = {k: int(n * T * v) for k, v in per.items()}
  out["rope_and_final_norm"] = T * (4 * E + (8 + s) * D)
  if logits_residual and cfg.train.loss_chunk_tokens:  # the chunked loss keeps its float32 hidden-state gradient
    out["loss_grad_h"] = T * 4 * D
  elif logits_residual:  # jax.vjp's view; the compiled step's logits are transient (`workspace`)
    out["logits_exp"] = T * 4 * V
  return out


def pipeline_activations(cfg, mesh, remat: str = "none", kernel: str = "xla", packed_segments: int = 0) -> dict[str, int]:
  """Mesh pipeline > 1: a device keeps the schedule's stash and gradient slots (chunk inputs and output
  gradients, one microbatch each, +1 discard slot each), the embedded tokens of every microbatch (chunk 0's
  inputs, then their gradients; +1 discard slot) and, during a backward, the residuals of the one chunk it
  recomputes (its layers only: no final norm)."""
  t = pipeline.table(cfg, mesh)
  _, S, G, WN = program.program_table(t)
  chunk = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=cfg.model.n_layers // t.chunks))
  out = activations(chunk, mesh, remat, kernel, packed_segments, logits_residual=False)
  # the final norm's residuals are dead before a chunk's layers run backward (llama3.1-70b pp=4: no float32
  # (T, D) buffer at the layer-phase peak); the rope tables stay
  del out["rope_and_final_norm"]
  out["rope"] = int(dims(cfg, mesh)["T"] * 4 * cfg.model.head_dim)
  out["stash"] = (S + 1 + G + 1) * pipeline.act_bytes(cfg, mesh)
  out["embedded"] = (t.m + 1) * pipeline.act_bytes(cfg, mesh)
  return out


def workspace(cfg, mesh, remat: str = "none", kernel: str = "xla", packed_segments: int = 0,
              gathered: int = 0, platform: str = "gpu", loss_chunk: int | None = None) -> dict[str, int]:
  """Transient bytes at the step's peak beyond what is kept: the larger of the loss and layer phases.
  `loss_chunk`: the plan's tokens a loss chunk holds (None: the config's; its -1 the reference's 1024)."""
  d = dims(cfg, mesh)
  T, V, H, L = d["T"], d["V"], d["H"], d["L"]
  chunk = cfg.train.loss_chunk_tokens if loss_chunk is None else loss_chunk
  chunk = ops.LOSS_CHUNK_TOKENS if chunk < 0 else chunk
  head = cfg.model.d_model * V * (d["s"] + (8 if platform == "cpu" else 0))
  loss = 2 * 4 * V * (min(T, chunk) if chunk else T) + head
  if remat == "none":  # residuals are kept already; the reference's backward adds L x L score gradients
    layer = gathered + (T * H * L * (2 * d["c"] + 1) if kernel == "xla" else 0)
  else:  # the layer's residuals recomputed (the reference's whole L x L set, as jax.vjp keeps it)
    layer = gathered + T * sum(layer_residuals(cfg, mesh, kernel, packed_segments).values())
  if kernel == "blocked":
    layer += blocked_workspace(d)
  return {"loss phase": int(loss), "layer phase": int(layer)}


def blocked_workspace(d: dict) -> int:
  """The blocked kernel's backward (jaxtrain.model.flash): one query block x key block pair of float32 scores,
  probabilities and their gradients per row and head (4 of c x c); per token, float32 dq, the output gradient and
  dq's cast, the key blocks' stacked dk, dv and their relaid copies, lse and delta (XLA:CPU's compile of the
  backward at L = 8192, 2 heads of 16: 13.5 MB of temporaries, this 13.8 MB; tests/model/test_flash.py)."""
  T, H, R, E, L = d["T"], d["H"], d["R"], d["E"], d["L"]
  c = flash.block_size(L)
  return int(max(T // L, 1) * H * 16 * c * c + T * 4 * (3 * H * E + 4 * R * E + 2 * H))
