"""The learning-rate schedule (`optim_lib.lr_schedule`, the one kind the config has: linear
warmup, then cosine to lr * min_lr_ratio) at every step of short runs, against tables
worked out by hand from the formula below; eager and under jit with the int32 count the
optimizer passes it.

    s < W:  lr * (s + 1) / W                                       (lr/W at s=0, lr at s=W-1)
    s >= W: lr * (m + (1 - m) * 0.5 * (1 + cos(pi * p))),  p = min((s - W) / max(T - W, 1), 1)

s: updates already applied, W: optim.warmup_steps, T: train.steps, m: optim.min_lr_ratio.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.run import optimizer as optim_lib

C30 = 0.8660254037844386  # cos(pi/6) = -cos(5pi/6)
C45 = 0.7071067811865476  # cos(pi/4) = -cos(3pi/4)

TABLES = {
    # lr=1e-3, W=4, T=10, m=0.1. Warmup 1e-3*(s+1)/4. Cosine p=(s-4)/6, lr*(0.1+0.45*(1+cos(pi p))):
    # p=1/6: 0.1+0.45*(1+C30)=0.9397114317; p=2/6: 0.1+0.45*1.5=0.775; p=3/6: 0.55;
    # p=4/6: 0.1+0.45*0.5=0.325; p=5/6: 0.1+0.45*(1-C30)=0.1602885683; p>=1: 0.1.
    "warmup4_steps10_floor0.1": (
        ["optim.lr=1e-3", "optim.warmup_steps=4", "train.steps=10", "optim.min_lr_ratio=0.1"],
        [2.5e-4, 5.0e-4, 7.5e-4, 1.0e-3,  # s=0..3 (warmup; s=W-1 already at lr)
         1.0e-3, 9.397114317e-4, 7.75e-4, 5.5e-4, 3.25e-4, 1.602885683e-4, 1.0e-4,  # s=4..10
         1.0e-4, 1.0e-4, 1.0e-4]),  # s=11..13: held at the floor past the last step
    # lr=1, W=0 (no warmup), T=4, m=0: 0.5*(1+cos(pi s/4)): 1, 0.5*(1+C45), 0.5, 0.5*(1-C45), 0.
    "no_warmup_steps4_floor0": (
        ["optim.lr=1.0", "optim.warmup_steps=0", "train.steps=4", "optim.min_lr_ratio=0.0"],
        [1.0, 0.8535533906, 0.5, 0.1464466094, 0.0, 0.0, 0.0]),
    # lr=2e-3, W=1, T=5, m=0.5: s=0 is lr*1/1; cosine p=(s-1)/4, lr*(0.5+0.25*(1+cos(pi p))):
    # p=0: 1; p=1/4: 0.5+0.25*(1+C45)=0.9267766953; p=1/2: 0.75; p=3/4: 0.5+0.25*(1-C45)=0.5732233047; 0.5.
    "warmup1_steps5_floor0.5": (
        ["optim.lr=2e-3", "optim.warmup_steps=1", "train.steps=5", "optim.min_lr_ratio=0.5"],
        [2.0e-3, 2.0e-3, 1.8535533906e-3, 1.5e-3, 1.1464466094e-3, 1.0e-3, 1.0e-3, 1.0e-3]),
    # A schedule shorter than its warmup: lr=0.3, W=3, T=2, m=0.1. Warmup 0.1, 0.2, 0.3 at s=0..2;
    # then max(T-W, 1)=1 cosine step: p=0 at s=3 (0.3), p=1 from s=4 (0.03).
    "steps_shorter_than_warmup": (
        ["optim.lr=0.3", "optim.warmup_steps=3", "train.steps=2", "optim.min_lr_ratio=0.1"],
        [0.1, 0.2, 0.3, 0.3, 0.03, 0.03]),
    # min_lr_ratio=1: no decay. lr=0.01, W=2, T=6: 0.005, then 0.01 from s=1 on.
    "floor_equals_peak": (
        ["optim.lr=0.01", "optim.warmup_steps=2", "train.steps=6", "optim.min_lr_ratio=1.0"],
        [0.005, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01]),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_schedule_matches_the_hand_computed_table_at_every_step(name):
  sets, table = TABLES[name]
  cfg = config.load("tiny", sets)
  lr = optim_lib.lr_schedule(cfg.optim, cfg.train.steps)
  want = np.asarray(table)
  eager = np.asarray([float(lr(s)) for s in range(len(table))])
  counts = jnp.arange(len(table), dtype=jnp.int32)  # the optimizer's count dtype
  jitted = np.asarray(jax.jit(jax.vmap(lr))(counts))
  # float32: a few ulps of the peak lr, absolute (the cosine's 1 + cos(~pi) cancels near the end)
  for got in (eager, jitted):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7 * cfg.optim.lr)


def test_default_schedule_spot_values():
  # lr=3e-3, W=5, T=20, m=0.1. Warmup 6e-4*(s+1): 6e-4 at s=0, 2.4e-3 at s=3, 3e-3 at s=4 (=W-1);
  # cosine p=(s-5)/15: 3e-3 at s=5, p=1/3 at s=10: 3e-3*(0.1+0.45*1.5)=2.325e-3, the floor 3e-4 from s=20.
  cfg = config.load("tiny")
  o = cfg.optim
  assert (o.lr, o.warmup_steps, cfg.train.steps, o.min_lr_ratio) == (3e-3, 5, 20, 0.1)  # the table's premise
  lr = optim_lib.lr_schedule(o, cfg.train.steps)
  got = [float(lr(s)) for s in (0, 3, 4, 5, 10, 20, 25)]
  np.testing.assert_allclose(got, [6e-4, 2.4e-3, 3e-3, 3e-3, 2.325e-3, 3e-4, 3e-4], rtol=2e-6)


def test_the_optimizer_steps_with_the_schedule_of_its_count():
  """Through AdamW with b1=b2=0 (m=g, v=g^2, no bias correction left) and no decay or clip, every
  update is -lr(count) * g / (|g| + eps): the first six follow `warmup4_steps10_floor0.1`."""
  cfg = config.load("tiny", ["optim.lr=1e-3", "optim.warmup_steps=4", "train.steps=10", "optim.min_lr_ratio=0.1",
                             "optim.b1=0", "optim.b2=0", "optim.eps=1e6", "optim.weight_decay=0",
                             "optim.grad_clip=0"])
  opt = optim_lib.optimizer(cfg)
  params = {"embed": jnp.zeros((2,), jnp.float32)}
  state = opt.init(params)
  g = {"embed": jnp.full((2,), 1e3, jnp.float32)}  # v = g^2 = 1e6, sqrt(v) = 1e3; update = -lr * 1e3 / (1e3 + 1e6)
  want = [2.5e-4, 5.0e-4, 7.5e-4, 1.0e-3, 1.0e-3, 9.397114317e-4]
  for s, lr in enumerate(want):
    updates, state = opt.update(g, state, params)
    np.testing.assert_allclose(np.asarray(updates["embed"]), -lr * 1e3 / (1e3 + 1e6), rtol=1e-5, err_msg=f"count {s}")
