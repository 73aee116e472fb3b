"""Where the train state lives and the parameters the step computes with: the stored layout of master and moments
(ZeRO-1/2 also split them over `data`, offload puts them in host memory), the gradients' layout (ZeRO-2: split over
`data` too) and the compute copy the step differentiates. The update's math never changes with the layout. With
LoRA the moments and gradients are the adapters' alone (`roles.split`); the frozen base is stored as it is used, or
with QLoRA quantized (codes and scales sharded as `quant.code_axes` says), and the model dequantizes it layer by
layer (transformer.dense)."""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import quant, roles
from jaxtrain.parallel import sharding
from jaxtrain.run import moments, offload as offload_lib


def _on_device(tree):
  return jax.tree.map(lambda sh: sh.with_memory_kind("device"), tree)


class Layout:
  """The shardings of (params as computed, params as stored, optimizer state, gradients) for one plan."""

  def __init__(self, cfg, plan, opt: optax.GradientTransformation, abstract_params, param_sh, notes: list[str]):
    self.cfg, self.param, self.abstract_params = cfg, param_sh, abstract_params
    mesh = plan.mesh
    host = "pinned_host" if cfg.optim.offload == "host" else None

    def stored(path, sh, x):
      where = jax.tree_util.keystr(path, simple=True, separator="/")
      return sharding.storage_sharding(sh, x.shape, plan.zero_stage > 0, host, notes, where,
                                       stacked=roles.of(cfg.model, path).stacked)
    dense = jax.tree_util.tree_map_with_path(stored, param_sh, abstract_params)
    # QLoRA: the quantized base's codes and scales, sharded like the weight where the format allows
    self.stored = quantized_shardings(cfg.model, mesh, dense, abstract_params, notes)
    self.param_at_rest = quantized_shardings(cfg.model, mesh, param_sh, abstract_params, [])  # a restore's
    replicated = NamedSharding(mesh, P())
    self.trained = lambda tree: roles.split(cfg.model, tree)[0]  # LoRA: the adapters; else every parameter
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 (Muon's partition: the other rule's leaves)
    # moments like the master; optim.state_dtype=int8's codes too, their scales by blocks (run/moments.py)
    opt_shapes = jax.eval_shape(opt.init, self.trained(abstract_params))
    self.opt = optax.tree_map_params(opt, lambda x, sh: x if masked(x) else moments.sharding_like(x, sh), opt_shapes,
                                     self.trained(self.stored), transform_non_params=lambda _: replicated,
                                     is_leaf=lambda x: masked(x) or isinstance(x, moments.Quantized))
    self.offload = host is not None
    # (host-to-device, device-to-host) bytes per step over one device's host link; None without offload
    self.link = offload_lib.link_bytes(self.stored, abstract_params, self.opt, opt_shapes) if self.offload else None
    self.separate = plan.zero_stage > 0 or self.offload  # else the master is what the step computes with
    # pinned for ZeRO (stage 1 too: XLA would split the gradients like the update's operands otherwise)
    self.grads = self.trained(_on_device(self.stored) if plan.zero_stage == 2 else param_sh)
    self.grad_sharding = self.grads if plan.zero_stage > 0 else None  # where the step pins the gradients

  def compute(self, master):
    """The parameters the step computes with, from the stored float32 master (itself without ZeRO or offload).
    QLoRA's quantized base passes through as stored: the model dequantizes one layer's at a time."""
    if not self.separate:
      return master
    return compute_copy(self.cfg.model, master, self.param_at_rest, self.cfg.model.dtype,
                        _on_device(self.stored) if self.offload else None)

  def device_state(self):
    """(master, optimizer state) shardings in device memory: where the offloaded update brings each unit."""
    return _on_device((self.stored, self.opt))


def compute_copy(model_cfg, params, shardings, dtype, fetch=None):
  """The parameters the step computes with, from the float32 master: weights cast at use (the role table's) taken
  in the compute `dtype` and brought to their compute `shardings` (an all-gather over data with ZeRO, a host to
  device copy with offload), then seen as float32 again. The model's own cast makes them exactly the values a
  float32 master gives, and the gradients (and their sums) are float32 as without it. `fetch` (offload): the
  master's own shardings in device memory, where it goes before the cast (XLA moves host arrays to and from the
  device; it runs no arithmetic on them outside `compute_on`)."""
  def low(path, p, sh, dev):
    p = p if fetch is None else jax.device_put(p, dev)
    if quant.is_quantized(p):  # QLoRA's base: its codes and scales on the compute sharding, dequantized in the model
      return jax.device_put(p, sh)
    return jax.device_put(p.astype(dtype) if roles.of(model_cfg, path).cast_at_use else p, sh)
  # the barrier keeps the gathered copy whole: XLA would otherwise re-gather each layer at each use (ZeRO-3)
  copy = jax.lax.optimization_barrier(jax.tree_util.tree_map_with_path(low, params, shardings, fetch or shardings,
                                                                       is_leaf=quant.is_quantized))
  copy = jax.lax.with_sharding_constraint(copy, shardings)  # the barrier's output too, else it may stay split
  return jax.tree.map(lambda c, p: c.astype(p.dtype), copy, params)


def quantized_shardings(model_cfg, mesh, shardings, abstract_params, notes: list[str]):
  """`shardings` with each weight QLoRA quantizes as a QTensor of (codes, scales) shardings: `quant.code_axes` of
  the weight's spec; an nf4 input axis whose shard is not whole blocks of 64 (or the flat layout) is replicated."""
  if model_cfg.lora_base_dtype == "none":
    return shardings

  def one(path, sh, x):
    role = roles.of(model_cfg, path)
    if role.quant == "none":
      return sh
    codes, scales, whole = quant.split_axes(x.shape, role.quant, sh.spec, lambda e: sharding.ways(e, mesh),
                                            role.in_axis, role.lead)
    if whole:
      notes.append(f"{jax.tree_util.keystr(path, simple=True, separator='/')}: nf4 codes not split on the input "
                   f"axis (shards of {sh.shard_shape(x.shape)[role.in_axis]} values, not whole blocks of "
                   f"{quant.BLOCK})")
    return quant.QTensor(NamedSharding(mesh, P(*codes), memory_kind=sh.memory_kind),
                         NamedSharding(mesh, P(*scales), memory_kind=sh.memory_kind), tuple(x.shape[role.lead:]),
                         role.quant, role.in_axis - role.lead)
  return jax.tree_util.tree_map_with_path(one, shardings, abstract_params)
