"""KV-cached decoding with the training model itself (`Transformer.decode`) on the same
parameter shardings: one pass over the (left-padded) prompts fills the cache, then one
token per step; greedy at temperature 0, else nucleus sampling."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core.errors import UserError
from jaxtrain.model import ops, transformer as model_lib
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


def generate(cfg, mesh, graphdef, params, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, timing: dict | None = None) -> list[list[int]]:
  """New token ids for each prompt (cut after EOS when `eos_id` is given). `timing`, if
  given, receives the decode rate once both steps are compiled."""
  n = len(prompts)
  # The batch splits over the mesh's batch axes: pad it with copies of the first prompt, whose rows are dropped.
  prompts = prompts + prompts[:1] * (-n % math.prod(mesh.shape[a] for a in sharding.RULES["batch"]))
  B, P = len(prompts), max(len(p) for p in prompts)
  check_fits(cfg, mesh, params, B, P + max_new_tokens)  # before the cache exists
  tokens, seg, pos = (np.zeros((B, P), np.int32) for _ in range(3))
  for b, p in enumerate(prompts):  # left-padded: padding has segment 0, positions count from the first real token
    tokens[b, P - len(p):], seg[b, P - len(p):], pos[b, P - len(p):] = p, 1, np.arange(len(p))
  lengths = np.array([len(p) for p in prompts], np.int32)
  new_cache, first, next_ = _functions(cfg, mesh, graphdef, B, P + max_new_tokens)
  key, knobs = jax.random.key(seed), (np.float32(temperature), np.float32(top_p))
  tok, cache = first(params, tokens, pos, seg, new_cache(), jax.random.fold_in(key, 0), *knobs)
  out = [np.asarray(tok)[:n]]
  done = np.zeros(n, bool) if eos_id is None else out[-1] == eos_id
  warm, shown = None, [time.perf_counter(), False]
  for t in range(1, max_new_tokens):
    if done.all():
      break
    _progress(t, max_new_tokens, shown)
    tok, cache = next_(params, tok, jnp.asarray(lengths + t - 1), cache, jax.random.fold_in(key, t), *knobs)
    out.append(np.asarray(tok)[:n])
    warm = warm or time.perf_counter()  # from t == 1: both functions compiled
    if eos_id is not None:
      done |= out[-1] == eos_id
  if shown[1] and sys.stderr.isatty():
    print("\r\x1b[K", end="", file=sys.stderr)  # erase the progress line
  if timing is not None:
    timing["positions"] = P + max_new_tokens
  if timing is not None and warm is not None and len(out) > 2:
    timing.update(decode_steps=len(out) - 2, decode_s=time.perf_counter() - warm, batch=n)
  rows = np.stack(out, 1).tolist()
  return [r[:r.index(eos_id) + 1] if eos_id is not None and eos_id in r else r for r in rows]


def _progress(t: int, total: int, shown: list) -> None:
  """Progress of a long generation on stderr: redrawn each second on a terminal, one line a minute
  elsewhere (quiet logs). `shown`: [when last shown, whether ever]."""
  tty, now = sys.stderr.isatty(), time.perf_counter()
  if now - shown[0] > (1 if tty else 60):
    print(f"\rgenerating: {t}/{total} tokens" if tty else f"generating: {t}/{total} tokens", end="" if tty else "\n",
          file=sys.stderr, flush=True)
    shown[:] = [now, True]


def context_limit(cfg, workdir: Path) -> tuple[int, str]:
  """(most positions one sequence may hold, where that figure comes from): an imported model's
  max_position_embeddings, else the llama3 scaling's extended context, else the trained length."""
  kept = Path(workdir) / "hf" / "config.json"
  try:
    limit = json.loads(kept.read_text()).get("max_position_embeddings")
  except (OSError, ValueError, AttributeError):
    limit = None
  if isinstance(limit, int) and limit > 0:
    return limit, f"max_position_embeddings in {kept}"
  m = cfg.model
  if m.rope_scaling in ("llama3", "yarn"):
    return int(m.rope_original_max_position * m.rope_factor), "model.rope_original_max_position x model.rope_factor"
  return cfg.train.seq_len, "train.seq_len, the length it was trained at"


def cache_layout(cfg, mesh, B: int, S: int):
  """(shapes, shardings) of the KV cache of B rows of S slots: split like the activations it
  holds (batch over the batch axes, kv heads over tensor)."""
  lead = ("layers",) if model_lib.stacked_cache(cfg.model) else ()

  def spec(path, x):
    if x.ndim == 0:
      return NamedSharding(mesh, P())
    heads = ("act_kv_heads", None) if path[-1].key in ("k", "v") else (None,)  # MLA's latent: no heads
    return sharding.logical_sharding(mesh, ("batch", None) if x.ndim == 2 else (*lead, "batch", None, *heads),
                                     x.shape)
  shapes = jax.eval_shape(lambda: model_lib.init_cache(cfg.model, B, S))
  return shapes, jax.tree_util.tree_map_with_path(spec, shapes)


