"""Which attention kernel runs (`select`, once, by the execution plan, for the device the step is compiled for):
cuDNN fused attention, with packed segments on Hopper+; the blocked online softmax (jaxtrain.model.flash) where
cuDNN cannot run on a GPU and the sequence is longer than a block; or the XLA reference (jaxtrain.model.attention).
model.attention=cudnn where a condition fails is a one-line error, never a silent fallback. Also ring attention's
cuDNN pair kernels (`block_forward`, `block_backward`; jaxtrain.parallel.ring decides where they run)."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from jaxtrain.core.errors import UserError
from jaxtrain.model import flash
from jaxtrain.parallel import devices


def select(model_cfg, seq_len: int | None = None, info: devices.Info | None = None,
           segments: int | None = None) -> tuple[str, str, int]:
  """("cudnn" | "blocked" | "xla", reason, segment slots) for the target device `info` (default: the first local
  one). `segments`: the most segments a row of the run's data holds (None: not known). Slots (cuDNN only, `path`):
  1 = causal alone, no mask operand; M > 1 = packed offsets of at most M per row; 0 = an L x L mask."""
  want = model_cfg.attention
  if want == "xla":
    return "xla", "model.attention=xla", 0
  if want == "blocked":
    return "blocked", f"model.attention=blocked: {_blocks(seq_len)}", 0
  info = info or devices.of()
  problem = cudnn_problem(model_cfg, seq_len, info)
  if problem is None:
    slots, how = path(model_cfg, info, seq_len, segments)
    local = f", sliding window {model_cfg.sliding_window} on local layers" if model_cfg.sliding_window else ""
    return "cudnn", f"cuDNN fused attention (causal{local}; {how})", slots
  if want == "cudnn":
    raise UserError(f"model.attention=cudnn is not supported here: {problem}; use auto, blocked or xla")
  if info.cuda and seq_len is not None and seq_len > flash.BLOCK:
    return "blocked", (f"blocked attention: {problem}, and at train.seq_len={seq_len} the XLA reference would hold "
                       f"{seq_len} x {seq_len} scores per row and head; {_blocks(seq_len)}"), 0
  return "xla", f"reference XLA attention: {problem}", 0


def cudnn_problem(model_cfg, seq_len: int | None, info: devices.Info) -> str | None:
  """The first condition jax's cuDNN attention does not meet for this model on `info`, None where all hold."""
  E, dt = model_cfg.head_dim, model_cfg.dtype
  if model_cfg.attention_type == "mla":  # q/k width (v is zero-padded to it)
    E = model_cfg.qk_nope_head_dim + model_cfg.qk_rope_head_dim
  return next((why for failed, why in (
      (not info.cuda, f"backend is {info.platform}, not a CUDA GPU"),
      (dt not in ("bfloat16", "float16"), f"model.dtype={dt} (cuDNN needs bfloat16 or float16)"),
      (E % 8 or E > info.max_head_dim,
       f"model.head_dim={E} (cuDNN needs a multiple of 8, at most {info.max_head_dim} on this GPU)"),
      (seq_len is not None and seq_len % 2, f"train.seq_len={seq_len} is odd (cuDNN needs it even)"),
      (model_cfg.attention_sinks, "model.attention_sinks=true (jax's cuDNN attention takes no sink logits)"))
      if failed), None)


def _blocks(seq_len: int | None) -> str:
  c = flash.block_size(seq_len) if seq_len else flash.BLOCK
  return f"online softmax over {c} x {c} query/key blocks, recomputed in the backward"


