"""What the compiled train step costs beyond the model's math: `efficiency` (XLA's cost
analysis of the per-device program against the model FLOPs and the train state) and
`breakdown` (time per XLA op of a few real steps, from a jax.profiler trace, each op named
by the jax op in the program's HLO metadata)."""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path


def efficiency(compiled, model_flops_per_device: float, state_bytes_per_device: int) -> dict:
  """XLA's cost analysis with every loop body counted as often as it runs (the scan over
  microbatches or layers; `gpu_compile.cost`), else the plain analysis (bodies once)."""
  from jaxtrain.analysis import gpu_compile
  loops = gpu_compile.cost(gpu_compile.Hlo.parse(compiled.as_text())) or {}
  if "flops" in loops:
    flops, accessed, how = loops["flops"], loops["bytes_accessed"], "loop bodies x trip count"
  else:
    ca = compiled.cost_analysis() or {}
    flops, accessed, how = ca.get("flops"), ca.get("bytes accessed"), "loop bodies counted once"
  return {
      "compiled_flops_per_device": flops,
      "compiled_over_model_flops": flops / model_flops_per_device if flops and model_flops_per_device else None,
      "bytes_accessed_per_device": accessed,
      "bytes_accessed_over_state": accessed / state_bytes_per_device if accessed and state_bytes_per_device else None,
      "source": f"XLA cost analysis of the per-device program ({how}); model FLOPs from jaxtrain.model.flops",
  }


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"", re.M)


def op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> the jax op_name recorded in its metadata."""
  return {m.group(1): m.group(2) for m in _OP.finditer(hlo_text)}


def breakdown(run_steps, steps: int, hlo_text: str, top: int = 10, logdir: Path | None = None) -> dict:
  """Traces `run_steps(steps)` and returns the `top` ops by total time per step."""
  import jax
  logdir = Path(logdir or tempfile.mkdtemp(prefix="jaxtrain-breakdown-"))
  with jax.profiler.trace(str(logdir)):
    run_steps(steps)
  traces = sorted(logdir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
  if not traces:
    return {"available": False, "why": "the profiler wrote no trace"}
  data = jax.profiler.ProfileData.from_file(str(traces[-1]))
  total: collections.Counter = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if not (plane.name.startswith("/device:") or line.name.startswith("tf_XLA")):
        continue  # XLA's executed ops are on GPU streams, or XLA:CPU's client threads
      for ev in line.events:
        if not ev.name.startswith(("end:", "ThunkExecutor", "ThreadpoolListener")):
          total[ev.name] += ev.duration_ns
  if not total:
    return {"available": False, "why": "no per-op events in the trace on this backend"}
  names = op_names(hlo_text)
  all_ns = sum(total.values())
  rows = [{"op": name, "ms_per_step": ns / 1e6 / steps, "share": ns / all_ns, "jax_op": names.get(name, "")}
          for name, ns in total.most_common(top)]
  return {"available": True, "steps": steps, "ops_ms_per_step": all_ns / 1e6 / steps, "top": rows,
          "trace": str(traces[-1])}
