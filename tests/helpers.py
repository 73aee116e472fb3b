"""Shared test helpers: a clean subprocess environment, a mesh from a spec on the first N
simulated devices, the plan and a short loss trajectory for a config."""

import dataclasses
import math
import os

import jax
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.analysis import gpu_compile
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import grads as grads_lib, step
from tests.suite_env import SUITE_XLA_FLAGS

# Set by this test process (or a developer's shell) for in-process simulated devices or
# fault injection; a subprocess that stands for a user's run must not inherit them.
NOT_INHERITED = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAXTRAIN_FAULTS")


# Compile-only H100 tests need XLA's GPU compiler, the CUDA plugin of the gpu-aot extra (CI installs it).
needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_installed(), reason="no CUDA plugin (gpu-aot extra)")

def clean_env(**extra):
  """os.environ without NOT_INHERITED (XLA_FLAGS back to the suite's own), then `extra` on top: the environment
  for a subprocess."""
  env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
  env["XLA_FLAGS"] = " ".join(SUITE_XLA_FLAGS)
  env.update(extra)
  return env


def mesh_of(spec: str):
  sizes = mesh_lib.parse(spec)
  return mesh_lib.build(sizes, jax.devices()[:math.prod(sizes.values())])


def plan_of(mesh, *sets):
  """The execution plan the trainer would build for tiny (plus `sets`) on `mesh`."""
  return plan_lib.build(config.load("tiny", list(sets)), mesh)


def moe_ffn(x_BxLxD, router, w_gate, w_up, w_down, *, top_k: int, capacity_factor: float, plan=None,
            group_size: int = 0, dropless: bool = False, decoding: bool = False):
  """The routed experts as the MoE layer runs them (jaxtrain.model.moe): routing, the capacity group and slots, then
  the experts where `plan` says (None: one device, the reference). (y float32, stats with dropped/assigned)."""
  import jax.numpy as jnp
  from jaxtrain.model import moe, ops
  B, L, _ = x_BxLxD.shape
  X = router.shape[1]
  idx, w, stats = moe.route(x_BxLxD, router, top_k)
  group = group_size if group_size and moe.group_fits(group_size, L, B, L) and not (decoding and L % group_size) else L
  cap = None if dropless else moe.capacity(group, X, top_k, capacity_factor)
  with ops.use(plan or ops.Ops()):
    y, dropped = ops.current().experts(x_BxLxD, idx, w, (w_gate, w_up, w_down), group, cap)
  return y, {**stats, "dropped": dropped, "assigned": jnp.float32(B * L * top_k)}


def with_microbatches(cfg, k: int):
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=k))


def grads_of(cfg, graphdef, params, batch, microbatches: int | None = None, loss_scale=1.0):
  """(loss, unscaled gradient, n_valid) of one update by the gradient contract, on one device (no plan installed)."""
  cfg = cfg if microbatches is None else with_microbatches(cfg, microbatches)
  return grads_lib.grads(grads_lib.Objective(graphdef, cfg), params, batch, loss_scale)[:3]


def trajectory(cfg, spec: str, steps: int, keys=("loss", "grad_norm")):
  """The metrics `keys` (default loss, grad_norm) at each of `steps` train steps of `cfg` on mesh `spec`."""
  setup = step.Setup(cfg, mesh_of(spec))
  it = data.batches(cfg)
  state, out = setup.init(), []
  for _ in range(steps):
    state, m = setup.step(state, setup.device_batch(next(it)))
    out.append([float(m[k]) for k in keys])
  it.close()
  return np.array(out)
