"""The analytic memory bill per device, from the real shardings, without allocating.

Formulas: docs/inspect.md, "The memory bill"; checked against XLA:GPU's compile there (docs/gpu-compile.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
import re

import jax
import numpy as np
from flax import nnx

from jaxtrain.analysis.activation_bytes import (  # noqa: F401 (memory.activations: the API callers use)
    activations, blocked_workspace, dims, layer_residuals, pipeline_activations, saved_per_token, workspace)
from jaxtrain.core.errors import UserError
from jaxtrain.model import quant, roles
from jaxtrain.parallel import devices, pipeline, program
from jaxtrain.parallel import sharding
from jaxtrain.run import moments, muon as muon_lib

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--device-memory") -> int:
  """'80GiB', '80GB', '85899345920' -> bytes."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS:
    raise UserError(f"{flag} {text!r} is not a size; use e.g. 80GiB, 80GB or a number of bytes")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def device_memory(text: str | None, device_kind: str) -> tuple[int | None, str]:
  """(bytes, where it came from) for --device-memory SIZE|KIND, else the local device's kind."""
  if text and text.strip()[:1].isdigit():
    return parse_size(text), text
  entry = devices.of(text or device_kind).entry
  if text and entry is None:
    raise UserError(f"--device-memory {text!r} is neither a size (e.g. 80GiB) nor a known device kind: "
                    f"{', '.join(devices.TABLE)}")
  return (entry.memory_bytes, text or device_kind) if entry else (None, "unknown")


