"""What the compiled train step costs beyond the model's math.

- `efficiency`: XLA's cost analysis of the compiled (per-device) program against the model
  FLOPs of the MFU formula (how much recompute and waste the program does), and its bytes
  accessed against the per-device train state.
- `breakdown`: where the time of a few real steps goes, per XLA operation, from a
  jax.profiler trace (the thunks/kernels the runtime records), each op named by the HLO
  metadata of the program (the jax op and its source) where it has one.
"""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path


def cost_analysis(compiled) -> dict:
  """XLA's cost analysis as one dict (older jax returned a list with one dict per program)."""
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return dict(ca or {})


def efficiency(compiled, model_flops_per_device: float, state_bytes_per_device: int) -> dict:
  """XLA's cost analysis with every loop body counted as often as it runs (the scan over
  microbatches or layers; `gpu_compile.cost`), else the plain analysis (bodies once)."""
  from jaxtrain.analysis import gpu_compile
  loops = gpu_compile.cost(gpu_compile.Hlo.parse(compiled.as_text())) or {}
  if "flops" in loops:
    flops, accessed, how = loops["flops"], loops["bytes_accessed"], "loop bodies x trip count"
  else:
    ca = cost_analysis(compiled)
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


def _is_runtime_line(plane: str, line: str) -> bool:
  """Lines whose events are XLA's executed ops: GPU streams, or XLA:CPU's client threads."""
  return plane.startswith("/device:") or line.startswith("tf_XLA")


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
      if not _is_runtime_line(plane.name, line.name):
        continue
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
