"""Muon (optim.name=muon) on every kind of mesh equals one device, float32, 1e-5 (where the mesh splits its matrices,
a stack's on owner devices, a lone matrix gathered whole: jaxtrain/run/muon.py's route), and resumes bit for bit from
a checkpoint."""

import functools

import jax
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.run import checkpoint, step
from tests.helpers import mesh_of, trajectory

pytestmark = pytest.mark.slow  # compiles of whole steps: left out of -m 'not slow'

STEPS = 3
BASE = ["optim.name=muon", "model.dtype=float32", "model.d_model=32", "model.n_heads=4", "model.head_dim=8",
        "model.d_ff=64", "model.vocab_size=384", "train.batch_size=8", "train.seq_len=16", "train.steps=10",
        "optim.warmup_steps=1", "optim.lr=0.02"]
DENSE = ["model.scan_layers=true"]  # a stack: one layer gathered at a time where the mesh splits its matrices
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=32"]


@functools.cache
def _run(spec: str, *sets: str):
  return trajectory(config.load("tiny", [*BASE, *sets]), spec, STEPS)


@pytest.mark.parametrize("spec,sets", [
    ("fsdp=4", DENSE), ("tensor=2", DENSE), ("fsdp=2,tensor=2", DENSE), ("data=2", [*DENSE, "optim.zero_stage=1"]),
    ("data=2,fsdp=2", [*DENSE, "optim.zero_stage=2", "train.microbatches=2"]), ("fsdp=2,tensor=2", []),
    ("expert=2,fsdp=2", MOE),
    ("pipeline=2,fsdp=2", [*DENSE, "model.n_layers=4", "train.microbatches=2"])],  # a stage's 2 layers: owners
    ids=lambda x: x if isinstance(x, str) else ",".join(s.split(".")[-1] for s in x))
def test_muon_on_a_mesh_equals_one_device(spec, sets):
  got, ref = _run(spec, *sets), _run("data=1", *sets)
  assert got[-1, 0] < got[0, 0]  # it trains
  np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=f"Muon on {spec} {sets}")


def test_muon_resumes_bit_for_bit(tmp_path):
  """Steps 3-4 from the checkpoint of step 2 (Muon's momentum and count, AdamW's moments) equal the straight run's,
  parameters bit for bit, on a mesh that splits the matrices."""
  cfg = config.load("tiny", [*BASE, *DENSE])
  setup = step.Setup(cfg, mesh_of("fsdp=2,tensor=2"))
  it = data.batches(cfg)
  batches = [setup.device_batch(next(it)) for _ in range(4)]
  it.close()
  state = setup.init()
  for b in batches[:2]:
    state, _ = setup.step(state, b)
  ck = checkpoint.Checkpoints(tmp_path / "checkpoints", 3, 0, False)
  ck.save(2, state, {})
  ck.wait()
  restored, _ = ck.restore(ck.dir / "2", setup.abstract_state())
  ck.close()
  out = []
  for s in (state, restored):
    for b in batches[2:]:
      s, m = setup.step(s, b)
    out.append((jax.device_get(s), float(m["loss"])))
  (a, loss_a), (b, loss_b) = out
  assert loss_a == loss_b
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  mu = a["opt"].inner_states["muon"].inner_state[0].mu["layers"]["attn"]["wq"]
  assert int(a["opt"].inner_states["muon"].inner_state[0].count) == 4 and np.abs(mu).max() > 0
