"""KV-cached decoding with the training model itself (`Transformer.decode`) on the same
parameter shardings: one pass over the (left-padded) prompts fills the cache, then one
token per step; greedy at temperature 0, else nucleus sampling."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import transformer as model_lib
from jaxtrain.parallel import plan as plan_lib, sharding


def sample(logits_BxV, key, temperature, top_p):
  """Next token ids (B,): argmax at temperature 0, else nucleus sampling. Both settings may
  be traced, so one compiled step serves every setting."""
  greedy = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV / jnp.where(temperature > 0, temperature, 1.0)
  sorted_BxV = jnp.sort(logits, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_BxV, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
  cutoff = jnp.min(jnp.where(before < top_p, sorted_BxV, jnp.inf), axis=-1, keepdims=True)  # top token always kept
  sampled = jax.random.categorical(key, jnp.where(logits >= cutoff, logits, -jnp.inf), axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy)


def _cache_shardings(cfg, mesh, B: int, S: int, cache):
  """KV caches split like the activations they hold: batch over the batch axes, kv heads over tensor."""
  lead = ("layers",) if cfg.model.scan_layers else ()

  def one(x):
    if x.ndim == 0:
      return NamedSharding(mesh, P())
    if x.ndim == 2:
      return sharding.logical_sharding(mesh, ("batch", None), x.shape)
    return sharding.logical_sharding(mesh, (*lead, "batch", None, "act_kv_heads", None), x.shape)
  return jax.tree.map(one, cache)


def generate(cfg, mesh, graphdef, params, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, timing: dict | None = None) -> list[list[int]]:
  """New token ids for each prompt (cut after EOS when `eos_id` is given). `timing`, if
  given, receives the decode rate once both steps are compiled."""
  B, P = len(prompts), max(len(p) for p in prompts)
  S = P + max_new_tokens
  tokens = np.zeros((B, P), np.int32)
  seg = np.zeros((B, P), np.int32)
  pos = np.zeros((B, P), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, P - len(p):] = p
    seg[b, P - len(p):] = 1
    pos[b, P - len(p):] = np.arange(len(p))
  lengths = np.array([len(p) for p in prompts], np.int32)
  new_cache, first, next_ = _functions(cfg, mesh, graphdef, B, S)
  key, knobs = jax.random.key(seed), (np.float32(temperature), np.float32(top_p))
  tok, cache = first(params, tokens, pos, seg, new_cache(), jax.random.fold_in(key, 0), *knobs)
  out = [np.asarray(tok)]
  done = np.zeros(B, bool) if eos_id is None else out[-1] == eos_id
  warm = None
  for t in range(1, max_new_tokens):
    if done.all():
      break
    tok, cache = next_(params, tok, jnp.asarray(lengths + t - 1), cache, jax.random.fold_in(key, t), *knobs)
    out.append(np.asarray(tok))
    if t == 1:
      warm = time.perf_counter()  # both functions compiled
    if eos_id is not None:
      done |= out[-1] == eos_id
  if timing is not None and warm is not None and len(out) > 2:
    timing.update(decode_steps=len(out) - 2, decode_s=time.perf_counter() - warm, batch=B)
  ids = np.stack(out, 1)
  result = []
  for row in ids.tolist():
    if eos_id is not None and eos_id in row:
      row = row[:row.index(eos_id) + 1]
    result.append(row)
  return result


@functools.lru_cache(maxsize=8)
def _functions(cfg, mesh, graphdef, B: int, S: int):
  """(empty cache, prompt pass, one-token step), jitted once per shape."""
  cache_sh = _cache_shardings(cfg, mesh, B, S, jax.eval_shape(lambda: model_lib.init_cache(cfg.model, B, S)))
  plan = plan_lib.build(cfg, mesh)

  def run(params, tokens, pos, seg, cache):
    return nnx.merge(graphdef, params).decode(tokens, pos, seg, cache, plan)

  def first(params, tokens, pos, seg, cache, key, temperature, top_p):
    logits, cache = run(params, tokens, pos, seg, cache)
    return sample(logits[:, -1], key, temperature, top_p), cache

  def next_(params, tok_B, pos_B, cache, key, temperature, top_p):
    logits, cache = run(params, tok_B[:, None], pos_B[:, None], jnp.ones_like(tok_B)[:, None], cache)
    return sample(logits[:, -1], key, temperature, top_p), cache

  return (jax.jit(lambda: model_lib.init_cache(cfg.model, B, S), out_shardings=cache_sh),
          jax.jit(first, out_shardings=(None, cache_sh), donate_argnums=4),
          jax.jit(next_, out_shardings=(None, cache_sh), donate_argnums=3))
