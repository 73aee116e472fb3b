"""The execution plan of one (config, mesh): decided once at set-up, printed once, passed to the model.

It owns every choice about *how* the model's math runs on the mesh: the logical-to-mesh
rules, the attention kernel (ring / cudnn / xla), the MoE dispatch and its kernel, and the
mesh axis names of the explicit collectives. The model calls `plan.constrain`, `plan.attend`
and `plan.moe_ffn`; it never looks at a mesh itself, so what `describe()` prints is what runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxtrain.model import attention as attention_lib
from jaxtrain.parallel import devices, sharding
from jaxtrain.core.config import TrainConfig
from jaxtrain.core.errors import UserError


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  mesh: Any  # a jax.sharding.Mesh, or None: one device, no annotations
  rules: dict[str, tuple[str, ...]]
  attention: str  # "xla" | "cudnn" | "ring"
  attention_why: str
  ulysses: bool = False  # sequence > 1 by all-to-alls to whole sequences; `attention` is the kernel inside
  moe: str = "dense"  # "dense" | "local" | "all_to_all"
  moe_kernel: str = "capacity"  # "capacity" | "ragged_dot" | "blocks" (the last two: dropless)
  moe_group: int = 0  # capacity group in tokens (model.moe_group_size, what the MoE layer runs); 0 = one sequence
  seq_len: int = 0  # train.seq_len, the tokens of "one sequence" in describe() (0: not known)
  remat: str = "none"
  logits_dtype: str = "float32"  # scores/softmax of the reference kernel
  head_logits_dtype: str = "float32"  # model.head_logits_dtype: the loss's logits and their gradient
  packed_segments: int = 0  # cudnn only: segments go as offsets, at most this many per row (0: an L x L mask)
  loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens  # the loss's tokens per chunk per device (0: unchunked)
  zero_stage: int = 0  # optim.zero_stage: what `data` shards of the train state (see `state_layout`)
  offload: str = "none"  # optim.offload: where the master weights and Adam moments live
  platform: str = "cpu"  # the target device's platform (cpu, gpu, tpu): what its compiler keeps differs
  sequence_axis: str = "sequence"
  expert_axis: str = "expert"
  fp8: str = "none"  # model.fp8: how the projection matmuls run (model/fp8.py)

  def spec(self, axes, shape):
    return sharding.spec_for(axes, shape, self.mesh, rules=self.rules)

  def sharding(self, axes, shape) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(axes, shape))

  def constrain(self, x: jax.Array, axes) -> jax.Array:
    """Annotates an activation with logical axes (nothing without a mesh)."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

  def attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL):
    """Causal grouped-query attention with segment masking, by the kernel this plan chose."""
    if self.attention == "ring":
      from jaxtrain.parallel import ring
      return ring.ring_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, self)
    if self.ulysses:
      from jaxtrain.parallel import ulysses
      return ulysses.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, self)
    return self.local_attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)

  def local_attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL):
    """The chosen kernel on arrays holding whole sequences."""
    if self.attention == "xla":
      return KERNELS["xla"](q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype=jnp.dtype(self.logits_dtype))
    E, Ev = q_BxLxHxE.shape[-1], v_BxLxKxE.shape[-1]
    if Ev < E:  # cuDNN takes one head width (MLA's v is narrower): zero-padded v, its extra outputs cut off
      v_BxLxKxE = jnp.pad(v_BxLxKxE, ((0, 0), (0, 0), (0, 0), (0, E - Ev)))
      return self.attend(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)[..., :Ev]
    if self.packed_segments:
      return attention_lib.packed(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, self.packed_segments)
    return KERNELS[self.attention](q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)

  def check_rows(self, seg_BxL) -> None:
    """Host side: a batch row with more segments than the packed cuDNN layout holds is an error."""
    if self.packed_segments:
      most = int(attention_lib.segments_per_row(seg_BxL).max())
      if most > self.packed_segments:
        raise UserError(f"a batch row holds {most} documents but model.attention_max_segments="
                        f"{self.packed_segments}; raise it to at least {most}, or set it to 0 (L x L mask)")

  def moe_ffn(self, x_BxLxD, router_DxX, w_gate, w_up, w_down, *, top_k: int, capacity_factor: float,
              score: str = "softmax", bias_X=None, **route_kw):
    from jaxtrain.parallel import experts as moe
    return moe.moe_ffn(x_BxLxD, router_DxX, w_gate, w_up, w_down, top_k=top_k, capacity_factor=capacity_factor,
                       plan=self, group_size=self.moe_group, score=score, bias_X=bias_X, **route_kw)

  def describe(self) -> str:
    group = self.moe_group or self.seq_len
    group = f"{group} tokens" if group else "one sequence"
    kernel = (f"capacity groups of {group}" if self.moe_kernel == "capacity"
              else f"dropless, {self.moe_kernel} grouped matmuls")
    moe = {"dense": "", "local": f"; moe: local, {kernel}",
           "all_to_all": f"; moe: all_to_all over {self.expert_axis}, {kernel}"}[self.moe]
    rules = "; sequence-parallel residual stream" if self.rules.get("act_length") != sharding.RULES["act_length"] else ""
    scores = f", {self.logits_dtype} scores" if self.attention == "xla" and self.logits_dtype != "float32" else ""
    return (f"attention: {self.attention} ({self.attention_why}{scores}){moe}; remat {self.remat}{rules}; "
            f"{self.state_layout()}")

  def state_layout(self) -> str:
    data = self.mesh.shape.get("data", 1) if self.mesh is not None else 1
    what = {0: "replicated over data", 1: f"master and moments split over data={data}",
            2: f"master, moments and gradients split over data={data}"}[self.zero_stage]
    where = "; master and moments in host memory" if self.offload == "host" else ""
    return f"train state: zero-{self.zero_stage}, {what}{where}"


