"""Ulysses sequence parallelism: attention as a resharding. q/k/v arrive split along the length over `sequence`;
sharding constraints move that split onto the heads (XLA makes them all-to-alls), the plan's kernel runs on whole
sequences of its share of heads (cuDNN on a GPU), and one more constraint moves the output back to the length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core.errors import UserError
from jaxtrain.parallel import sharding


def head_ways(rules, n_heads: int, mesh) -> tuple[int, int]:
  """(tensor ways of the query heads, sequence size): their product splits the heads in attention."""
  tp = sharding.ways(sharding.spec_for(("act_heads",), (n_heads,), mesh, rules=rules)[0], mesh)
  return tp, mesh.shape["sequence"]


def check(n_heads: int, n_kv_heads: int, tp: int, sp: int) -> None:
  """A split of the query heads that cannot work is a one-line error naming the head counts."""
  if n_heads % (tp * sp):
    with_tp = f" x tensor={tp}" if tp > 1 else ""
    fits = [n for n in range(1, n_heads + 1) if (n_heads // tp) % n == 0]
    raise UserError(f"model.sequence_attention=ulysses splits the query heads over sequence={sp}{with_tp}, but "
                    f"model.n_heads={n_heads} (n_kv_heads={n_kv_heads}) is not a multiple of {tp * sp}; sequence "
                    f"sizes that work: {', '.join(map(str, fits))} (or model.sequence_attention=ring)")


def kv_repeat(n_heads: int, n_kv_heads: int, ways: int) -> int:
  """How many times each KV head is repeated so that the KV heads split `ways` ways and each query head's group
  stays whole (GQA with fewer KV heads than the degree); 1 where they split already."""
  return next(r for r in range(1, n_heads // n_kv_heads + 1)
              if (n_kv_heads * r) % ways == 0 and n_heads % (n_kv_heads * r) == 0)


def describe(model_cfg, mesh, rules) -> str:
  """The plan's words for ulysses on `mesh` (a split that cannot work: UserError)."""
  H, K = model_cfg.n_heads, model_cfg.n_kv_heads
  tp, sp = head_ways(rules, H, mesh)
  check(H, K, tp, sp)
  r = kv_repeat(H, K, tp * sp)
  return (f"ulysses over sequence={sp}: all-to-alls to whole sequences, {H // (tp * sp)} of {H} query heads per "
          f"device" + (f", KV heads repeated x{r}" if r > 1 else ""))


def attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, plan, logits_dtype: str = "float32", window: int = 0,
           sinks_H=None):
  """Causal GQA with segment masking over the plan's sequence axis: reshard to heads, local kernel (with the
  layer's `window`, and each device's share of the sinks), reshard back."""
  mesh, AXIS = plan.mesh, plan.sequence_axis
  q_spec = plan.spec(("batch", "length", "act_heads", None), q_BxLxHxE.shape)
  if q_spec[1] != AXIS:
    raise ValueError(f"ulysses attention needs the length axis on {AXIS!r}; got spec {q_spec}")
  H, K = q_BxLxHxE.shape[2], k_BxLxKxE.shape[2]
  heads = (*sharding.axes_of(q_spec[2]), AXIS)  # tensor-major: an all-to-all within each tensor group
  r = kv_repeat(H, K, sharding.ways(heads, mesh))
  k_BxLxRxE, v_BxLxRxE = k_BxLxKxE, v_BxLxKxE
  if r > 1:  # each device repeats its own KV heads (partitioned, XLA would gather them first)
    kv_spec = plan.spec(("batch", "length", "act_kv_heads", None), k_BxLxKxE.shape)
    k_BxLxRxE, v_BxLxRxE = jax.shard_map(
        lambda *kv: [_repeat(x, r, K * r // sharding.ways(q_spec[2], mesh), q_spec[2]) for x in kv], mesh=mesh,
        in_specs=(kv_spec, kv_spec), out_specs=[P(*kv_spec[:2], q_spec[2], None)] * 2)(k_BxLxKxE, v_BxLxKxE)
  head_spec, seg_spec = P(q_spec[0], None, heads, None), P(q_spec[0], None)  # whole sequences, a share of heads
  to_heads = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, head_spec))  # noqa: E731
  # check_vma: the kernel is all local, so the transpose needs no psum over the axes the specs leave out
  kernel = lambda q, k, v, seg, *sinks: plan.local_attend(q, k, v, seg, logits_dtype, window, *sinks)  # noqa: E731
  sinks = () if sinks_H is None else (sinks_H,)  # each device gets its heads' sinks
  specs = (head_spec, head_spec, head_spec, seg_spec, *(P(heads),) * len(sinks))
  args = (to_heads(q_BxLxHxE), to_heads(k_BxLxRxE), to_heads(v_BxLxRxE), seg_BxL, *sinks)
  o_BxLxHxE = jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=head_spec)(*args)
  return jax.lax.with_sharding_constraint(o_BxLxHxE, NamedSharding(mesh, q_spec))


def _repeat(x_BxLxKxE, r: int, keep: int, tensor):
  """Each KV head r times; where the KV heads are replicated over tensor, this tensor shard's `keep` of them."""
  x_BxLxRxE = jnp.repeat(x_BxLxKxE, r, axis=2)
  if x_BxLxRxE.shape[2] == keep:
    return x_BxLxRxE
  return jax.lax.dynamic_slice_in_dim(x_BxLxRxE, jax.lax.axis_index(sharding.axes_of(tensor)) * keep, keep, axis=2)


def traffic_per_layer(cfg, mesh, rules) -> int:
  """All-to-all bytes per device of one layer and one microbatch: q, the repeated k and v and the output forward,
  their gradients backward, each (n-1)/n of its local shard; remat full or save_dots recomputes the forward ones
  (XLA:CPU and XLA:GPU show 12 per layer; save_named keeps 8). A split that cannot work: UserError."""
  m = cfg.model
  tp, sp = head_ways(rules, m.n_heads, mesh)
  check(m.n_heads, m.n_kv_heads, tp, sp)
  R = m.n_kv_heads * kv_repeat(m.n_heads, m.n_kv_heads, tp * sp)
  per_token = (2 * m.n_heads + 2 * R) // tp * m.head_dim * jnp.dtype(m.dtype).itemsize
  passes = 3 if m.remat in ("full", "save_dots") else 2
  return int(passes * sharding.tokens_per_device(cfg, mesh) * per_token * (sp - 1) / sp)
