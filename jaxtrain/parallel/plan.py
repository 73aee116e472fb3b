"""The execution plan of one (config, mesh): decided once at set-up, printed once, installed around the step's trace
(jaxtrain.model.ops.use) so that the model, plain math, runs as it says.

It holds the run's config (with what the mesh implies set: `implied`) and the decisions that config and mesh make
together: the rules table, the attention kernel, the MoE dispatch and its kernel. Every other choice is read from
the config where it lives; nothing is copied, so what `describe()` prints is what runs."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core import config as config_lib
from jaxtrain.core.config import Config
from jaxtrain.core.errors import UserError
from jaxtrain.model import attention as attention_lib, flash, loss as xent, ops, quant
from jaxtrain.parallel import devices, fp8, kernels, schedule as schedule_lib, sharding


@dataclasses.dataclass(frozen=True, eq=False)
class Plan(ops.Ops):
  cfg: Config  # the run's config, with the settings the mesh implies (`implied`)
  mesh: Any  # a jax.sharding.Mesh (or the abstract mesh inside a shard_map region), or None: one device
  rules: dict[str, tuple[str, ...]]
  attention: str  # "xla" | "cudnn" | "blocked" | "ring"
  attention_why: str
  ulysses: bool = False  # sequence > 1 by all-to-alls to whole sequences; `attention` is the kernel inside
  moe: str = "dense"  # "dense" | "local" | "all_to_all"
  moe_kernel: str = "capacity"  # "capacity" | "ragged_dot" | "blocks" (the last two: dropless)
  packed_segments: int = 0  # cudnn only: 1 = one segment a row, causal alone; M > 1 = offsets of at most M a row;
  # 0 = an L x L mask (jaxtrain.parallel.kernels.path). Ring with cuDNN pairs: 1 = no mask, 0 = each pair's own
  ring_kernel: str = "flash"  # ring only: "cudnn" on each block pair, else "flash" (ring.pair_problem says why)
  platform: str = "cpu"  # the target device's platform (cpu, gpu, tpu): what its compiler keeps differs
  implied: tuple[str, ...] = ()  # "key=value (why)" for each setting the mesh implied
  ignored: tuple[str, ...] = ()  # keys set that act not with this config and mesh (config.ignored)
  sequence_axis: str = "sequence"
  expert_axis: str = "expert"
  rows_over: tuple[str, ...] = ()  # manual axes whose devices each compute a part of the rows (data_region)
  loss_chunk_tokens: int = ops.LOSS_CHUNK_TOKENS  # what the loss runs: train.loss_chunk_tokens, or `loss_chunk`'s
  loss_why: str = ""  # the plan line's account of it

  @property
  def zero_stage(self) -> int:
    """optim.zero_stage where it acts (config.DEPENDENT: `data` has more than one device to split over), else 0."""
    axes = dict(self.mesh.shape) if self.mesh is not None else {}
    return 0 if "optim.zero_stage" in config_lib.inactive(self.cfg, axes) else self.cfg.optim.zero_stage

  def spec(self, axes, shape):
    return sharding.spec_for(axes, shape, self.mesh, rules=self.rules)

  def sharding(self, axes, shape) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(axes, shape))

  # --- ops: how the model's math runs

  def constrain(self, x: jax.Array, axes) -> jax.Array:
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

  def compute_spec(self, axes, shape) -> P:
    """A weight's compute layout: `embed`'s fsdp/expert split is storage (gathered for the matmul); tensor and
    expert splits stay."""
    return sharding.spec_for(tuple(axes), shape, self.mesh, rules={**self.rules, "embed": ()})

  def dequantize(self, q, axes, dtype):
    """The codes and scales gathered to the weight's compute layout (`compute_spec`) first, then dequantized
    there: the wire carries 4-bit codes, not the float32 values XLA would otherwise gather after the lookup."""
    if self.mesh is None:
      return quant.dequantize(q, dtype)
    lead = q.lead
    shape = (*q.codes.shape[:lead], *q.shape)
    spec = self.compute_spec(axes, shape)
    codes, scales, _ = quant.split_axes(shape, q.fmt, spec, lambda e: sharding.ways(e, self.mesh), q.in_axis + lead,
                                        lead)
    keep = lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*s)))  # noqa: E731
    return quant.dequantize(dataclasses.replace(q, codes=keep(q.codes, codes), scales=keep(q.scales, scales)), dtype)

  def ways(self, axes, shape) -> tuple[int, ...]:
    if self.mesh is None:
      return (1,) * len(shape)
    return tuple(sharding.ways(e, self.mesh) for e in self.spec(axes, shape))

  def lookup(self, table_VxD, tokens_BxL):
    """Inside a region manual over data, every row is looked up split like the table's d_model, from token ids
    replicated over the other batch axes, before the model moves the rows to its batch split: XLA's SPMD
    partitioner aborts (spmd_partitioner_util.cc:497) when the lookup goes to the batch split directly there and
    fsdp splits both the rows and the table's d_model (with tensor or pipeline also > 1). The ids are int32."""
    if not (self.rows_over and self.mesh is not None):
      return jnp.take(table_VxD, tokens_BxL, axis=0)
    ids = (None,) * (tokens_BxL.ndim - 1) + ("length",)  # (B, L), or the pipeline's (k, B/k, L)
    rows = jnp.take(table_VxD, self.constrain(tokens_BxL, ids), axis=0)
    return self.constrain(rows, (*ids, "embed"))

  def batch_mean(self, x_mean):
    """The devices' equal shares averaged (forward); the gradient reaches each share as its 1/n part of the mean
    (no collective in the backward: the update reduces the gradients over these axes once)."""
    if not self.rows_over:
      return x_mean
    own = x_mean / jax.lax.psum(1, self.rows_over)
    return own + jax.lax.stop_gradient(jax.lax.psum(own, self.rows_over) - own)

  def cast(self, w, axes, dtype):
    """XLA:CPU: cast where the weight is stored (its split) and gather the compute dtype's bits to the weight's
    compute layout (`compute_spec`). XLA:CPU gathers a
    bfloat16 array as float32, and a cast weight it gathers in float32 and casts after: twice the bytes, and the
    gathered float32 copy among the step's temporaries. XLA's GPU passes already move the cast ahead of the gather."""
    if self.mesh is None or axes is None or self.platform != "cpu" or jnp.dtype(w.dtype) == jnp.dtype(dtype):
      return w.astype(dtype)
    used = NamedSharding(self.mesh, self.compute_spec(axes, w.shape))
    return _cast_in_place(w, jnp.dtype(dtype), self.sharding(axes, w.shape), used)

  def project(self, fn, x, w, *args):
    return fp8.matmul(self.cfg.model.fp8, fn, x, w, *args)

  def attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype: str = "float32", window: int = 0,
             sinks_H=None):
    """Causal grouped-query attention with segment masking (a local layer's `window`, sinks), by the kernel this
    plan chose."""
    qkv_seg = (q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)
    if self.attention == "ring":
      from jaxtrain.parallel import ring
      return ring.ring_attention(*qkv_seg, self, window=window, sinks_H=sinks_H)
    if self.ulysses:
      from jaxtrain.parallel import ulysses
      return ulysses.attend(*qkv_seg, self, logits_dtype, window=window, sinks_H=sinks_H)
    if self.mesh is not None and (self.attention == "blocked" or (
        self.attention == "cudnn" and jax.sharding.get_abstract_mesh().manual_axes)):
      return self._in_region(*qkv_seg, window, sinks_H)
    return self.local_attend(*qkv_seg, logits_dtype, window, sinks_H)

  def local_attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype: str = "float32", window: int = 0,
                   sinks_H=None):
    """The chosen kernel on arrays holding whole sequences (never dispatches again: ulysses calls it inside its
    own shard_map). cuDNN is never chosen with sinks (kernels.select)."""
    if self.attention == "xla":
      return attention_lib.attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, jnp.dtype(logits_dtype), window,
                                     sinks_H)
    if self.attention == "blocked":
      return flash.attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, window, sinks_H)
    E, Ev = q_BxLxHxE.shape[-1], v_BxLxKxE.shape[-1]
    if Ev < E:  # cuDNN takes one head width (MLA's v is narrower): zero-padded v, its extra outputs cut off
      v_BxLxKxE = jnp.pad(v_BxLxKxE, ((0, 0), (0, 0), (0, 0), (0, E - Ev)))
    if self.packed_segments == 1:
      o = kernels.fused(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, None, window=window)
    elif self.packed_segments:
      o = kernels.packed(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, self.packed_segments, window=window)
    else:
      o = kernels.fused(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, window=window)
    return o[..., :Ev]

  def _in_region(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, window: int = 0, sinks_H=None):
    """The kernel in a shard_map manual over every axis not manual yet: attention is local to its rows and heads.
    The blocked kernel's loops stay whole that way; cuDNN inside a partially manual region (the pipeline's) needs
    it, its custom partitioning not reading such a region's shardings (jax 0.10.2: "'GSPMDSharding' object has no
    attribute 'spec'"). Heads are split only where q's and k/v's split alike (a query head meets its kv head)."""
    q, kv = (self.spec(("batch", "length", h, None), x.shape) for h, x in (("act_heads", q_BxLxHxE),
                                                                             ("act_kv_heads", k_BxLxKxE)))
    heads = q[2] if q[2] == kv[2] else None
    q, kv = P(q[0], q[1], heads, None), P(kv[0], kv[1], heads, None)
    rest = set(self.mesh.axis_names) - set(jax.sharding.get_abstract_mesh().manual_axes)
    sinks = () if sinks_H is None else (sinks_H,)
    def local(q, k, v, seg, *s):
      return self.local_attend(q, k, v, seg, window=window, sinks_H=s[0] if s else None)
    return sharding.manual(local, self.mesh, (q, kv, kv, P(q[0], q[1]), *(P(heads),) * len(sinks)), q,
                           axis_names=rest)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, *sinks)

  def experts(self, x_BxLxD, idx_BxLxk, w_BxLxk, weights, group: int, capacity: int | None, act=None):
    from jaxtrain.parallel import experts
    return experts.ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, group, capacity, self, act)

  def expert_projection(self):
    """`project` for the expert kernels, None where it is plain (the blocks kernel then skips empty blocks)."""
    return None if self.cfg.model.fp8 == "none" else self.project

  def expert_einsum(self, spec: str, x, w):
    return self.project(lambda a, b: jnp.einsum(spec, a, b), x, w)

  # --- host side, and the start-up line

  def check_rows(self, seg_BxL) -> None:
    """Host side: a batch row with more segments than the cuDNN path was compiled for is an error."""
    if self.packed_segments:
      most = int(kernels.segments_per_row(seg_BxL).max())
      if most > self.packed_segments:
        raise UserError(f"a batch row holds {most} documents but the attention was planned for at most "
                        f"{self.packed_segments} ({self.attention_why}); raise model.attention_max_segments to "
                        f"at least {most}")

  def describe(self) -> str:
    m = self.cfg.model
    group = m.moe_group_size or self.cfg.train.seq_len
    kernel = (f"capacity groups of {group} tokens" if self.moe_kernel == "capacity"
              else f"dropless, {self.moe_kernel} grouped matmuls")
    moe = {"dense": "", "local": f"; moe: local, {kernel}",
           "all_to_all": f"; moe: all_to_all over {self.expert_axis}, {kernel}"}[self.moe]
    rules = "; sequence-parallel residual stream" if self.rules.get("act_length") != sharding.RULES["act_length"] else ""
    scores = (f", {m.attention_logits_dtype} scores" if self.attention == "xla" and m.attention_logits_dtype != "float32"
              else "")
    fp8_line = (f"; FP8 projections (model.fp8={m.fp8}): every projection matmul, not the embedding, LM head or "
                "router" if m.fp8 != "none" else "")
    implied = f"; set by the mesh: {', '.join(self.implied)}" if self.implied else ""
    local = sum(1 for w in m.layer_windows() if w)
    windows = (f"; sliding window {m.sliding_window} on {local} of {m.n_layers} layers"
               + ("; ring skips the blocks outside it" if self.attention == "ring" else "")) if local else ""
    sinks = "; attention sinks" if m.attention_sinks else ""
    ignored = f"\nignored: {'; '.join(self.ignored)}" if self.ignored else ""
    return (f"attention: {self.attention} ({self.attention_why}{scores}){windows}{sinks}{moe}; remat {m.remat}"
            f"{rules}{fp8_line}; loss: {self.loss_why}; "
            f"{self.state_layout()}{implied}{ignored}")

  def state_layout(self) -> str:
    data = self.mesh.shape.get("data", 1) if self.mesh is not None else 1
    what = {0: "replicated over data", 1: f"master and moments split over data={data}",
            2: f"master, moments and gradients split over data={data}"}[self.zero_stage]
    where = "; master and moments in host memory" if self.cfg.optim.offload == "host" else ""
    return f"train state: zero-{self.zero_stage}, {what}{where}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_in_place(w, dtype, stored, used):
  bits = jax.lax.with_sharding_constraint(_bits(w.astype(dtype)), stored)
  out = jax.lax.with_sharding_constraint(bits, used)
  return jax.lax.bitcast_convert_type(out, dtype) if out.dtype != dtype else out


