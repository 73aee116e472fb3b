"""inspect's pipeline section (jaxtrain.analysis.timeline): the XLA-costed slot FLOPs against the matmul count
written out here (a split backward's F + B + W against F + one whole backward), and the bubble of a table with unit
costs against the schedule's formula."""

import pytest

from jaxtrain.analysis import timeline
from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_slot_flops_are_a_chunks_matmuls_and_the_bubble_the_formula(schedule):
  cfg = config.load("tiny", ["model.scan_layers=true", "model.n_layers=4", "train.microbatches=4",
                             "train.batch_size=8", "train.seq_len=32", f"pipeline.schedule={schedule}"])
  rep = timeline.report(step.Setup(cfg, mesh_of("pp=2")))
  m, t = cfg.model, cfg.train
  tokens = t.batch_size // t.microbatches * t.seq_len  # one microbatch, on the one device of a stage
  per_layer = 2 * tokens * (m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff)
  per_layer += 2 * 2 * tokens * t.seq_len * m.n_heads * m.head_dim  # q.k and p.v over the whole L x L
  forward = per_layer * m.n_layers // 2  # a chunk: half the layers
  c = rep["slot_flops"]
  assert forward <= c["F"] <= 1.1 * forward, (c["F"], forward)  # plus norms, RoPE, softmax
  assert 2.5 * forward <= c["BW"] <= 3.5 * forward  # the recomputed forward and two gradients per matmul
  assert rep["bubble"] == pytest.approx(rep["bubble_formula"]) and rep["ticks"] > 0
  assert rep["split"] == (schedule == "zb-h1") and "stage 1:" in rep["timeline"]
  if rep["split"]:  # W is the projections' weight gradients alone, B the rest of one backward: nothing twice
    projections = 2 * tokens * (m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 3 * m.d_model * m.d_ff)
    assert c["W"] == pytest.approx(projections * m.n_layers // 2, rel=0.01)  # (XLA adds one per weight element)
    assert abs(c["F"] + c["B"] + c["W"] - (c["F"] + c["BW"])) <= 0.05 * (c["F"] + c["BW"]), c
