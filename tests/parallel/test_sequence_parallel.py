"""Megatron sequence parallelism (run.sequence_parallel) as seen in the compiled program."""

import re

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.core import config
from jaxtrain.parallel import sharding
from jaxtrain.run import step
from tests.helpers import mesh_of, plan_of

B = 4


def _compiled_text(sequence_parallel: bool):
  cfg = config.load("tiny", ["model.dtype=float32", f"train.batch_size={B}", "train.seq_len=32",
                             f"run.sequence_parallel={str(sequence_parallel).lower()}"])
  setup = step.Setup(cfg, mesh_of("tp=4"))
  batch = {k: jax.ShapeDtypeStruct((B, cfg.train.seq_len), jnp.int32, sharding=setup.batch_sharding)
           for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
  return cfg, setup.step.lower(jax.eval_shape(setup.init), batch).compile().as_text()


@pytest.mark.slow
def test_sequence_parallel_splits_the_residual_stream_over_tensor():
  cfg, sp_hlo = _compiled_text(True)
  _, tp_hlo = _compiled_text(False)
  L, D = cfg.train.seq_len, cfg.model.d_model
  full, local = f"f32[{B},{L},{D}]", f"f32[{B},{L // 4},{D}]"
  gathers = re.findall(r"= (f32\[[\d,]+\])\S* all-gather(?:-start)?\(", sp_hlo)
  # Entering each TP region: the normed (B, L/4, D) shard is all-gathered to (B, L, D).
  assert gathers.count(full) >= 2 * cfg.model.n_layers, gathers
  assert local in sp_hlo  # norms and residual adds run on L/4 of the sequence
  # Plain TP keeps the whole sequence everywhere and gathers no activation.
  assert full not in re.findall(r"= (f32\[[\d,]+\])\S* all-gather(?:-start)?\(", tp_hlo)
  assert local not in tp_hlo


def test_sequence_parallel_rule_only_in_its_plan():
  mesh = mesh_of("tp=4")
  axes, shape = ("batch", "act_length", "act_embed"), (4, 128, 128)
  assert sharding.spec_for(axes, shape, mesh)[1] is None
  assert plan_of(mesh, "run.sequence_parallel=true").spec(axes, shape)[1] == "tensor"
  assert plan_of(mesh).spec(axes, shape)[1] is None
