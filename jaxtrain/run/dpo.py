"""Direct Preference Optimization (train.objective=dpo; docs/training.md#dpo): TRL's sigmoid loss

    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))   averaged over the update's pairs

from per-sequence log-probabilities (the sum of log p(target) over a response's tokens, the loss mask) of the
policy (pi) and of the reference (ref): the frozen starting parameters, held in the train state as "ref" in the
compute dtype (no master, no optimizer state) and only run forward. With LoRA the reference is the policy's own
frozen base with the adapters off (`lora.without_adapters`): no second copy is held.

Rows 2i, 2i + 1 of a batch are the chosen and rejected sequences of one pair (jaxtrain.data.pairs). Microbatch i
takes pairs i, i + k, ... (`split_pairs`: as grads.split_microbatches does with rows, no row changes device), and
`check` refuses a split that would put a pair's two rows on two devices. The loss is a mean over pairs, so each
microbatch's objective is its pairs' loss sum * loss_scale / pairs of the update, and the executors of the gradient
contract (grads.accumulate, data_region.once_over_data) run it unchanged."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxtrain.core.config import Config
from jaxtrain.core.errors import UserError
from jaxtrain.model import lora, loss as xent, mtp as mtp_lib, ops, roles
from jaxtrain.parallel import sharding
from jaxtrain.run import checkpoint, grads as grads_lib

STATS = ("chosen", "rejected", "correct")  # per-update sums over pairs: rewards, reward_c > reward_r


def active(cfg: Config) -> bool:
  return cfg.train.objective == "dpo"


def holds_reference(cfg: Config) -> bool:
  """Whether the train state keeps the reference ("ref"): DPO without LoRA (with it, the base is the reference)."""
  return active(cfg) and not cfg.model.lora_rank


def reference_of(state: dict, params):
  """The reference's parameters: the state's copy, or under LoRA the policy's (`params`) with the adapters off."""
  return state["ref"] if "ref" in state else lora.without_adapters(params)


def check(cfg: Config, mesh) -> None:
  """What DPO does not run with, one line each."""
  t, m = cfg.train, cfg.model
  if not active(cfg):
    return
  other = (f"a pipeline mesh (pipeline={mesh.shape['pipeline']})" if mesh.shape["pipeline"] > 1
           else f"model.mtp_layers={m.mtp_layers}" if mtp_lib.trains(m)
           else f"model.moe_experts={m.moe_experts}" if m.moe_experts
           else f"train.eval_interval={t.eval_interval}" if t.eval_interval
           else f"optim.offload={cfg.optim.offload}" if cfg.optim.offload != "none" else None)
  if other:
    raise UserError(f"train.objective=dpo does not run with {other}")
  ways = math.prod(mesh.shape[a] for a in sharding.RULES["batch"])
  rows = t.batch_size // t.microbatches // ways
  if rows % 2:
    raise UserError(f"train.objective=dpo keeps a pair's two sequences on one device: train.batch_size="
                    f"{t.batch_size} / train.microbatches={t.microbatches} / data*fsdp*expert={ways} = {rows} rows per "
                    "device per microbatch must be even")


def check_start(cfg: Config, step_dir, manifest: dict) -> None:
  """A checkpoint continues a run of its own objective; parameters alone (an import) start either. An lm run's
  full checkpoint holds no reference (and its optimizer state and schedule would go on), a DPO run's holds one."""
  if checkpoint.params_only(manifest):
    return
  train = (manifest.get("fingerprint") or {}).get("train")  # older manifests: other shapes, all lm runs
  saved = train.get("train.objective", "lm") if isinstance(train, dict) else "lm"
  if saved != cfg.train.objective:
    raise UserError(f"checkpoint {step_dir} is a train.objective={saved} run's, which a train.objective="
                    f"{cfg.train.objective} run cannot continue: to start from its parameters, export them "
                    "(python -m jaxtrain.hf export) and import them into a new workdir (hf import); or --fresh")


def reference(model_cfg, params):
  """The frozen reference from the starting float32 parameters: the weights the model casts at use already in the
  compute dtype (the values it computes with), the rest as they are."""
  def low(path, p):
    return p.astype(model_cfg.dtype) if roles.of(model_cfg, path).cast_at_use else p
  return jax.tree_util.tree_map_with_path(low, params)


