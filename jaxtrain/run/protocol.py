"""The minimal debug protocol (`python -m jaxtrain.debug`, docs/training.md#the-debug-protocol): five checks, in
order, each a verdict with its figure. A check that raises is a FAIL with the error's first line, and the next
check still runs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import traceback
from pathlib import Path

import jax
import numpy as np

from jaxtrain import data
from jaxtrain.core import config, ramp
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import loop, optimizer as optim_lib, step as step_lib


@dataclasses.dataclass(frozen=True)
class Options:
  overfit_steps: int = 150  # tiny (lr 3e-3, 16 x 128 tokens) is below 0.05 by about step 100 on CPU
  overfit_loss: float = 0.1
  resume_steps: int = 20  # R steps + checkpoint + resume R against 2R uninterrupted
  resume_rtol: float = 0.0  # the same program on the same devices: bit-equal
  mesh_steps: int = 3
  mesh_rtol: float = 1e-4  # float32, other summation orders: ~1e-6 seen; a dropped reduction is ~1


@dataclasses.dataclass
class Verdict:
  name: str
  ok: bool
  figure: str
  detail: list[str] = dataclasses.field(default_factory=list)

  def line(self) -> str:
    return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.figure}"


def check_options(o: Options) -> None:
  for flag, v, lo in (("--overfit-steps", o.overfit_steps, 1), ("--resume-steps", o.resume_steps, 1),
                      ("--mesh-steps", o.mesh_steps, 1)):
    if v < lo:
      raise UserError(f"{flag} {v}: must be a positive integer")
  for flag, v in (("--overfit-loss", o.overfit_loss), ("--resume-rtol", o.resume_rtol),
                  ("--mesh-rtol", o.mesh_rtol)):
    if not math.isfinite(v) or v < 0:
      raise UserError(f"{flag} {v:g}: must be a finite number >= 0")


def _with(cfg, *overrides: str):
  """`cfg` with `section.key=value` overrides (validated as --set is)."""
  return config.from_dict(cfg.to_dict(), list(overrides), "config")


def run(cfg, mesh, o: Options, emit=print) -> list[Verdict]:
  """Runs every check in order; `emit` gets each verdict's detail lines and line as they come."""
  checks = [("overfit one batch", overfit), ("labels", labels), ("grad norm and LR", logged),
            ("resume", resume), ("mesh vs one device", mesh_equal)]
  verdicts, shared = [], {}
  for name, check in checks:
    try:
      v = check(cfg, mesh, o, shared)
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 (a crashing check is that check's failure; the others still run)
      first = (str(e).splitlines() or [""])[0][:300]
      v = Verdict(name, False, f"raised {type(e).__name__}: {first}",
                  ["  " + traceback.format_exc().strip().splitlines()[-1]])
    for d in v.detail:
      emit(d)
    emit(v.line())
    verdicts.append(v)
  return verdicts


def overfit(cfg, mesh, o: Options, shared: dict) -> Verdict:
  """N steps on one fixed batch (the schedule spans the N steps); the loss must fall under the threshold."""
  cfg = _with(cfg, f"train.steps={o.overfit_steps}")
  setup = step_lib.Setup(cfg, mesh)
  batches = data.batches(cfg)
  try:
    host = next(batches)
  finally:
    batches.close()
  state, batch = setup.init(), setup.device_batch(host)
  compiled = setup.step.lower(state, batch).compile()
  recs = []
  for _ in range(o.overfit_steps):  # each step waited for: CPU collectives of many queued steps can starve
    state, m = compiled(state, batch)
    recs.append(jax.device_get(m))
  shared["overfit"], shared["step"] = (cfg, recs), (setup, compiled)
  losses = np.array([float(r["loss"]) for r in recs])
  below = np.flatnonzero(losses <= o.overfit_loss)
  at = f"first at step {below[0] + 1}" if below.size else "never"
  return Verdict("overfit one batch", bool(below.size), f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
                 f"{o.overfit_steps} steps, <= {o.overfit_loss:g} {at} (--overfit-steps, --overfit-loss)")


def _shown(f: dict, row: int, width: int = 12) -> str:
  """Positions of `row` around its first masked target: id -> label, masked ones marked x."""
  mask = f["loss_mask"][row]
  first = int(np.argmin(mask)) if not mask.all() else 0
  lo = max(0, min(first - width // 2, len(mask) - width))
  cells = [f"{int(f['inputs'][row, i])}->{int(f['targets'][row, i])}{'' if mask[i] else 'x'}"
           for i in range(lo, lo + width)]
  return f"  sample: row {row}, positions {lo}..{lo + width - 1} (input id -> label, x: masked): " + " ".join(cells)


def labels(cfg, mesh, o: Options, shared: dict) -> Verdict:
  """One batch as the loader gives it: each label is the next input of the same document; a label across a
  document's end or on padding is masked; and the step's loss does not move when masked labels change (the
  batch's own masked labels and every fourth one more, masked here: a batch of long documents has few)."""
  batches = data.batches(cfg)
  try:
    f = next(batches)
  finally:
    batches.close()
  seg, mask = f["segment_ids"], f["loss_mask"].astype(bool)
  inside = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)  # position t and t+1 in one document
  unshifted = int(np.sum(f["targets"][:, :-1][inside] != f["inputs"][:, 1:][inside]))
  leaks = int(np.sum(mask[:, :-1] & ~inside)) + int(np.sum(mask & (seg == 0)))
  n_masked = int((~mask).sum())
  more = {**f, "loss_mask": np.where(np.arange(mask.shape[1]) % 4 == 3, 0, f["loss_mask"]).astype(np.int32)}
  moved, tokens = _masked_labels_move_loss(cfg, mesh, more, shared)
  kept = int(more["loss_mask"].sum())
  ok = unshifted == 0 and leaks == 0 and moved <= 1e-6 and tokens == kept
  figure = (f"{unshifted} of {int(inside.sum())} labels not the next input; {leaks} labels across a document end "
            f"or on padding trained; changing the {n_masked} masked labels and {int(mask.sum()) - kept} more masked "
            f"here moves the step's loss by {moved:.2g} (relative); the step counts {tokens} tokens, the mask {kept}")
  return Verdict("labels", ok, figure, [_shown(f, 0)])


def _masked_labels_move_loss(cfg, mesh, f: dict, shared: dict) -> tuple[float, int]:
  """(relative change of the step's loss when every masked label is changed, the tokens the step counts); the
  overfit check's compiled step where it ran (its first step's loss does not depend on the schedule)."""
  setup, step = shared.get("step") or (step_lib.Setup(cfg, mesh), None)
  step = step or setup.step
  other = {**f, "targets": np.where(f["loss_mask"] > 0, f["targets"], (f["targets"] + 1) % cfg.model.vocab_size)}
  out = []
  for batch in (f, other):
    _, m = step(setup.init(), setup.device_batch(batch))
    out.append(jax.device_get(m))
  a, b = float(out[0]["loss"]), float(out[1]["loss"])
  return abs(a - b) / max(abs(a), 1e-30), int(out[0]["tokens"])


def logged(cfg, mesh, o: Options, shared: dict) -> Verdict:
  """The first steps' pre-clip gradient norm and learning rate (of the overfit run): finite, the norm above 0,
  the LR the schedule's."""
  if "overfit" not in shared:
    return Verdict("grad norm and LR", False, "no steps to read: the overfit check did not run")
  run_cfg, recs = shared["overfit"]
  schedule = optim_lib.lr_schedule(run_cfg.optim, run_cfg.train.steps)
  factor = optim_lib.batch_factor(run_cfg.optim, ramp.of(run_cfg).size(0))  # optim.lr_reference_batch's
  shown, ok = [], True
  for k, r in enumerate(recs[:3]):
    norm, lr, want = float(r["grad_norm"]), float(r["lr"]), float(schedule(k)) * factor
    ok &= math.isfinite(norm) and norm > 0 and math.isclose(lr, want, rel_tol=1e-6)
    shown.append(f"step {k + 1} grad_norm {norm:.4g} lr {lr:.4g} (schedule {want:.4g})")
  clip = run_cfg.optim.grad_clip
  return Verdict("grad norm and LR", bool(ok), "; ".join(shown) + f"; the norm is before the clip to "
                 f"{clip:g}" if clip else "; ".join(shown) + "; no clipping (optim.grad_clip=0)")


def _records(workdir: Path) -> dict[int, dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def resume(cfg, mesh, o: Options, shared: dict) -> Verdict:
  """R steps, checkpoint, resume to 2R in one workdir, against 2R uninterrupted in another (the real loop, in a
  temporary directory; its output goes to a log there): every step's loss and grad norm equal."""
  R = o.resume_steps
  cfg = _with(cfg, f"train.steps={2 * R}", "run.tensorboard=false")
  with tempfile.TemporaryDirectory(prefix="jaxtrain-debug-") as tmp:
    a, b, log = Path(tmp) / "resumed", Path(tmp) / "straight", Path(tmp) / "loop.log"
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
      loop.run(cfg, mesh, a, "debug", stop_at=R)
      loop.run(cfg, mesh, a, "debug", stop_at=2 * R)
      loop.run(cfg, mesh, b, "debug", stop_at=2 * R)
    ra, rb = _records(a), _records(b)
  steps = range(R + 1, 2 * R + 1)
  if missing := [s for s in steps if s not in ra or s not in rb]:
    return Verdict("resume", False, f"steps {missing[:5]} have no metrics record")
  worst, at = 0.0, None
  for s in steps:
    for k in ("loss", "grad_norm"):
      d = abs(ra[s][k] - rb[s][k]) / max(abs(rb[s][k]), 1e-30)
      if d > worst or not math.isfinite(d):
        worst, at = d, (s, k)
  where = f", largest at step {at[0]} ({at[1]} {ra[at[0]][at[1]]:.6g} vs {rb[at[0]][at[1]]:.6g})" if at else ""
  return Verdict("resume", worst <= o.resume_rtol, f"{R} steps + checkpoint + resume {R} vs {2 * R} uninterrupted: "
                 f"steps {R + 1}..{2 * R} loss and grad_norm differ by {worst:.3g} relative (--resume-rtol "
                 f"{o.resume_rtol:g}){where}")


def mesh_equal(cfg, mesh, o: Options, shared: dict) -> Verdict:
  """K steps in float32 on the mesh and on one device from the same parameters and batches: each step's loss and
  grad norm within the relative tolerance."""
  if mesh.size == 1:
    return Verdict("mesh vs one device", True, "the mesh is one device: nothing to compare")
  cfg = _with(cfg, "model.dtype=float32")
  one = mesh_lib.build(mesh_lib.parse("fsdp=1"), devices=mesh.devices.flat[:1])
  s1, sm = step_lib.Setup(cfg, one), step_lib.Setup(cfg, mesh)
  state1 = s1.init()
  statem = jax.device_put(jax.device_get(state1), sm.state_shardings)
  batches = data.batches(cfg)
  worst, rows = 0.0, []
  try:
    for k in range(o.mesh_steps):
      host = next(batches)
      state1, m1 = s1.step(state1, s1.device_batch(host))
      statem, mm = sm.step(statem, sm.device_batch(host))
      m1, mm = jax.device_get((m1, mm))
      for key in ("loss", "grad_norm"):
        a, b = float(mm[key]), float(m1[key])
        worst = max(worst, abs(a - b) / max(abs(b), 1e-30) if math.isfinite(a - b) else math.inf)
      rows.append(f"  step {k + 1}: loss {float(mm['loss']):.7g} vs {float(m1['loss']):.7g}, grad_norm "
                  f"{float(mm['grad_norm']):.7g} vs {float(m1['grad_norm']):.7g}")
  finally:
    batches.close()
  return Verdict("mesh vs one device", worst <= o.mesh_rtol,
                 f"mesh {mesh_lib.describe(dict(mesh.shape))} vs 1 device, float32, {o.mesh_steps} steps: loss and "
                 f"grad_norm differ by {worst:.3g} relative at most (--mesh-rtol {o.mesh_rtol:g})", rows)
