"""The debug protocol (jaxtrain.run.protocol): a good run passes every check; a planted bug of each kind, patched
into the real function in this process, fails its own check while the other checks still run."""

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.data import pipeline
from jaxtrain.model import loss as loss_lib
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import protocol

# A model a few thousand parameters big; two microbatches over data=2, so the gradient crosses `data` in an
# explicit reduction (jaxtrain.parallel.data_region) that the planted mesh bug drops.
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
         "model.d_ff=64", "train.batch_size=4", "train.seq_len=32", "train.microbatches=2", "optim.lr=1e-2",
         "optim.warmup_steps=2", "optim.min_lr_ratio=1.0"]
# Measured: this model's loss on one batch is 0.10 near step 45 and 0.03 at step 55 (constant LR).
OPTS = protocol.Options(overfit_steps=60, overfit_loss=0.1, resume_steps=3, mesh_steps=2)
NAMES = ["overfit one batch", "labels", "grad norm and LR", "resume", "mesh vs one device"]


def _protocol():
  lines = []
  cfg = config.load("tiny", SMALL)
  mesh = mesh_lib.build(mesh_lib.parse("data=2"), devices=jax.devices()[:2])
  verdicts = protocol.run(cfg, mesh, OPTS, emit=lines.append)
  assert [v.name for v in verdicts] == NAMES  # every check ran, in order, and printed its line
  assert all(v.line() in lines for v in verdicts)
  assert not any("raised" in v.figure for v in verdicts), [v.figure for v in verdicts]
  return {v.name: v for v in verdicts}, lines


@pytest.mark.slow
def test_a_good_run_passes_every_check():
  verdicts, lines = _protocol()
  assert all(v.ok for v in verdicts.values()), "\n".join(lines)
  assert any("input id -> label" in line for line in lines)  # the sample shown


def _unshifted(rows):
  f = _real_fields(rows)
  return {**f, "targets": f["inputs"].copy()}


_real_fields = pipeline.fields_from_rows


def _mask_ignored(h, w, targets, weights, *args, **kw):
  return _real_nll(h, w, targets, jnp.ones_like(weights), *args, **kw)


_real_nll = loss_lib.nll_sum


def _no_psum(x, axis_name, **kw):  # every all-reduce of the step gone: each device keeps its own rows' sum
  return x


@pytest.mark.slow
@pytest.mark.parametrize("target, name, bug, fails", [
    (pipeline, "fields_from_rows", _unshifted, "labels"),
    (loss_lib, "nll_sum", _mask_ignored, "labels"),
    (pipeline.DataIterator, "set_state", lambda self, state: None, "resume"),
    (jax.lax, "psum", _no_psum, "mesh vs one device"),
], ids=["labels-not-shifted", "loss-mask-ignored", "resume-skips-data-position", "mesh-drops-reduction"])
def test_a_planted_bug_fails_its_check(target, name, bug, fails, monkeypatch):
  monkeypatch.setattr(target, name, bug)
  verdicts, lines = _protocol()
  assert not verdicts[fails].ok, "\n".join(lines)
  assert verdicts["grad norm and LR"].ok  # untouched by every planted bug


@pytest.mark.parametrize("kw, named", [({"overfit_steps": 0}, "--overfit-steps 0"),
                                       ({"mesh_rtol": -1.0}, "--mesh-rtol -1"),
                                       ({"overfit_loss": float("nan")}, "--overfit-loss nan")])
def test_bad_options_are_one_line(kw, named):
  with pytest.raises(UserError, match=named):
    protocol.check_options(protocol.Options(**kw))
