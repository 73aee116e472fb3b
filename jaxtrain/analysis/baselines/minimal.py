"""A hand-written `jax.jit` train step of jaxtrain's dense model on one device, as a user would
write it: no mesh, no microbatches, no skipped-step guard, no loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.model import roles


def rms_norm(x, scale, eps):
  h = x.astype(jnp.float32)
  return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def rope(x, pos, theta):
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  ang = (pos.astype(jnp.float32)[..., None] * freq)[:, :, None, :]
  h = x.astype(jnp.float32)
  a, b = h[..., :half], h[..., half:]
  return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang), b * jnp.cos(ang) + a * jnp.sin(ang)], -1).astype(x.dtype)


def forward(p, m, tokens, pos, seg):
  """float32 logits (B, L, V) of the Llama-shaped model described by config `m`."""
  dt = jnp.dtype(m.dtype)
  B, L = tokens.shape
  G = m.n_heads // m.n_kv_heads
  mask = jnp.tril(jnp.ones((L, L), bool)) & (seg[:, :, None] == seg[:, None, :])
  x = p["embed"][tokens].astype(dt)
  for i in range(m.n_layers):
    lp = p["layers"][i]
    a, f = lp["attn"], lp["mlp"]
    h = rms_norm(x, lp["attn_norm"]["scale"], m.norm_eps)
    q = rope(jnp.einsum("bld,dhe->blhe", h, a["wq"].astype(dt)), pos, m.rope_theta)
    k = rope(jnp.einsum("bld,dke->blke", h, a["wk"].astype(dt)), pos, m.rope_theta)
    v = jnp.einsum("bld,dke->blke", h, a["wv"].astype(dt))
    q = q.reshape(B, L, m.n_kv_heads, G, m.head_dim)
    s = jnp.einsum("blkge,bmke->bkglm", q, k, preferred_element_type=jnp.float32) * m.head_dim**-0.5
    s = jnp.where(mask[:, None, None], s, -1e30)
    o = jnp.einsum("bkglm,bmke->blkge", jax.nn.softmax(s, -1).astype(dt), v).reshape(B, L, m.n_heads, m.head_dim)
    x = x + jnp.einsum("blhe,hed->bld", o, a["wo"].astype(dt))
    h = rms_norm(x, lp["mlp_norm"]["scale"], m.norm_eps)
    x = x + (jax.nn.silu(h @ f["w_gate"].astype(dt)) * (h @ f["w_up"].astype(dt))) @ f["w_down"].astype(dt)
  x = rms_norm(x, p["final_norm"]["scale"], m.norm_eps)
  w = p["embed"].T if m.tie_embeddings else p["lm_head"]
  return jnp.einsum("bld,dv->blv", x, w.astype(dt), preferred_element_type=jnp.float32)


def loss_fn(p, m, batch):
  """Mean next-token cross-entropy over the valid targets of the batch."""
  logits = forward(p, m, batch["inputs"], batch["positions"], batch["segment_ids"])
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_optimizer(t, steps: int):
  """Global-norm clipping, then AdamW (decay on projections), warmup + cosine LR to its floor at `steps`."""
  def lr(s):
    s = jnp.asarray(s, jnp.float32)
    progress = jnp.clip((s - t.warmup_steps) / max(steps - t.warmup_steps, 1), 0.0, 1.0)
    cosine = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return jnp.where(s < t.warmup_steps, t.lr * (s + 1) / max(t.warmup_steps, 1), cosine)

  decay = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: roles.decayed(roles.keys_of(path)[-1]), p)
  adamw = optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay)
  return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw


class Minimal:
  """`init(params)` -> state; `step(state, batch)` -> (state, loss), jitted, state donated."""

  def __init__(self, cfg):
    self.m, self.opt = cfg.model, make_optimizer(cfg.optim, cfg.train.steps)

    def step(state, batch):
      params, opt_state = state
      loss, g = jax.value_and_grad(loss_fn)(params, self.m, batch)
      updates, opt_state = self.opt.update(g, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    self.step = jax.jit(step, donate_argnums=0)

  def init(self, params, device=None):
    params = jax.device_put(params, device or jax.devices()[0])
    return params, self.opt.init(params)
