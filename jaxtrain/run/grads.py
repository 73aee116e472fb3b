"""The one gradient contract of an update, for the plain step and the pipeline alike (docs/training.md#the-step).

The batch is split into k microbatches (rows i, i+k, ...: no row changes device). Each microbatch's backward runs on
its share of the update's objective

    (token losses + MoE aux * n_valid / k + mtp_weight * MTP losses * n_valid / n_mtp) * loss_scale / n_valid

(n_valid, n_mtp: the valid targets of the whole update), so the summed gradient is already the token-normalized
update's and per-token gradients stay in float16 range; each microbatch's gradient and their sum are kept in
`grad_sharding` (ZeRO pins it; jaxtrain.parallel.data_region runs an executor manual over `data`, so that the sum
is reduced over data once per update). Out come the mean token loss, the unscaled
gradient, n_valid and the MoE metrics. How the microbatches' forward and backward work is scheduled is an executor's: `accumulate` here
(a scan) or the pipeline's schedule (jaxtrain.parallel.pipeline), which runs the same `Objective` in pieces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.core.config import Config
from jaxtrain.model import loss as xent, moe_balance, mtp as mtp_lib, ops, roles
from jaxtrain.model.layers import rope_tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
  """d objective / d each summed term of one microbatch (traced scalars)."""
  ce: jax.Array  # a next-token loss: loss_scale / n_valid
  aux: jax.Array  # the microbatch's MoE aux loss (mean over MoE layers): loss_scale / k
  mtp: jax.Array  # an MTP token loss: mtp_weight * loss_scale / n_mtp


def weights(cfg: Config, batch, loss_scale) -> tuple[Weights, jax.Array]:
  """(the update's Weights, n_valid) from the whole batch."""
  m = cfg.model
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  scale = jnp.asarray(loss_scale, jnp.float32)
  ce = scale / jnp.maximum(n_valid, 1).astype(jnp.float32)
  mtp = jnp.float32(0)
  if mtp_lib.trains(cfg.model):
    n_mtp = jnp.maximum(jnp.sum(mtp_lib.targets(batch)[1] > 0), 1).astype(jnp.float32)
    mtp = m.mtp_weight * scale / n_mtp
  return Weights(ce=ce, aux=scale / cfg.train.microbatches, mtp=mtp), n_valid


class Objective:
  """One microbatch's share of the objective: whole (`__call__`), or in the pieces a pipeline schedules (its chunks
  run the model's layer stacks, `head` the terms after them, `aux` each piece's MoE share)."""

  def __init__(self, graphdef, cfg: Config):
    self.graphdef, self.cfg = graphdef, cfg

  def model(self, params):
    return nnx.merge(self.graphdef, params)

  def head(self, model, h_BxLxD, mb, w: Weights, gather: bool = True, next_emb_BxLxD=None):
    """The terms after the last block, from its final-normed output: (objective without MoE aux, token loss sum,
    the MTP block's MoE stats as a list). `gather`: the plain loss takes the target logit by a gather (else a
    one-hot product: no gather over the vocabulary's split, inside the pipeline). `next_emb_BxLxD`: the MTP
    module's target embeddings, where the caller looked them up (the pipeline, outside its region)."""
    t, m = self.cfg.train, self.cfg.model
    loss = lambda h, targets, mask, scale: xent.nll_sum(  # noqa: E731
        h, model.head_weight(), targets, mask, t.loss_chunk_tokens, m.head_logits_dtype, gather, scale)
    ce = loss(h_BxLxD, mb["targets"], mb["loss_mask"], w.ce)
    if not mtp_lib.trains(self.cfg.model):
      return w.ce * ce, ce, []
    g_BxLxD, stats = model.mtp_hidden(h_BxLxD, mb["targets"], rope_tables(mb["positions"], m), mb["segment_ids"],
                                      next_emb_BxLxD)
    mtp_sum = loss(g_BxLxD, mb["mtp_targets"], mb["mtp_mask"], w.mtp)
    return w.ce * ce + w.mtp * mtp_sum, ce, [] if stats is None else [stats]

  def aux_share(self, stats: list[dict]):
    """These MoE layers' share of the microbatch's aux loss (the mean over all `moe_balance.layer_count` layers;
    Hugging Face's convention pools them, so there `stats` must be all of them)."""
    return moe_balance.layer_aux(self.cfg.model, stats, moe_balance.layer_count(self.cfg.model))

  def aux(self, stats: list[dict], w: Weights):
    """These MoE layers' part of the objective."""
    return w.aux * self.aux_share(stats) if stats else 0.0

  def __call__(self, params, mb, w: Weights):
    """(objective, (token loss sum, MoE totals)) of the whole model on one microbatch."""
    model = self.model(params)
    h_BxLxD, stats = model.hidden(mb["inputs"], mb["positions"], mb["segment_ids"])
    out, ce, head_stats = self.head(model, h_BxLxD, mb, w)
    stats = stats + head_stats
    return out + self.aux(stats, w), (ce, moe_balance.totals(self.cfg.model, stats))

  def zero_totals(self) -> dict:
    """The statistics an executor sums over the microbatches (the second part of `__call__`'s aux), as zeros."""
    return moe_balance.zero_totals(self.cfg.model)

  def loss_sum(self, params, mb):
    """The microbatch's summed next-token loss alone (evaluation)."""
    model = self.model(params)
    h_BxLxD, _ = model.hidden(mb["inputs"], mb["positions"], mb["segment_ids"])
    return xent.nll_sum(h_BxLxD, model.head_weight(), mb["targets"], mb["loss_mask"], self.cfg.train.loss_chunk_tokens,
                        self.cfg.model.head_logits_dtype)


def with_mtp_targets(cfg: Config, batch):
  """The batch with the MTP module's targets and mask (t_{i+2}), shifted once for the whole update: a shift along
  the length inside the step would move data between the devices that split it (a collective-permute, which XLA:CPU
  cannot run inside the pipeline's last-stage branch)."""
  if not mtp_lib.trains(cfg.model):
    return batch
  t2_BxL, m2_BxL = mtp_lib.targets(batch)
  return {**batch, "mtp_targets": t2_BxL, "mtp_mask": m2_BxL}


def split_microbatches(batch, k: int):
  """(B, L) -> (k, B/k, L), microbatch i = rows i, i+k, ... so no row changes device."""
  def split(x_BxL):
    B, L = x_BxL.shape
    return ops.constrain(x_BxL.reshape(B // k, k, L).swapaxes(0, 1), (None, "batch", "length"))
  return jax.tree.map(split, batch)


def accumulate(objective: Objective, params, mbs, w: Weights, grad_sharding=None):
  """The plain executor: a scan over the microbatches, each one's value and gradient, summed:
  (token loss sum, scaled gradient sum, MoE totals sum); every gradient kept in `grad_sharding` (None: as XLA
  likes). The gradient is the trained parameters' (`roles.split`: with LoRA the adapters', else all)."""
  keep = (lambda g: jax.lax.with_sharding_constraint(g, grad_sharding)) if grad_sharding is not None else (
      lambda g: g)
  trained, frozen = roles.split(objective.cfg.model, params)  # LoRA: the gradient of the adapters alone
  value_and_grad = jax.value_and_grad(lambda t, mb: objective(roles.join(t, frozen), mb, w), has_aux=True)

  def body(carry, mb):
    loss_sum, grad_sum, moe_sum = carry
    (_, (ce, moe)), g = value_and_grad(trained, mb)
    return (loss_sum + ce, jax.tree.map(jnp.add, grad_sum, keep(g)), jax.tree.map(jnp.add, moe_sum, moe)), None

  init = (jnp.float32(0), keep(jax.tree.map(jnp.zeros_like, trained)), objective.zero_totals())
  return jax.lax.scan(body, init, mbs)[0]


def forward(objective: Objective, params, mbs):
  """The plain executor without gradients: the summed next-token loss of the microbatches."""
  return jax.lax.scan(lambda total, mb: (total + objective.loss_sum(params, mb), None), jnp.float32(0), mbs)[0]


def grads(objective: Objective, params, batch, loss_scale=1.0, grad_sharding=None, executor=accumulate):
  """(mean token loss, unscaled gradient, n_valid, MoE metrics) of one update, by `executor` (default: the scan)."""
  k = objective.cfg.train.microbatches
  w, n_valid = weights(objective.cfg, batch, loss_scale)
  mbs = split_microbatches(with_mtp_targets(objective.cfg, batch), k)
  loss_sum, g, moe = executor(objective, params, mbs, w, grad_sharding)
  g = jax.tree.map(lambda x: x / jnp.asarray(loss_scale, x.dtype), g)
  return loss_sum / jnp.maximum(n_valid, 1), g, n_valid, moe_balance.update_metrics(moe, k)


def evaluate(objective: Objective, params, batch, executor=forward):
  """Loss-only pass, microbatched like the train step (it fits wherever training fits): summed per-token loss and
  valid-token count, so that batches add up exactly."""
  loss_sum = executor(objective, params, split_microbatches(batch, objective.cfg.train.microbatches))
  n_valid = jnp.sum(batch["loss_mask"] > 0)
  return {"loss": loss_sum / jnp.maximum(n_valid, 1), "loss_sum": loss_sum, "tokens": n_valid}