def path(model_cfg, info: devices.Info, seq_len: int | None, segments: int | None) -> tuple[int, str]:
  """How cuDNN sees segments: (1, ...) where every row is one segment: causal alone, cuDNN's fastest path; (M, ...)
  packed offsets (Hopper+, jax's private module) of at most M a row: the user's model.attention_max_segments,
  else the data's count where its softmax statistics (4 M heads L bytes a row and layer) are no larger than the
  L x L bias the mask becomes (2 L^2 bytes); (0, ...) the L x L mask, where nothing else runs."""
  bound, data = model_cfg.attention_max_segments, segments
  if data == 1:
    return 1, "one document per row: causal alone, no mask"
  if bound and data and data > bound:
    raise UserError(f"rows of this data hold up to {data} documents but model.attention_max_segments={bound}; "
                    f"raise it to at least {data}, or set it to 0 (chosen from the data)")
  most = min(x for x in (bound, data) if x) if (bound or data) else 0
  packable = info.packed and packed_module() is not None
  roomy = bool(bound) or (seq_len is not None and 2 * most * model_cfg.n_heads <= seq_len)
  if most and packable and roomy:
    whose = "the data's rows" if data else "model.attention_max_segments"
    return most, f"segments as packed offsets, at most {most} per row ({whose})"
  why = ("the packed layout needs jax's private cuDNN module, which this jax lacks" if info.packed and most and
         not packable else "the packed layout needs a Hopper or newer GPU" if most and not info.packed else
         f"rows hold up to {most} documents: packed offsets would keep more softmax statistics than the mask; set "
         f"model.attention_max_segments to pass them anyway" if most else
         "the most documents a row holds is not known here; model.attention_max_segments bounds it")
  return 0, f"segments as an L x L mask: {why}"


def fused(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, implementation: str = "cudnn", window: int = 0):
  """Causal GQA with segment masking through `jax.nn.dot_product_attention` (the tests run
  it with implementation="xla" on CPU to check the masking plumbing); `seg_BxL` None: one segment a row, causal
  alone (no mask operand: cuDNN's CAUSAL mask type). `window` > 0: a token sees itself and the window - 1 before
  it (cuDNN's sliding window of that length)."""
  mask_Bx1xLxL = None if seg_BxL is None else (seg_BxL[:, :, None] == seg_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask=mask_Bx1xLxL, is_causal=True,
                                      local_window_size=(window - 1, 0) if window else None,
                                      implementation=implementation).astype(q_BxLxHxE.dtype)


@functools.cache
def packed_module():
  """jax's cuDNN attention with packed segments (a private module, so probed once, when the plan is made):
  None where it or what `packed` uses is missing; the plan then takes the L x L mask path."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    assert callable(cudnn.dot_product_attention) and cudnn.MaskType.PADDING_CAUSAL
    return cudnn
  except Exception:  # noqa: BLE001 (any change there means: not usable)
    return None


def segments_per_row(seg_BxL):
  """Number of segments (runs of equal ids) in each row; numpy or jax arrays."""
  return 1 + (seg_BxL[:, 1:] != seg_BxL[:, :-1]).sum(axis=1)


def segment_offsets(seg_BxL, max_segments: int):
  """Each row's segments (runs of equal ids, at most M) in cuDNN's packed layout: (lengths,
  starts), int32 (B, M) and (B, M + 1); unused slots are -1."""
  B, L = seg_BxL.shape
  M = max_segments
  new_BxL = jnp.concatenate([jnp.ones((B, 1), bool), seg_BxL[:, 1:] != seg_BxL[:, :-1]], axis=1)
  ordinal_BxL = jnp.cumsum(new_BxL, axis=1, dtype=jnp.int32) - 1
  rows_Bx1 = jnp.arange(B)[:, None]
  lengths_BxM = jnp.zeros((B, M), jnp.int32).at[rows_Bx1, ordinal_BxL].add(1, mode="drop")
  pos_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  starts_BxM1 = jnp.full((B, M + 1), L, jnp.int32).at[rows_Bx1, ordinal_BxL].min(pos_BxL, mode="drop")
  used_BxM1 = jnp.concatenate([lengths_BxM, jnp.zeros((B, 1), jnp.int32)], axis=1) > 0
  return jnp.where(lengths_BxM > 0, lengths_BxM, -1), jnp.where(used_BxM1, starts_BxM1, -1)


def packed(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, max_segments: int, window: int = 0):
  """Causal GQA within segments through cuDNN's packed layout (Hopper or later): O(L)
  lengths and offsets, no L x L mask. Private jax module (`packed_module`): re-check on a jax upgrade."""
  cudnn = packed_module()
  lengths_BxM, starts_BxM1 = segment_offsets(seg_BxL, max_segments)
  out = cudnn.dot_product_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
                                    q_offsets=starts_BxM1, kv_offsets=starts_BxM1,
                                    scale=q_BxLxHxE.shape[-1] ** -0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
                                    qkv_layout="BTNH", sliding_window_length=window or None)
  return out.astype(q_BxLxHxE.dtype)


@functools.cache
def block_module():
  """What ring attention's cuDNN blocks use of the private module (`packed_module`): the forward's log-sum-exp
  (return_residual) and the backward primitive, bound with the ring's merged output and log-sum-exp. None where any
  of it is missing; the ring then keeps its XLA blocks."""
  cudnn = packed_module()
  try:
    assert cudnn is not None and cudnn.MaskType.NO_MASK is not None and cudnn.AttentionLayout.BTNH is not None
    assert "return_residual" in inspect.signature(cudnn.dot_product_attention).parameters
    assert callable(cudnn._dot_product_attention_bwd_p_wrapper.bind)
    return cudnn
  except Exception:  # noqa: BLE001 (any change there means: not usable)
    return None


def _mask_type(cudnn, causal: bool):
  return cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK


def _pair_bias(cudnn, seg_BxN, seg_BxM, dtype):
  """Packed rows: a pair's (B, 1, N, M) bias, zero where query and key share a segment, cuDNN's large negative
  number elsewhere (as jax turns a boolean mask into a bias); None where rows are one document."""
  if seg_BxN is None:
    return None
  same = (seg_BxN[:, :, None] == seg_BxM[:, None, :])[:, None]
  return jnp.where(same, jnp.asarray(0, dtype), cudnn.get_large_negative_number(jnp.dtype(dtype)))


def block_forward(q_BxNxHxE, k_BxMxKxE, v_BxMxKxE, seg_BxN, seg_BxM, causal: bool):
  """One ring block pair through cuDNN (causal: the diagonal block, queries and keys at the same positions; else
  every key visible; segment ids None: one document a row, else a bias keeps each query to its segment): (output
  float32 (B, N, H, E), log-sum-exp of the scaled scores float32 (B, N, H)). A query whose segment has no key in
  the pair gets a log-sum-exp near the bias, so the ring's merge weighs its output by zero."""
  cudnn = block_module()
  bias = _pair_bias(cudnn, seg_BxN, seg_BxM, q_BxNxHxE.dtype)
  Ev = v_BxMxKxE.shape[-1]
  out, lse_BxHxN = cudnn.dot_product_attention(q_BxNxHxE, k_BxMxKxE, _widen(v_BxMxKxE, q_BxNxHxE), bias=bias,
                                               scale=q_BxNxHxE.shape[-1] ** -0.5, mask_type=_mask_type(cudnn, causal),
                                               qkv_layout="BTNH", return_residual=True)
  return out[..., :Ev].astype(jnp.float32), jnp.swapaxes(lse_BxHxN, 1, 2)