def _path(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class Row:
  """One parameter (or one group of identical repeated ones, `count` > 1)."""
  path: str
  axes: tuple
  spec: tuple
  shape: tuple[int, ...]
  device_shape: tuple[int, ...]
  dtype: str
  bytes: int  # per device, one instance
  count: int = 1
  role: roles.Role | None = None  # what the parameter is (jaxtrain.model.roles)


def param_rows(setup, stored: bool = False) -> list[Row]:
  """Every parameter with its logical axes, PartitionSpec, per-device shape and bytes: in the compute layout, or
  `stored`: the master as the train state keeps it (run/layout.py's, ZeRO included; the bill's master and moments)."""
  rows = []
  shardings = setup.layout.stored if stored else setup.param_shardings
  for path, var in jax.tree_util.tree_leaves_with_path(setup.abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    keys = [getattr(k, "key", k) for k in path]
    sh = functools.reduce(operator.getitem, keys, shardings)
    role = roles.of(setup.cfg.model, keys)
    if isinstance(sh, quant.QTensor):  # QLoRA's stored base: its codes and scales on one device
      rows.append(_quantized_row(keys, var, sh, role))
      continue
    spec = tuple(sh.spec) + (None,) * (len(var.shape) - len(sh.spec))
    dshape = tuple(sh.shard_shape(var.shape))
    dtype = np.dtype(setup.cfg.model.dtype if role.low_master else var.dtype)  # LoRA's frozen base: no master
    rows.append(Row("/".join(map(str, keys)), tuple(var.get_metadata()["axes"]), spec, tuple(var.shape), dshape,
                    dtype.name, math.prod(dshape) * dtype.itemsize, role=role))
  return rows


def _quantized_row(keys, var, sh, role) -> Row:
  """A QLoRA base weight as stored: quant.nbytes of the codes and scales one device holds (spec: the codes')."""
  codes, scales = quant.stored_shapes(var.shape, role.quant, role.in_axis, role.lead)
  dcodes, dscales = tuple(sh.codes.shard_shape(codes)), tuple(sh.scales.shard_shape(scales))
  n_codes = math.prod(dcodes)  # one byte each: an int8 code, or a uint8 of two nf4 codes
  spec = tuple(sh.codes.spec) + (None,) * (len(codes) - len(sh.codes.spec))
  return Row("/".join(map(str, keys)), tuple(var.get_metadata()["axes"]), spec, tuple(var.shape), dcodes,
             role.quant, n_codes + 4 * math.prod(dscales), role=role)


_LAYER = re.compile(r"(^|/)layers/\d+(/|$)")


def generic_path(text: str) -> str:
  """'layers/3/attn/wq' -> 'layers/*/attn/wq': the one pattern for a repeated layer's path."""
  return _LAYER.sub(r"\1layers/*\2", text)


def grouped(rows: list[Row]) -> list[Row]:
  """Repeated layers (layers/0/..., layers/1/...) shown once with a count where identical."""
  groups: dict[tuple, list[Row]] = {}
  for r in rows:
    groups.setdefault((generic_path(r.path), r.axes, r.spec, r.shape, r.dtype), []).append(r)
  return [dataclasses.replace(g[0], path=k[0] if len(g) > 1 else g[0].path, count=len(g)) for k, g in groups.items()]


def state_bytes(setup) -> dict[str, int]:
  """Per-device bytes of the real train state by part: params (the float32 master), adam_m (first moments: Muon's
  momentum too), adam_v (AdamW's second moments: none for Muon's matrices), counters, and
  with train.objective=dpo the frozen reference (run/dpo.py)."""
  out = {"params": 0, "adam_m": 0, "adam_v": 0, "counters": 0, **({"reference": 0} if "ref" in
                                                                  setup.state_shardings else {})}
  shards = jax.tree.leaves(setup.state_shardings)
  for (path, sds), sh in zip(jax.tree_util.tree_leaves_with_path(setup.state_shapes), shards, strict=True):
    p = _path(path)
    n = math.prod(sh.shard_shape(sds.shape)) * np.dtype(sds.dtype).itemsize
    part = ("params" if p.startswith("params/") else "reference" if p.startswith("ref/") else
            "adam_m" if "/mu/" in f"/{p}/" else
            "adam_v" if "/nu/" in f"/{p}/" else "counters")
    out[part] += n
  return out


def offload_unit_bytes(setup) -> int:
  """Per-device bytes of master and moments of the largest unit the offloaded update brings to the device at
  once (`offload.streamed_update`): one non-layer parameter, or one layer (a slice of a scanned stack)."""
  units = collections.Counter()
  shards = jax.tree.leaves(setup.state_shardings)
  for (path, sds), sh in zip(jax.tree_util.tree_leaves_with_path(setup.state_shapes), shards, strict=True):
    keys = _path(path).split("/")
    if keys[0] != "params" and "mu" not in keys and "nu" not in keys:
      continue  # counters
    shape = sh.shard_shape(sds.shape)
    n = math.prod(shape) * np.dtype(sds.dtype).itemsize
    if "layers" not in keys:
      units[keys[keys.index("params" if keys[0] == "params" else "mu" if "mu" in keys else "nu") + 1]] += n
    elif (i := keys[keys.index("layers") + 1]).isdigit():
      units[i] += n
    else:
      units["slice"] += n // shape[0]
  return max(units.values())


def step_bytes(setup) -> dict[str, int]:
  """Per-device bytes of what the step makes from the state: the compute copy of the parameters (none when
  the step uses the master itself) and one gradient (float32, in the gradients' sharding)."""
  s = np.dtype(setup.cfg.model.dtype).itemsize
  out = {"compute": 0, "gradients": 0}
  params = nnx.to_pure_dict(setup.abstract_params)
  for (path, x), c in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(setup.param_shardings),
                          strict=True):
    cast = roles.of(setup.cfg.model, path).cast_at_use
    out["compute"] += math.prod(c.shard_shape(x.shape)) * (s if cast else 4) if setup.layout.separate else 0
  trained = roles.split(setup.cfg.model, params)[0]  # LoRA: only the adapters have a gradient
  stacks = setup.cfg.model.stacks() if setup.cfg.optim.in_backward else {}
  for (path, x), g in zip(jax.tree_util.tree_leaves_with_path(trained), jax.tree.leaves(setup.grad_shardings),
                          strict=True):
    # the update in the backward: a stack's gradient one layer at a time
    layers = x.shape[0] if path[0].key in stacks else 1
    out["gradients"] += math.prod(g.shard_shape(x.shape)) * 4 // layers
  return out


def muon_work(setup) -> tuple[int, str]:
  """Per-device bytes of Muon's orthogonalization at its peak (0 without optim.name=muon), and which way runs
  (run/muon.py's `route`, per Muon parameter): one parameter's matrices whole in the NS dtype, three times (the
  iterate, the next one, the product) and the two Gram matrices; on owner devices a device's share of the batch
  (ceil(batch / group)), gathered one layer of a stack (lead axes split as stored),
  as stored the parameter's local matrices."""
  cfg = setup.cfg
  if cfg.optim.name != "muon":
    return 0, ""
  s = 4 if cfg.model.dtype == "float32" else 2
  params, most, ways = nnx.to_pure_dict(setup.abstract_params), 0, collections.Counter()
  for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(setup.layout.stored),
                           strict=True):
    role = roles.of(cfg.model, path)
    if not role.muon:
      continue
    spec = muon_lib.full_spec(sh, x.ndim)
    r = muon_lib.route(role, x.shape, spec, setup.mesh)
    ways[r.way, tuple(a for a in setup.mesh.axis_names if a in r.moved)] += 1
    local = [x.shape[i] // sharding.ways(spec[i], setup.mesh) for i in range(role.lead)]
    if r.way == "owner":
      count = -(-r.batch // r.group)  # the batch: a device's slice of the lead axes
    else:  # gathered: one layer of a stack at a time
      count = math.prod(local[int(role.stacked and r.way == "gather"):])
    m, n = muon_lib.matrix_dims(role, x.shape)
    most = max(most, count * (3 * m * n + 2 * min(m, n) ** 2) * s)
  said = {"owner": "on owner devices: all-to-all over {}", "gather": "gathered whole on each device of {}",
          "local": "whole as stored"}
  return most, "; ".join(f"{k} parameter{'s' * (k > 1)} {said[way].format('x'.join(moved))}"
                         for (way, moved), k in sorted(ways.items()))


def w_wait(cfg, mesh, rows: list[Row]) -> tuple[int, str]:
  """A split backward's (zb-h1, zbv; dualpipev's split passes) W slots: per pass of a chunk, each deferred
  projection's input and output gradient (one microbatch, the compute dtype; split over tensor where the weight's
  side is), from its B to its W."""
  t = pipeline.table(cfg, mesh)
  if not t.split:
    return 0, f"none ({t.name} does not split the backward)"
  slots = program.program_table(t)[3] + 1
  tensor = mesh.shape.get("tensor", 1)

  def sides(r):
    named = [(a,) if isinstance(a, str) else tuple(a or ()) for a in r.spec[1:]]
    dims = [n // (tensor if "tensor" in a else 1) for n, a in zip(r.shape[1:], named)]
    return math.prod(dims[:r.role.n_in]) + math.prod(dims[r.role.n_in:])
  per_pass = (cfg.model.n_layers // t.chunks * sharding.tokens_per_device(cfg, mesh)
              * np.dtype(cfg.model.dtype).itemsize * sum(sides(r) for r in rows if r.role.deferred))
  return slots * per_pass, (f"{slots} W slots ({slots - 1} + 1 discard) of {human(per_pass)}: per pass, each "
                            "projection's input and output gradient, from B to W (model/wgrad.py)")


def pipeline_lines(cfg, mesh, rows: list[Row]) -> dict[str, tuple[int, str]]:
  """Mesh pipeline > 1, the bill's lines that differ: the gradient a backward makes of one chunk (float32)
  before adding it, no stacked weight casts (each block casts its weights inside its remat), W's slots."""
  v = cfg.pipeline.virtual_stages
  f32 = lambda keep: sum(math.prod(r.device_shape) * 4 * r.count for r in rows if keep(r))  # noqa: E731
  layers = f32(lambda r: r.role.layer)
  head = f32(lambda r: r.role.head)
  restack = f"; v={v}: the stage's layers in chunk order too, {human(layers)}" if v > 1 else ""
  return {"grad_accumulator": (layers // v + head + (layers if v > 1 else 0),
                               f"float32 gradient of one chunk (1/{v} of the stage's layers) and the head, made by a "
                               f"backward before it is added to the gradients{restack}"),
          "weight_residuals": (0, "none: a backward recomputes its chunk from the chunk input and each block casts "
                               "its weights inside its remat (no stacked casts in the compiled program)"),
          "w_wait": w_wait(cfg, mesh, rows)}


def _gathered(r: Row, mesh) -> int:
  """How many ways FSDP (the batch-like axes) splits this parameter: the gather factor.
  The experts dimension's split over `expert` is not gathered: each device runs its own."""
  return math.prod(mesh.shape[a] for name, e in zip(r.axes, r.spec) if e and name != "experts"
                   for a in (e if isinstance(e, tuple) else (e,)) if a in sharding.RULES["batch"])


def gather_axes(rows: list[Row], mesh, keep=lambda r: True) -> str:
  """The batch-like axes (size > 1) splitting kept matmul weights outside experts, as 'fsdp=2 x expert=2'; or ''."""
  axes = {a for r in rows if r.role.matmul and keep(r) for name, e in zip(r.axes, r.spec) if e and name != "experts"
          for a in (e if isinstance(e, tuple) else (e,)) if a in sharding.RULES["batch"] and mesh.shape[a] > 1}
  return " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names if a in axes)


def _gathered_notes(cfg, rows: list[Row], mesh, piped: bool, lm_head: int) -> tuple[str, str]:
  """(gathered_weights' note, relaid_stacks' note), naming the axes that really gather (none: not gathered)."""
  layers, head = gather_axes(rows, mesh, lambda r: r.role.layer), gather_axes(rows, mesh, lambda r: not r.role.layer)
  which = ("1 layer's matmul weights (a pipeline's peak; measured)" if piped else
           f"2 layers' matmul weights (the running one and the next{'/re-gathered' if layers else ''} one)")
  how = f"gathered over {layers}" if layers else "cast, not gathered (no batch-like mesh axis splits them),"
  relaid = (f"float32 copies of the stacked weights gathered over {layers} on a minor dimension, laid out again for "
            "the per-layer gathers (XLA:GPU)" if layers else "none: no weight is gathered")
  return (f"{cfg.model.dtype}, {how} one layer at a time: {which}; lm_head {human(lm_head)} is "
          + (f"gathered over {head} during the loss phase" if head else "cast, not gathered, for the loss phase"), relaid)


def gathered_weights(cfg, rows: list[Row], mesh, at_once: int = 2) -> dict[str, int]:
  """Compute-dtype matmul weights per device: `layers`, `at_once` layers' gathered over FSDP at once
  (2: running + next/re-gathered, as comms.py; a pipeline's peak holds one, measured); `lm_head`, gathered for
  the logits; `stored`, the layers' as stored (sharded), which the backward keeps (the bill's weight_residuals)."""
  s = np.dtype(cfg.model.dtype).itemsize
  out = {"layers": 0, "lm_head": 0, "stored": 0}
  for r in rows:
    if not r.role.matmul:
      continue
    full = math.prod(r.device_shape) * _gathered(r, mesh) * s * r.count
    if r.role.layer:  # a pipeline device holds n_layers / pipeline of them
      out["layers"] += at_once * (full * mesh.shape.get("pipeline", 1) // cfg.model.n_layers)
      out["stored"] += math.prod(r.device_shape) * s * r.count
    else:
      out["lm_head"] += full
  return out


def relaid_stacks(rows: list[Row]) -> int:
  """Per-device bytes of the stacked (scan_layers) parameters whose FSDP-split dimension is not the first one that
  holds more than one element (experts' weights, down and output projections): XLA:GPU copies each such float32
  stack whole, once per step, into a layout with that dimension major for the per-layer all-gathers (seen in the
  deepseek-v3 compile: 9.6 GiB a device, most of the gap to the bill)."""
  out = 0
  for r in rows:
    split = [j for j, (name, e) in enumerate(zip(r.axes, r.spec)) if e and name != "experts"
             and set(e if isinstance(e, tuple) else (e,)) & set(sharding.RULES["batch"])]
    if r.axes[:1] == ("layers",) and split and any(n > 1 for n in r.device_shape[1:split[0]]):
      out += r.bytes * r.count
  return out


@dataclasses.dataclass
class Bill:
  items: dict[str, int]          # name -> bytes per device, margin included
  notes: dict[str, str]          # name -> how it is counted
  total: int
  full_remat_activations: int
  host_per_host: int = 0         # master and moments kept in host memory (offload), all local devices


def reference_line(cfg, st: dict) -> dict[str, tuple[int, str]]:
  """DPO's frozen reference (train.objective=dpo), if any; its whole-microbatch float32 logits are not counted yet."""
  if "reference" not in st:
    return {}
  return {"reference": (st["reference"], f"DPO's frozen reference: {cfg.model.dtype} matmul weights, sharded like the "
                        "compute copy")}


def _update_phases(setup, rows: list[Row], work: dict, gathered_layers: int) -> None:
  """What LoRA adds to the layer phase, and the optimizer's own phases (Muon's orthogonalization, offload's units),
  into `work` (phase -> bytes)."""
  cfg, mesh = setup.cfg, setup.mesh
  if cfg.model.lora_rank:  # backward's gradient of one layer's x A, and of its merged expert weights (float32)
    d = dims(cfg, mesh)
    work["layer phase"] += d["T"] * d["s"] * lora_ranks(rows)[1] + 4 * merged_experts(rows)[1]
  if cfg.optim.name == "muon":  # after the backward: no gathered weights beside it
    most, ways = muon_work(setup)
    work[f"Muon orthogonalization ({ways})"] = most
  if cfg.optim.offload == "host":  # the update brings one unit's master and moments at a time, and makes new ones
    work["offload update phase"] = gathered_layers + 2 * offload_unit_bytes(setup)


def bill(setup, rows: list[Row], margin: float, plan=None) -> Bill:
  """The bill for `plan`'s attention kernel (default: the step's own plan; inspect passes
  the plan of a target device such as an H100 when the mesh here is simulated)."""
  cfg, mesh = setup.cfg, setup.mesh
  plan = plan or setup.plan
  kernel, packed = plan.attention, plan.packed_segments
  st, made = state_bytes(setup), step_bytes(setup)
  t, remat = cfg.train, cfg.model.remat
  batch = 5 * 4 * (t.batch_size // sharding.axis_ways("batch", t.batch_size, mesh)) * (
      t.seq_len // sharding.axis_ways("length", t.seq_len, mesh))
  piped = mesh.shape.get("pipeline", 1) > 1
  act = (pipeline_activations if piped else functools.partial(activations, logits_residual=False))(
      cfg, mesh, remat, kernel, packed)
  # pipeline: XLA:GPU's peak (a chunk's layer phase, beside two gradient stacks) holds one layer's gathered weights
  gathered = gathered_weights(cfg, rows, mesh, 1 if piped else 2)
  work = workspace(cfg, mesh, remat, kernel, packed, gathered["layers"], plan.platform, plan.loss_chunk_tokens)
  _update_phases(setup, rows, work, gathered["layers"])
  p, host = plan.zero_stage, "host" if plan.cfg.optim.offload == "host" else ""
  stored, grads = _state_notes(cfg, p, host, st)
  on_device = lambda part: 0 if host else st[part]  # noqa: E731
  kept = st["params"] + st["adam_m"] + st["adam_v"]  # offload: the master read for the compute copy, the state
  moved = (f"; per step {human(st['params'] + 2 * kept)} to the device, {human(kept)} back (the master for the "
           "compute copy, master and moments in both passes of offload.streamed_update)") if host else ""
  gathered_note, relaid_note = _gathered_notes(cfg, rows, mesh, piped, gathered["lm_head"])
  lines = {  # name: (bytes per device, how it is counted)
      "params": (made["compute"], f"compute copy: matmul weights {cfg.model.dtype}, norms float32, gathered for "
                 "the step") if setup.layout.separate else (st["params"], "float32; they are the master copy"
                                                            + _frozen_note(cfg)),
      "master": (on_device("params"), f"float32 master weights, {stored}{moved}{_frozen_note(cfg)}")
                if setup.layout.separate
                else (0, "none: the params are the master"),
      "gradients": (made["gradients"], grads),
      "grad_accumulator": (made["gradients"], f"float32 sum over {t.microbatches} microbatches, {grads}"
                           + ("" if p == 2 else ": this device's rows, reduced over data once, after the last"))
                          if t.microbatches > 1 else (0, "none (1 microbatch)"),
      "adam_m": (on_device("adam_m"), moments_note(cfg, stored) + (
          "; AdamW's first moment, and Muon's momentum of its matrices" if cfg.optim.name == "muon" else "")),
      "adam_v": (on_device("adam_v"), moments_note(cfg, stored) + (
          "; AdamW's second moment of the rest only (Muon keeps one moment)" if cfg.optim.name == "muon" else "")),
      "counters": (st["counters"], "step, Adam count, loss scale"),
      "batch": (batch, "inputs, targets, positions, segment ids, loss mask (int32)"),
      "weight_residuals": _weight_residuals(cfg, gathered["stored"]),
      "activations": (sum(act.values()), f"kept for backward: remat {remat}, attention {kernel}, one microbatch"
                      + (" through one pipeline chunk, and the schedule's stash" if piped else "") + ": "
                      + ", ".join(f"{k} {human(v)}" for k, v in act.items())),
      "gathered_weights": (gathered["layers"], gathered_note),
      "relaid_stacks": (relaid_stacks(rows), relaid_note),
      "workspace": (max(work.values()) - gathered["layers"], "transient peak beyond the gathered weights, the larger "
                    "phase of: " + ", ".join(f"{k} {human(v)}" for k, v in work.items())),
  }
  lines.update({**(pipeline_lines(cfg, mesh, rows) if piped else {}), **reference_line(cfg, st),
                **dequantized_line(cfg, rows), **lora_line(cfg, mesh, rows)})
  items = {k: v for k, (v, _) in lines.items()}
  notes = {k: note for k, (_, note) in lines.items()}
  items["margin"] = int(margin * sum(items.values()))
  notes["margin"] = f"temporaries and communication buffers: {margin:.0%} of the items above"
  full = sum(activations(cfg, mesh, "full", kernel, packed, logits_residual=False).values())
  me = mesh.devices.flat[0].process_index  # offload: every device of this host keeps its shards in host memory
  per_host = sum(d.process_index == me for d in mesh.devices.flat) if host else 0
  return Bill(items, notes, sum(items.values()), full, per_host * kept)


def _state_notes(cfg, p: int, host: str, st: dict) -> tuple[str, str]:
  """(where the master and moments are kept, how the gradients are) for ZeRO stage `p` and offload `host`."""
  stored = (f"in host memory ({human(st['params'])} of master per device)" if host else
            "float32, " + ("sharded like the params" if p == 0 else "split over data too (zero_stage)"))
  grads = "float32, " + ("split over data (zero_stage 2)" if p == 2 else "sharded like the params") + (
      "; one layer of each stack at a time beside the embedding's, head's and norms' (optim.in_backward)"
      if cfg.optim.in_backward else "")
  return stored, grads


def moments_note(cfg, stored: str) -> str:
  """How a moment is kept (optim.state_dtype, run/moments.py), and where (`stored`: the master's note)."""
  kind = {"float32": "float32", "bfloat16": "bfloat16 (optim.state_dtype)",
          "int8": (f"int8 codes and a float32 scale per {moments.BLOCK} values (optim.state_dtype; float32 for "
                   f"parameters under {moments.MIN_QUANTIZED} values)")}[cfg.optim.state_dtype]
  return kind + stored.removeprefix("float32")


def dequantized_line(cfg, rows: list[Row]) -> dict:
  """QLoRA: the model dequantizes a layer's quantized projections where the layer runs (transformer.dense), in the
  compute dtype and layout, and backward makes them again: one layer's live at a time. A stack's row holds all its
  layers (a layer is a 1/n slice); rows of unscanned layers are each one layer's, counted once (so a model whose
  layers differ is billed the sum of each kind's: at most a layer too many)."""
  if cfg.model.lora_base_dtype == "none":
    return {}
  quantized = [r for r in rows if r.role is not None and r.role.quant != "none"]
  per_stack: dict[str, int] = {}
  for r in quantized:
    top = r.path.split("/")[0]
    per_stack[top] = per_stack.get(top, 0) + (r.bytes // r.shape[0] if r.role.stacked else r.bytes)
  n = max(per_stack.values(), default=0)
  return {"dequantized_base": (n, f"one layer's {cfg.model.lora_base_dtype} decoder projections dequantized to "
                                  f"{cfg.model.dtype} where it runs (sharded like the params); made again by "
                                  "backward, never kept")}


def lora_ranks(rows: list[Row]) -> tuple[int, int]:
  """LoRA: (rank values a token over every layer, over one layer) of the adapters applied as x A B beside their
  projection (lora.adapted); MoE experts' adapters are merged into the expert weights instead (lora.effective),
  weight-sized. One layer: the largest stack's (unscanned layers' rows: each kind's summed, as dequantized_line)."""
  every, one = 0, {}
  for r in rows:
    if r.path.endswith("lora_a") and "experts" not in r.axes:  # A (*layers, *in, rank)
      every += r.device_shape[-1] * (r.shape[0] if r.role.stacked else r.count)
      one[r.path.split("/")[0]] = one.get(r.path.split("/")[0], 0) + r.device_shape[-1]
  return every, max(one.values(), default=0)


def merged_experts(rows: list[Row]) -> tuple[int, int]:
  """LoRA on MoE experts: (elements per device over every layer, over one layer) of the expert weights whose
  adapters the layer merges in (lora.effective: W + A B in the compute dtype, weight-sized, not rank-sized)."""
  merged = {r.path[:-len("_lora/lora_a")] for r in rows if r.path.endswith("_lora/lora_a") and "experts" in r.axes}
  every = one = 0
  for r in rows:
    if r.path in merged:  # a QLoRA base row holds codes: two nf4 values a byte
      n = math.prod(r.device_shape) * (2 if r.dtype == "nf4" else 1)
      every += n * r.count
      one += n // r.shape[0] if r.role.stacked else n
  return every, one


def lora_line(cfg, mesh, rows: list[Row]) -> dict:
  """LoRA: each adapted projection's x A (rank values a token, compute dtype) kept for B's gradient (every layer's
  with remat none or save_dots, else the layer backward recomputes), and with remat none the adapters'
  compute-dtype casts. Rank-sized: a rank far above the model's width makes them the largest items."""
  if not cfg.model.lora_rank:
    return {}
  s, T = np.dtype(cfg.model.dtype).itemsize, dims(cfg, mesh)["T"]
  every, one = lora_ranks(rows)
  kept_all = cfg.model.remat in ("none", "save_dots")
  xa = T * s * (every if kept_all else one)
  adapters = sum(r.bytes * r.count for r in rows if r.path.endswith(("lora_a", "lora_b")))  # float32
  casts = adapters * s // 4 if s < 4 and cfg.model.remat == "none" else 0
  every_w, one_w = merged_experts(rows)
  merged = s * (every_w if cfg.model.remat == "none" else one_w)
  dt, where = cfg.model.dtype, "every layer's" if kept_all else "the layer backward recomputes"
  return {"lora_activations": (xa + casts + merged, f"x A of each adapted projection ({human(xa)}: {dt}, rank "
                               f"{cfg.model.lora_rank} a token, {where}), the adapters' {dt} casts ({human(casts)})"
                               + (f", the experts' merged weights ({human(merged)})" if merged else "")
                               + ", kept for backward")}


def _weight_residuals(cfg, stored: int) -> tuple[int, str]:
  """The compute-dtype casts of the layers' weights that backward keeps; none of LoRA's frozen base, which is
  stored as the step uses it and read in place (QLoRA: dequantized a layer at a time, the dequantized_base line)."""
  if cfg.model.lora_rank:
    return 0, ("none: LoRA's frozen base is read in place by the backward (stored as used); the adapters' casts "
               "are rank-sized")
  remat = cfg.model.remat
  return (stored if remat == "none" else stored // 2,
          f"{cfg.model.dtype} casts of the layers' weights, as stored (sharded), kept for backward"
          + ("" if remat == "none" else " (about half of them with remat; measured)"))


def _frozen_note(cfg) -> str:
  """LoRA: what the params line holds beside the adapters' master."""
  if cfg.model.lora_base_dtype != "none":
    return (f" (the adapters'); the frozen base is stored quantized ({cfg.model.lora_base_dtype} decoder projections: "
            f"codes and float32 scales; embedding and head {cfg.model.dtype}, norms float32), with no master, "
            "gradient or moments")
  return (f" (the adapters'); the frozen base is stored as used ({cfg.model.dtype} matmul weights, norms float32), "
          "with no master, gradient or moments") if cfg.model.lora_rank else ""


def human(n) -> str:
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"