def rewards(beta: float, pi_P2, ref_P2):
  """(per-pair loss, chosen reward, rejected reward) of TRL's sigmoid DPO from (pairs, 2) sequence log-probs."""
  r_P2 = beta * (pi_P2 - ref_P2)
  return -jax.nn.log_sigmoid(r_P2[:, 0] - r_P2[:, 1]), r_P2[:, 0], r_P2[:, 1]


class Objective(grads_lib.Objective):
  """One microbatch's DPO share; `mb["ref_logp"]` holds the reference's masked token log-probs (`grads` adds it)."""

  def token_logp(self, params, mb):
    """log p(target) of every trained token (0 elsewhere)."""
    model = self.model(params)
    h_BxLxD, _ = model.hidden(mb["inputs"], mb["positions"], mb["segment_ids"])
    logp_BxL = xent.target_logp(h_BxLxD, model.head_weight(), mb["targets"], self.cfg.model.head_logits_dtype)
    return logp_BxL * (mb["loss_mask"] > 0)

  def __call__(self, params, mb, w: grads_lib.Weights):
    pairs = lambda x_BxL: jnp.sum(x_BxL, axis=1).reshape(-1, 2)  # noqa: E731 (rows 2i, 2i + 1: one pair)
    loss_P, chosen_P, rejected_P = rewards(self.cfg.train.dpo_beta, pairs(self.token_logp(params, mb)),
                                           pairs(mb["ref_logp"]))
    loss_sum = jnp.sum(loss_P)
    stats = {"chosen": jnp.sum(chosen_P), "rejected": jnp.sum(rejected_P),
             "correct": jnp.sum((chosen_P > rejected_P).astype(jnp.float32))}
    return w.ce * loss_sum, (loss_sum, stats)

  def zero_totals(self) -> dict:
    return {k: jnp.float32(0) for k in STATS}


def split_pairs(batch, k: int):
  """(B, L) -> (k, B/k, L), microbatch i = pairs i, i+k, ... (rows 2p, 2p+1 stay side by side)."""
  def split(x_BxL):
    B, L = x_BxL.shape
    x = x_BxL.reshape(B // (2 * k), k, 2, L).swapaxes(0, 1).reshape(k, B // k, L)
    return ops.constrain(x, (None, "batch", "length"))
  return jax.tree.map(split, batch)


def reference_logp(objective: Objective, ref, mbs):
  """The reference's masked token log-probs of every microbatch, (k, B/k, L): forward only."""
  ref = jax.lax.stop_gradient(ref)
  logp = jax.lax.scan(lambda _, mb: (None, objective.token_logp(ref, mb)), None, mbs)[1]
  return jax.lax.stop_gradient(ops.constrain(logp, (None, "batch", "length")))


def grads(objective: Objective, params, ref, batch, loss_scale=1.0, grad_sharding=None,
          executor=grads_lib.accumulate):
  """(mean pair loss, unscaled gradient, n_valid tokens, DPO metrics) of one update, as grads.grads returns."""
  n_pairs = batch["inputs"].shape[0] // 2
  scale = jnp.asarray(loss_scale, jnp.float32)
  w = grads_lib.Weights(ce=scale / n_pairs, aux=jnp.float32(0), mtp=jnp.float32(0))
  mbs = split_pairs(batch, objective.cfg.train.microbatches)
  mbs = {**mbs, "ref_logp": reference_logp(objective, ref, mbs)}
  loss_sum, g, stats = executor(objective, params, mbs, w, grad_sharding)
  g = jax.tree.map(lambda x: x / jnp.asarray(loss_scale, x.dtype), g)
  return loss_sum / n_pairs, g, jnp.sum(batch["loss_mask"] > 0), metrics(stats, n_pairs)


def metrics(stats: dict, n_pairs: int) -> dict:
  """Means over the update's pairs (TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins)."""
  return {"dpo_reward_chosen": stats["chosen"] / n_pairs, "dpo_reward_rejected": stats["rejected"] / n_pairs,
          "dpo_reward_accuracy": stats["correct"] / n_pairs,
          "dpo_reward_margin": (stats["chosen"] - stats["rejected"]) / n_pairs}