def _bits(x):
  """A 16-bit float's bits as uint16 (XLA:CPU moves integers as they are)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _cast_in_place_fwd(w, dtype, stored, used):
  return _cast_in_place(w, dtype, stored, used), jnp.zeros((0,), w.dtype)


def _cast_in_place_bwd(dtype, stored, used, res, g):
  # the cast's own transpose where the gradient is (the projection's layout); XLA reduces it to the weight's split
  # in the weight's dtype afterwards, as it did without this
  return (g.astype(res.dtype),)


_cast_in_place.defvjp(_cast_in_place_fwd, _cast_in_place_bwd)


def implied(cfg: Config, mesh) -> tuple[Config, tuple[str, ...]]:
  """The config with every setting the mesh implies set, and a note for each: a pipeline runs stacked layers, zbv
  and dualpipev two chunks per device, interleaved and looped-bfs at least two."""
  p = mesh.shape.get("pipeline", 1) if mesh is not None else 1
  if p == 1:
    return cfg, ()
  notes, m, pc = [], cfg.model, cfg.pipeline
  if not m.scan_layers:
    m = dataclasses.replace(m, scan_layers=True)
    notes.append(f"model.scan_layers=true (pipeline={p} stages hold slices of the stacked layers)")
  v_shaped = pc.schedule in schedule_lib.V_SHAPED
  if pc.virtual_stages == 1 and (v_shaped or pc.schedule in ("interleaved", "looped-bfs")):
    pc = dataclasses.replace(pc, virtual_stages=2)
    notes.append(f"pipeline.virtual_stages=2 (pipeline.schedule={pc.schedule} runs "
                 f"{'two' if v_shaped else 'at least two'} chunks per device)")
  return dataclasses.replace(cfg, model=m, pipeline=pc), tuple(notes)


def build(cfg: Config, mesh, device=None, segments: int | None = None) -> Plan:
  """The plan for `cfg` on `mesh` (None: one device, nothing sharded). `device`: the target device whose kernels to
  use (anything `devices.of` takes; default: the mesh's first device, or this host's). `segments`: the most
  segments a row of the run's data holds (`jaxtrain.data.most_segments`; None: not known), for cuDNN's path."""
  cfg, notes = implied(cfg, mesh)
  m = cfg.model
  info = devices.of(device if device is not None or mesh is None else mesh.devices.flat[0])
  sp = mesh.shape.get("sequence", 1) if mesh is not None else 1
  rules = sharding.rules_for(cfg.run.sequence_parallel)
  ulysses = sp > 1 and m.sequence_attention == "ulysses"
  ring_kernel = "flash"
  if sp > 1 and not ulysses:
    from jaxtrain.parallel import ring
    problem = ring.pair_problem(m, cfg.train.seq_len, info)
    if m.attention == "cudnn" and problem:
      raise UserError(f"model.attention=cudnn cannot run with sequence={sp}: ring attention computes its own "
                      f"blocks, and cannot call cuDNN on them here ({problem}); use model.attention=auto or xla, or "
                      "model.sequence_attention=ulysses")
    ring_kernel = "flash" if problem else "cudnn"
    impl, why = "ring", f"ring attention over sequence={sp}, zig-zag blocks, {ring.pair_words(problem, segments)}"
    packed = int(ring_kernel == "cudnn" and segments == 1)  # 1: no masks (check_rows refuses data with more)
  else:
    impl, why, packed = kernels.select(m, cfg.train.seq_len, info, segments)
  if ulysses:
    from jaxtrain.parallel import ulysses as ulysses_lib
    why = f"{ulysses_lib.describe(m, mesh, rules)}; {why}"
  moe = "dense" if not m.moe_experts else ("local" if mesh is None else "all_to_all")
  plan = Plan(cfg=cfg, mesh=mesh, rules=rules, attention=impl, attention_why=why, ulysses=ulysses, moe=moe,
              moe_kernel=moe_kernel(m, info.platform), packed_segments=packed, ring_kernel=ring_kernel,
              platform=info.platform,
              implied=notes, ignored=tuple(config_lib.ignored(cfg, dict(mesh.shape) if mesh is not None else {})))
  chunk, loss_why = loss_chunk(plan, info)
  if cfg.train.objective == "dpo":  # run/dpo.py: per-token log-probabilities from the whole logits
    loss_why = f"DPO's log-probabilities from the whole logits; evaluation: {loss_why}"
  return dataclasses.replace(plan, loss_chunk_tokens=chunk, loss_why=loss_why)


LOSS_MEMORY_SHARE = 32  # automatic loss: a chunk's float32 logits within 1/32 of a GPU's memory


def loss_chunk(plan: Plan, info: devices.Info) -> tuple[int, str]:
  """(tokens a chunk of the loss holds per device, 0 = the plain loss; the plan line's words): the config's
  train.loss_chunk_tokens, or for -1 (automatic) on a CUDA GPU the fewest chunks whose float32 logits stay within
  1/LOSS_MEMORY_SHARE of its memory (one where the whole microbatch's do), elsewhere (CPU, TPU: not measured)
  1024-token chunks. Never the plain loss: its autodiff makes three more passes over float32 logits (the label
  term scattered into zeros, a product, a cast: 21 GB against the chunk's 4.2 GB at llama3-1b batch 4 x 2048, 3.5 ms
  of an H200's bandwidth, compile-only) and reduces the head's gradient across devices in float32. Nor more chunks
  than needed: each reads and rewrites the head's float32 gradient, 8 x d_model x vocab bytes (8 chunks measured
  158.3 ms against the plain loss's 155.0 on an H200, issue 53)."""
  t, vocab = plan.cfg.train, plan.cfg.model.vocab_size
  if t.loss_chunk_tokens >= 0:
    return t.loss_chunk_tokens, ("plain (train.loss_chunk_tokens=0)" if not t.loss_chunk_tokens
                                 else f"chunks of {t.loss_chunk_tokens} tokens a device")
  entry = info.entry if info.cuda else None
  if entry is None or not entry.memory_bytes:
    return ops.LOSS_CHUNK_TOKENS, f"chunks of {ops.LOSS_CHUNK_TOKENS} tokens a device"
  rows = max(t.batch_size // t.microbatches, 1)
  bw, sw = plan.ways(("batch", "length"), (rows, t.seq_len))
  rows, length = max(rows // bw, 1), max(t.seq_len // sw, 1)  # a device's share of a microbatch
  per_token = 4 * -(-vocab // plan.ways(("act_vocab",), (vocab,))[0])  # a token's float32 logits on a device
  budget = entry.memory_bytes // LOSS_MEMORY_SHARE
  c = xent.chunk_length(rows, length, max(ops.LOSS_CHUNK_TOKENS, budget // per_token))
  n, size = length // c, rows * c * per_token
  held = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
  return rows * c, (f"{n} chunk{'s' * (n > 1)} of {rows * c} tokens a device (float32 logits {held}, within "
                    f"1/{LOSS_MEMORY_SHARE} of the {info.key}'s memory)")


def moe_kernel(m, platform: str) -> str:
  """capacity, or the dropless grouped-matmul kernel for the target platform: `auto` is ragged_dot on TPU, else
  blocks (XLA:GPU, as XLA:CPU, rewrites ragged_dot into dense dots over every group: (rows, experts, d_model)
  buffers, 112 GiB per DeepSeek-V3 layer)."""
  if not m.moe_experts or not m.moe_dropless:
    return "capacity"
  if m.moe_grouped_matmul == "auto":
    return "ragged_dot" if platform == "tpu" else "blocks"
  return m.moe_grouped_matmul


def local(cfg: Config) -> Plan:
  """One device, no annotations, this host's kernels: the single-device reference of the tests."""
  return build(cfg, None)

