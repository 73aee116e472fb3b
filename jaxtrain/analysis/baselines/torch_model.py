"""jaxtrain's dense model the usual PyTorch way: torch.compile, SDPA attention (plain causal, so
one document per row), fused AdamW on CUDA. Imported only by `--baseline torch` (the `bench` extra)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxtrain.model import roles


class RMSNorm(nn.Module):

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.scale, self.eps = nn.Parameter(torch.ones(dim)), eps

  def forward(self, x):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)


def rope(x, pos, theta: float):
  """x (B, N, L, E); pairs are (first half, second half) of E, as in jaxtrain."""
  half = x.shape[-1] // 2
  freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
  ang = (pos.float()[..., None] * freq)[:, None]  # (B, 1, L, E/2)
  cos, sin = ang.cos(), ang.sin()
  h = x.float()
  a, b = h[..., :half], h[..., half:]
  return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(x.dtype)


class Block(nn.Module):

  def __init__(self, m):
    super().__init__()
    D, H, K, F_ = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.d_ff
    self.m = m
    self.attn_norm, self.mlp_norm = RMSNorm(D, m.norm_eps), RMSNorm(D, m.norm_eps)
    for name, n_in, n_out in (("wq", D, H), ("wk", D, K), ("wv", D, K), ("wo", H, D), ("w_gate", D, F_),
                              ("w_up", D, F_), ("w_down", F_, D)):
      setattr(self, name, nn.Linear(n_in, n_out, bias=False))

  def forward(self, x, pos):
    m = self.m
    B, L, _ = x.shape
    h = self.attn_norm(x)
    q = rope(self.wq(h).view(B, L, m.n_heads, m.head_dim).transpose(1, 2), pos, m.rope_theta)
    k = rope(self.wk(h).view(B, L, m.n_kv_heads, m.head_dim).transpose(1, 2), pos, m.rope_theta)
    v = self.wv(h).view(B, L, m.n_kv_heads, m.head_dim).transpose(1, 2)
    G = m.n_heads // m.n_kv_heads  # query head i reads kv head i // G
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.wo(o.transpose(1, 2).reshape(B, L, -1))
    h = self.mlp_norm(x)
    return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Transformer(nn.Module):

  def __init__(self, m):
    super().__init__()
    self.m = m
    self.embed = nn.Embedding(m.vocab_size, m.d_model)
    self.layers = nn.ModuleList([Block(m) for _ in range(m.n_layers)])
    self.final_norm = RMSNorm(m.d_model, m.norm_eps)
    if not m.tie_embeddings:
      self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)

  def forward(self, tokens, pos):
    x = self.embed(tokens)
    for block in self.layers:
      x = block(x, pos)
    return F.linear(self.final_norm(x), self.embed.weight if self.m.tie_embeddings else self.lm_head.weight)


def load_jax_params(model: Transformer, params) -> None:
  """Copies jaxtrain's pure dict (numpy-convertible leaves) into the torch model. jaxtrain's
  projections are (in..., out...): (D, N, E), (H, E, D), (D, F); nn.Linear's are (out, in)."""
  def put(dst, src, linear=False, in_first=False):
    a = np.asarray(src, np.float32)
    if linear:  # wo (H, E, D) -> (D, H*E); the others (D, ...) -> (..., D)
      a = a.reshape(-1, a.shape[-1]).T if in_first else a.reshape(a.shape[0], -1).T
    with torch.no_grad():
      dst.copy_(torch.from_numpy(np.array(a, copy=True, order="C")))

  put(model.embed.weight, params["embed"])
  put(model.final_norm.scale, params["final_norm"]["scale"])
  if not model.m.tie_embeddings:
    put(model.lm_head.weight, params["lm_head"], linear=True)
  for i, block in enumerate(model.layers):
    p = params["layers"][i]
    for group, names in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("w_gate", "w_up", "w_down"))):
      for name in names:
        put(getattr(block, name).weight, p[group][name], linear=True, in_first=name == "wo")
    for name in ("attn_norm", "mlp_norm"):
      put(getattr(block, name).scale, p[name]["scale"])


def loss_fn(model, batch, dtype):
  """Mean next-token cross-entropy over the valid targets. Under autocast the head's matmul returns bfloat16
  logits (jaxtrain's model.head_logits_dtype=bfloat16); softmax and loss run in float32."""
  with torch.autocast(batch["inputs"].device.type, dtype=dtype, enabled=dtype != torch.float32):
    logits = model(batch["inputs"], batch["positions"])
  nll = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), reduction="none")
  mask = batch["loss_mask"].flatten().float()
  return (nll * mask).sum() / mask.sum().clamp(min=1)


def lr_lambda(t, steps: int):
  """jaxtrain's schedule as a multiplier of t.lr: linear warmup, then cosine to min_lr_ratio at `steps`."""
  def f(s):
    if s < t.warmup_steps:
      return (s + 1) / max(t.warmup_steps, 1)
    progress = min(max((s - t.warmup_steps) / max(steps - t.warmup_steps, 1), 0.0), 1.0)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
  return f


class TorchBaseline:
  """`step(batch)` -> loss tensor (one optimizer update); the model and optimizer live inside."""

  def __init__(self, cfg, params, device: str = "cpu", compile: bool = True):  # noqa: A002
    if device == "cuda" and not torch.cuda.is_available():
      raise ValueError("the torch baseline was asked to run on a GPU, but this torch build has no CUDA")
    t = cfg.optim
    self.device, self.dtype, self.clip = torch.device(device), getattr(torch, cfg.model.dtype), t.grad_clip
    self.model = Transformer(cfg.model).to(self.device)  # fp32 master weights, as jaxtrain
    load_jax_params(self.model, params)
    named = list(self.model.named_parameters())
    # jaxtrain's role table decides: "layers.0.wq.weight" is jaxtrain's wq, "final_norm.scale" a norm scale
    decay = lambda n: roles.decayed(n.split(".")[-2] if n.endswith(".weight") else n.split(".")[-1])  # noqa: E731
    groups = [{"params": [p for n, p in named if decay(n)], "weight_decay": t.weight_decay},
              {"params": [p for n, p in named if not decay(n)], "weight_decay": 0.0}]
    self.opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.b1, t.b2), eps=t.eps, fused=self.device.type == "cuda")
    self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(t, cfg.train.steps))
    self.loss = torch.compile(loss_fn) if compile else loss_fn

  def to_device(self, batch: dict) -> dict:
    seg = np.asarray(batch["segment_ids"])
    if (seg != seg[:, :1]).any():
      raise ValueError("the torch baseline takes one document per row (unpacked batch)")
    return {k: torch.from_numpy(np.asarray(batch[k], np.int64)).to(self.device)
            for k in ("inputs", "targets", "loss_mask", "positions")}

  def peak_memory(self) -> int | None:
    return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

  def step(self, batch: dict):
    loss = self.loss(self.model, batch, self.dtype)
    loss.backward()
    if self.clip > 0:
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    self.sched.step()
    self.opt.zero_grad(set_to_none=True)
    return loss.detach()
