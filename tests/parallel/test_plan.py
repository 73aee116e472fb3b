"""The execution plan: it decides the attention kernel once, for the target device, and the
compiled step runs that kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import attention as attention_lib
from jaxtrain.parallel import kernels, plan as plan_lib
from jaxtrain.run import step
from tests.helpers import mesh_of


def test_the_plan_decides_the_kernel_once_and_it_is_what_runs(monkeypatch):
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1"])
  called = []
  real = attention_lib.attention  # the spies compute the reference (cuDNN cannot run on CPU)
  monkeypatch.setattr(attention_lib, "attention", lambda *a, **kw: called.append("xla") or real(*a, **kw))
  monkeypatch.setattr(kernels, "fused", lambda *a, **kw: called.append("cudnn") or real(*a[:4]))
  for spec, forced, want in [("dp=2", None, "xla"), ("dp=2", "cudnn", "cudnn"), ("sp=2", None, "ring")]:
    mesh = mesh_of(spec)
    plan = plan_lib.build(cfg, mesh)
    if forced:  # what an H100 target would decide
      plan = dataclasses.replace(plan, attention=forced)
    setup = step.Setup(cfg, mesh, plan)
    called.clear()
    batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    hlo = setup.step.lower(jax.eval_shape(setup.init), batch).as_text()
    assert plan.describe().startswith(f"attention: {want} ")
    assert ("collective_permute" in hlo) == (want == "ring") and set(called) == ({want} - {"ring"}), spec


def test_the_plan_never_names_cudnn_where_the_ring_runs():
  cfg = config.load("tiny", ["model.attention=cudnn"])
  with pytest.raises(UserError, match="model.attention=cudnn cannot run with sequence=2"):
    plan_lib.build(cfg, mesh_of("sp=2"))
  # For an H100 target (compiled ahead of time on this machine) the plan picks cuDNN.
  h100 = type("Device", (), {"platform": "gpu", "compute_capability": "9.0", "device_kind": "NVIDIA H100"})()
  assert plan_lib.build(config.load("tiny"), mesh_of("dp=2"), device=h100).attention == "cudnn"