def _widen(x, q):
  """MLA: v (and the output and its gradient with it) zero-padded to q's head width, the one width cuDNN takes;
  the extra columns give zero outputs and are cut off."""
  E = q.shape[-1]
  return x if x.shape[-1] == E else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, E - x.shape[-1]),))


def block_backward(q_BxNxHxE, k_BxMxKxE, v_BxMxKxE, seg_BxN, seg_BxM, out_BxNxHxE, do_BxNxHxE, lse_BxNxH,
                   causal: bool):
  """cuDNN's backward of one block pair given the whole ring's output and log-sum-exp (so each block's
  probabilities are the final ones): (dq, dk, dv) float32. The primitive jax's own VJP binds, bound directly:
  that VJP would use the block's own statistics. No gradient of the bias is asked for."""
  cudnn = block_module()
  none = jnp.zeros(0, q_BxNxHxE.dtype)  # no lengths, offsets or page tables
  bias = _pair_bias(cudnn, seg_BxN, seg_BxM, q_BxNxHxE.dtype)
  q = q_BxNxHxE
  out, do = (_widen(x.astype(q.dtype), q) for x in (out_BxNxHxE, do_BxNxHxE))
  dq, dk, dv = cudnn._dot_product_attention_bwd_p_wrapper.bind(
      q, k_BxMxKxE, _widen(v_BxMxKxE, q), none if bias is None else bias, none, none, none, none, none, none,
      jnp.swapaxes(lse_BxNxH, 1, 2), out, do,
      scale=q.shape[-1] ** -0.5, seed=42, dropout_rate=0.0, variadic_args=(bias is not None, False),
      mask_type=_mask_type(cudnn, causal), layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None)[:3]
  return dq.astype(jnp.float32), dk.astype(jnp.float32), dv[..., :v_BxMxKxE.shape[-1]].astype(jnp.float32)