# Kernels that run on one shard of heads/batch (the ring calls neither: it scores its own blocks).
KERNELS = {"xla": attention_lib.attention, "cudnn": attention_lib.fused}


def build(cfg, mesh, device=None) -> Plan:
  """The plan for `cfg` on `mesh` (None: one device, nothing sharded). `device`: the target
  device whose kernels to use (anything `devices.of` takes; default: the mesh's first device)."""
  m = cfg.model
  info = devices.of(device if device is not None or mesh is None else mesh.devices.flat[0])
  sp = mesh.shape.get("sequence", 1) if mesh is not None else 1
  ulysses = sp > 1 and m.sequence_attention == "ulysses"
  if sp > 1 and not ulysses:
    if m.attention == "cudnn":
      raise UserError(f"model.attention=cudnn cannot run with sequence={sp}: ring attention computes its own "
                      "blocks; use model.attention=auto or xla, or model.sequence_attention=ulysses")
    impl, why, packed = "ring", f"ring attention over sequence={sp}, zig-zag blocks, online softmax", 0
  else:
    impl, why = attention_lib.select(m, cfg.train.seq_len, info)
    packed = m.attention_max_segments if impl == "cudnn" and attention_lib.uses_packed(m, info) else 0
  if ulysses:
    from jaxtrain.parallel import ulysses as ulysses_lib
    why = f"{ulysses_lib.describe(m, mesh, sharding.rules_for(cfg.run.sequence_parallel))}; {why}"
  moe = "dense" if not m.moe_experts else ("local" if mesh is None else "all_to_all")
  return Plan(mesh=mesh, rules=sharding.rules_for(cfg.run.sequence_parallel), attention=impl, attention_why=why,
              ulysses=ulysses,
              moe=moe, moe_kernel=moe_kernel(m, info.platform), platform=info.platform,
              moe_group=m.moe_group_size, seq_len=cfg.train.seq_len, remat=m.remat,
              logits_dtype=m.attention_logits_dtype, packed_segments=packed, fp8=m.fp8,
              loss_chunk_tokens=cfg.train.loss_chunk_tokens, offload=cfg.optim.offload,
              head_logits_dtype=m.head_logits_dtype,
              zero_stage=cfg.optim.zero_stage if mesh is not None and mesh.shape["data"] > 1 else 0)


def moe_kernel(m, platform: str) -> str:
  """capacity, or the dropless grouped-matmul kernel for the target platform."""
  if not m.moe_experts or not m.moe_dropless:
    return "capacity"
  from jaxtrain.parallel import experts_dropless as moe_dropless
  return moe_dropless.kernel(m.moe_grouped_matmul, platform)


def local(model_cfg=None) -> Plan:
  """One device, reference attention, no annotations: the single-device reference of the tests."""
  m, platform = model_cfg, jax.default_backend()
  own = {} if m is None else dict(moe="local" if m.moe_experts else "dense", moe_kernel=moe_kernel(m, platform),
                                  moe_group=m.moe_group_size, remat=m.remat, logits_dtype=m.attention_logits_dtype,
                                  fp8=m.fp8, head_logits_dtype=m.head_logits_dtype)
  return Plan(mesh=None, rules=dict(sharding.RULES), attention="xla", attention_why="one device, no mesh",
              platform=platform, **own)
