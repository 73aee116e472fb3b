"""XLA flag presets, validated against this jaxlib by a probing subprocess (XLA aborts on an unknown flag),
verdicts cached per jaxlib; applied before the backend starts, the user's own XLA_FLAGS winning."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from jaxtrain.core import files
from jaxtrain.core.errors import UserError

# GPU: overlap collectives with compute, combine small ones, keep matmuls on cuBLAS.
PRESETS: dict[str, list[str]] = {
    "none": [],
    "gpu-default": [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
        "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        "--xla_gpu_enable_triton_gemm=false",
    ],
}
NCCL_TIMEOUT = "--xla_gpu_nccl_termination_timeout_seconds"
NCCL_MARGIN_S = 60  # XLA's NCCL termination (an abort without a report) comes after the hang watchdog's
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
PROBE_TIMEOUT_S = 120


def name_of(flag: str) -> str:
  return flag.split("=", 1)[0]


def parse(text: str) -> list[str]:
  flags = text.split()
  bad = [f for f in flags if not re.fullmatch(r"--[A-Za-z0-9_]+(=.*)?", f)]
  if bad:
    raise UserError(f"run.xla_flags_extra: {' '.join(bad)} is not a flag; write --xla_name=value, space-separated")
  return flags


def extra(cfg) -> str:
  """run.xla_flags_extra, after what the config needs: model.fp8 keeps matmuls on cuBLAS (with Triton GEMMs
  XLA fuses the dots with bf16 operands and drops the FP8 round trip as excess precision; docs/fp8.md)."""
  return ("--xla_gpu_enable_triton_gemm=false " if cfg.model.fp8 != "none" else "") + cfg.run.xla_flags_extra


def nccl_timeout(cfg) -> list[str]:
  """With the GPU preset and the hang watchdog on: a NCCL rendezvous stuck past the watchdog's larger bound (plus a
  margin, so that the watchdog reports first) ends the process. Validated like the preset's flags: a jaxlib without
  it drops it with a warning; a CPU run (no GPU preset) gets no flag line."""
  r = cfg.run
  if r.xla_flags != "gpu-default" or r.hang_timeout_s == 0:
    return []
  return [f"{NCCL_TIMEOUT}={int(max(r.hang_first_step_s, r.hang_timeout_s)) + NCCL_MARGIN_S}"]


class ProbeFailed(Exception):
  """The probe itself failed (not a verdict on any flag): nothing is cached, the next run asks again."""


def _probe(flags: list[str]) -> set[str]:
  """Names XLA rejects among `flags`, found by starting the CPU backend in subprocesses."""
  unknown: set[str] = set()
  while True:
    trial = [f for f in flags if name_of(f) not in unknown]
    if not trial:
      return unknown
    env = {**os.environ, "XLA_FLAGS": " ".join(trial), "JAX_PLATFORMS": "cpu"}
    try:
      r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
      raise ProbeFailed(str(e)) from None
    if r.returncode == 0:
      return unknown
    found = _UNKNOWN.search(r.stderr)
    named = {name_of(f) for f in found.group(1).split()} - unknown if found else set()
    if not named:  # failed for another reason: no verdict on any of them
      last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
      raise ProbeFailed(f"the probe exited {r.returncode}: {last[:200]}")
    unknown |= named


def validate(flags: list[str], cache: Path | None = None) -> tuple[list[str], list[str]]:
  """(kept, dropped): drops flags this jaxlib does not know, and (for this run only, with a one-line warning)
  flags a failed probe could not decide. Only definite verdicts are cached, per flag name."""
  if cache is None:
    import jaxlib
    cache = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxtrain"
             / f"xla_flags-jaxlib-{jaxlib.__version__}.json")
  try:
    known = json.loads(cache.read_text())
  except (OSError, ValueError):
    known = {}
  todo = [f for f in flags if name_of(f) not in known]
  if todo:
    try:
      unknown = _probe(todo)
    except ProbeFailed as e:
      print(f"warning: could not check XLA flag(s) {' '.join(todo)} against this jaxlib ({e}); running without "
            "them, checking again next run", file=sys.stderr)
      return [f for f in flags if known.get(name_of(f))], []
    known.update({name_of(f): name_of(f) not in unknown for f in todo})
    try:
      cache.parent.mkdir(parents=True, exist_ok=True)
      files.write_json_atomic(cache, dict(sorted(known.items())))
    except OSError:
      pass  # a read-only home only costs a probe next time
  return [f for f in flags if known[name_of(f)]], [f for f in flags if not known[name_of(f)]]


def apply(preset: str, extra: str = "", environ=os.environ, cache: Path | None = None,
          unknown: str = "error", with_preset: list[str] = ()) -> list[str]:
  """Adds the known flags of preset and `extra` to environ["XLA_FLAGS"] (the user's win); returns the flags added.
  A flag of `extra` this jaxlib does not know is a UserError naming it, unless `unknown` is "warn"
  (run.xla_flags_unknown); the preset's own, and `with_preset`, are dropped with a warning (an older jaxlib may
  lack one)."""
  ours = PRESETS[preset] + list(with_preset)
  candidates = ours + parse(extra)
  if not candidates:
    return []
  have = environ.get("XLA_FLAGS", "").split()
  taken = {name_of(f) for f in have}
  candidates = [f for f in candidates if name_of(f) not in taken]
  kept, dropped = validate(candidates, cache)
  theirs = [f for f in dropped if f not in ours]
  if theirs and unknown != "warn":
    import jaxlib
    raise UserError(f"run.xla_flags_extra: {' '.join(theirs)}: not a flag this jaxlib ({jaxlib.__version__}) knows; "
                    "correct the name, or --set run.xla_flags_unknown=warn to drop it and run")
  if dropped:
    print(f"warning: dropping XLA flag(s) this jaxlib does not know: {' '.join(dropped)}", file=sys.stderr)
  if kept:
    environ["XLA_FLAGS"] = " ".join(have + kept)
  return kept
