"""Which attention kernel runs: cuDNN fused attention or the plain XLA reference.

The choice is explicit and made once, for the target device, by the execution plan
(`jaxtrain.plan`), which calls `select`; the trainer prints it. `model.attention`:
  auto   cuDNN when every condition below holds, else the reference, with the reason;
  xla    always the reference (`jaxtrain.model.attention`);
  cudnn  cuDNN, and a one-line user error when a condition fails (never a silent fallback).
Conditions for cuDNN: a CUDA GPU backend; compute dtype bfloat16 or float16; head_dim a
multiple of 8 and at most 128 (256 on Hopper or later); even sequence length (cuDNN's
training kernels with a bias need it).

Packed segments: `jax.nn.dot_product_attention` has no public packed-segment (offsets)
argument, so the segment mask is passed as its boolean `mask` (B, 1, L, L), which cuDNN
applies as an additive bias together with its causal mask. That is exact for any
packing, at the cost of reading an L x L bias; the causal blocks are still skipped.
"""

from __future__ import annotations

import jax

from jaxtrain.errors import UserError


def probe(device=None) -> tuple[bool, int, str]:
  """(is a CUDA GPU, max head_dim for cuDNN, platform) of the target device (default: the
  first local one); never raises on other backends."""
  if device is None:
    try:
      device = jax.devices()[0]
    except RuntimeError:
      return False, 0, "none"
  platform = device.platform
  client_platform = getattr(getattr(device, "client", None), "platform_version", "") or ""
  is_cuda = platform == "cuda" or (platform == "gpu" and "cuda" in client_platform.lower())
  if not is_cuda:
    return False, 0, platform
  major = int(str(getattr(device, "compute_capability", "0")).split(".")[0] or 0)
  return True, 256 if major >= 9 else 128, platform


def select(model_cfg, seq_len: int | None = None, gpu_info=None, device=None) -> tuple[str, str]:
  """("cudnn" | "xla", reason) for the target `device`. `gpu_info` = (is CUDA GPU, max
  head_dim) overrides the probe (tests)."""
  want = model_cfg.attention
  if want == "xla":
    return "xla", "model.attention=xla"
  if gpu_info is not None:
    is_gpu, max_e, platform = *gpu_info, "cuda" if gpu_info[0] else "cpu"
  else:
    is_gpu, max_e, platform = probe(device)
  E, dt = model_cfg.head_dim, model_cfg.dtype
  problem = None
  if not is_gpu:
    problem = f"backend is {platform}, not a CUDA GPU"
  elif dt not in ("bfloat16", "float16"):
    problem = f"model.dtype={dt} (cuDNN needs bfloat16 or float16)"
  elif E % 8 or E > max_e:
    problem = f"model.head_dim={E} (cuDNN needs a multiple of 8, at most {max_e} on this GPU)"
  elif seq_len is not None and seq_len % 2:
    problem = f"train.seq_len={seq_len} is odd (cuDNN needs it even)"
  if problem is None:
    return "cudnn", "cuDNN fused attention (causal + segment mask)"
  if want == "cudnn":
    raise UserError(f"model.attention=cudnn is not supported here: {problem}; use auto or xla")
  return "xla", f"reference XLA attention: {problem}"


def fused(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, implementation: str = "cudnn"):
  """Causal GQA with segment masking through `jax.nn.dot_product_attention`.

  implementation="xla" runs the same call on any backend (the tests check the masking
  plumbing against the reference on CPU that way)."""
  mask_Bx1xLxL = (seg_BxL[:, :, None] == seg_BxL[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask=mask_Bx1xLxL, is_causal=True,
                                      implementation=implementation).astype(q_BxLxHxE.dtype)