def cache_bytes(cfg, S: int) -> int:
  """The KV cache of one row of S positions over all layers: K and V (a local layer's: its window's at most), or
  MLA's latent and RoPE key; the segment ids beside them."""
  return sum(math.prod(x.shape) * x.dtype.itemsize
             for x in jax.tree.leaves(jax.eval_shape(lambda: model_lib.init_cache(cfg.model, 1, S))))


def cache_bytes_per_token(cfg) -> int:
  """What the cache holds per token over all layers without sliding windows: K and V, or MLA's latent and RoPE
  key."""
  one = [v for k, v in jax.eval_shape(lambda: model_lib.init_cache(
      dataclasses.replace(cfg.model, sliding_window=0), 1, 1)).items() if "layers" in k]
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(one))


def cache_words(cfg, S: int) -> str:
  """The cache's size as generate reports it: per token, or with sliding windows the whole row's beside what it
  would be without them."""
  if not cfg.model.sliding_window:
    return f"cache {cache_bytes_per_token(cfg):,} bytes per token"
  no_window = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, sliding_window=0))
  local = sum(1 for w in cfg.model.layer_windows() if w)
  return (f"cache {cache_bytes(cfg, S):,} bytes per row for {S} positions ({local} local layer(s) keep their last "
          f"{cfg.model.sliding_window} tokens; {cache_bytes(no_window, S):,} without the window)")


def check_fits(cfg, mesh, params, B: int, S: int) -> None:
  """A UserError (one line) when the KV cache of B rows of S slots does not fit one device
  beside the parameters; nothing when the device's memory is not known."""
  from jaxtrain.analysis import fit, memory
  have, source = fit.capacity(mesh)
  if have is None:
    return
  shapes, shardings = cache_layout(cfg, mesh, B, S)
  per_device = lambda shape, dtype, sh: math.prod(sh.shard_shape(shape)) * np.dtype(dtype).itemsize  # noqa: E731
  cache = sum(jax.tree.leaves(jax.tree.map(lambda x, sh: per_device(x.shape, x.dtype, sh), shapes, shardings)))
  weights = sum(per_device(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(params))
  if cache + weights > have:
    raise UserError(f"generating {S} positions for {B} row(s) needs a {memory.human(cache)} KV cache per device "
                    f"beside {memory.human(weights)} of parameters, {memory.human(have)} available ({source}); "
                    "lower --max-new-tokens or the number of prompts")


def from_checkpoint(cfg, mesh, step_dir, prompts: list[list[int]], max_new_tokens: int, **kw):
  """(new ids per prompt, a one-line summary) with the parameters of `step_dir`, as `generate`."""
  from jaxtrain.run import runs
  t0 = time.perf_counter()
  setup, params = runs.restore_params(cfg, mesh, step_dir)
  t1, timing = time.perf_counter(), {}
  out = generate(cfg, mesh, setup.graphdef, params, prompts, max_new_tokens, timing=timing, **kw)
  dt = time.perf_counter() - t1
  rate = (f"; decoding {timing['batch'] * timing['decode_steps'] / timing['decode_s']:.1f} tokens/s once compiled"
          if "decode_s" in timing else "")
  return out, (f"generated {sum(map(len, out))} tokens for {len(out)} prompt(s) in {dt:.2f}s (compiles included"
               f"{rate}; {cache_words(cfg, timing['positions'])}; loaded step {step_dir.name} in "
               f"{t1 - t0:.1f}s)")


@functools.lru_cache(maxsize=8)
def _functions(cfg, mesh, graphdef, B: int, S: int):
  """(empty cache, prompt pass, one-token step), jitted once per shape."""
  cache_sh = cache_layout(cfg, mesh, B, S)[1]
  plan = plan_lib.build(cfg, mesh)

  def step(params, tokens, pos, seg, cache, key, temperature, top_p):
    with ops.use(plan):
      logits, cache = nnx.merge(graphdef, params).decode(tokens, pos, seg, cache)
    return sample(logits[:, -1], key, temperature, top_p), cache

  def next_(params, tok_B, pos_B, cache, key, temperature, top_p):
    return step(params, tok_B[:, None], pos_B[:, None], jnp.ones_like(tok_B)[:, None], cache, key, temperature, top_p)

  return (jax.jit(lambda: model_lib.init_cache(cfg.model, B, S), out_shardings=cache_sh),
          jax.jit(step, out_shardings=(None, cache_sh), donate_argnums=4),
          jax.jit(next_, out_shardings=(None, cache_sh), donate_argnums=3))
