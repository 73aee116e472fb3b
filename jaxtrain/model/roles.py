"""The one parameter-role table: for every parameter of every model family, what it is to the rest of jaxtrain.
The optimizer (decay; Muon or AdamW), the compute copy of ZeRO and offload (cast at use), MoE balancing (router bias),
the pipeline (head, stacked), the memory bill and the Hugging Face maps read it here, never from a name of their own.

A parameter's kind comes from its leaf name (KINDS: every name a model family has; an unknown one is an error, so a
new parameter must say what it is). Weight decay is by rule: every matrix is decayed except the kinds listed in
NOT_DECAYED. The rest follows from where the parameter sits in the tree and from the config: with LoRA
(model.lora_rank) every parameter but the adapters is frozen (`split`: what trains; `stored`: the dtype kept); with
QLoRA (model.lora_base_dtype) the frozen decoder-layer projections are stored as quant.QTensors (`stored`)."""

from __future__ import annotations

import dataclasses

import jax

from jaxtrain.core.schema import ModelConfig
from jaxtrain.model import quant

KINDS = {
    "embed": "embedding",
    "lm_head": "matrix",
    # attention (grouped-query; MLA's low-rank projections), MLP and experts, MTP's input projection
    **dict.fromkeys(("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b"), "matrix"),
    **dict.fromkeys(("w_gate", "w_up", "w_down", "eh_proj"), "matrix"),
    "router": "router",  # a matrix the router uses in float32
    "router_bias": "router_bias",  # aux-loss-free balancing: no gradient, moved by moe_balance
    "scale": "norm",
    "sinks": "sink",  # attention sinks (model.attention_sinks): one logit per query head, used in float32
    # biases (model.attention_bias, model.moe_bias: GPT-OSS), added in the compute dtype; the router's in float32
    **dict.fromkeys(("bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down", "router_logit_bias"), "bias"),
  "lora_a": "adapter",  # LoRA (model.lora_rank): A (in, r) and B (r, out) beside a targeted projection
  "lora_b": "adapter",
}
# input dimensions of a matrix with more than one (attention's output (heads, head_dim, embed)); the rest have one
N_IN = {"wo": 2}
# Matrices not decayed: the embedding (a rare token's row would shrink between the updates that touch it).
NOT_DECAYED = frozenset({"embedding"})
MATRICES = frozenset({"matrix", "embedding", "router", "adapter"})
# used in the compute dtype (the router computes in float32)
CAST_AT_USE = frozenset({"matrix", "embedding", "adapter"})


@dataclasses.dataclass(frozen=True)
class Role:
  kind: str
  decayed: bool  # AdamW's weight decay applies
  cast_at_use: bool  # the model casts it to the compute dtype at every use: its compute copy can be kept so
  router_bias: bool  # moved by the aux-loss-free balancing rule, never by a gradient
  head: bool  # used after the last block: final norm, output head (the embedding when tied), the MTP module
  output: bool  # the output projection (lm_head, or the embedding when tied)
  layer: bool  # in one of the decoder blocks (`layers`, `dense_layers`)
  stacked: bool  # has a leading `layers` axis (a scanned stack, model.scan_layers)
  frozen: bool = False  # LoRA: not trained (no gradient, master or moments); only the adapters train
  quant: str = "none"  # QLoRA: the format it is stored in (model.lora_base_dtype), "none" = a plain array
  in_axis: int = 0  # the (last) input axis of a matrix: quantization's blocks or channels run along it
  lead: int = 0  # leading axes that hold separate matrices (a scanned stack's layers, MoE's experts)

  @property
  def muon(self) -> bool:
    """Updated by Muon under optim.name=muon: a trained projection matrix, seen as (lead.., inputs, outputs). The
    embedding, the output head, norms, routers and biases keep AdamW (Muon is defined for hidden matrices; a
    lookup table's and the logits' rows are not)."""
    return self.kind == "matrix" and not self.output and not self.frozen

  @property
  def low_master(self) -> bool:
    """Stored in the compute dtype, not float32: a frozen weight the model casts at use anyway (no master needed)."""
    return self.frozen and self.cast_at_use

  @property
  def low_gradient(self) -> bool:
    """Its gradient is a matmul's product in the compute dtype (a weight cast at use; not the embedding table,
    whose lookup adds rows in float32): reducing it in that dtype loses nothing the product kept."""
    return self.kind == "matrix" and self.cast_at_use

  @property
  def deferred(self) -> bool:
    """A trained projection of a scanned decoder layer (not MoE's experts): a zero-bubble pipeline's B hands its
    input and output gradient to W, which makes its weight gradient (model/wgrad.py; lora.adapted runs it)."""
    return self.kind == "matrix" and self.layer and self.stacked and self.lead == 1 and not self.frozen

  @property
  def n_in(self) -> int:
    """A matrix's input dimensions (after its `lead` axes)."""
    return self.in_axis - self.lead + 1

  @property
  def matmul(self) -> bool:
    """A weight of a matmul (not a norm scale, a bias, or a lookup table that is not also the head)."""
    return self.kind in ("matrix", "router") or self.output


def decayed(leaf: str) -> bool:
  """Weight decay by rule, from a parameter's leaf name alone: every matrix but the NOT_DECAYED kinds."""
  kind = KINDS.get(leaf)
  return kind in MATRICES and kind not in NOT_DECAYED


def keys_of(path) -> tuple[str, ...]:
  """A tree path (jax key entries, or strings) as plain names."""
  return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def of(cfg: ModelConfig, path) -> Role:
  """The role of the parameter at `path` (e.g. ("layers", 3, "attn", "wq") or jax key entries)."""
  names = keys_of(path)
  leaf, top = names[-1], names[0]
  if leaf not in KINDS:
    raise KeyError(f"parameter {'/'.join(names)}: {leaf!r} has no role in jaxtrain.model.roles.KINDS")
  kind = KINDS[leaf]
  stacked = cfg.scan_layers and top in cfg.stacks()
  lead = int(stacked) + int(kind == "matrix" and _experts(cfg, names, stacked))
  return Role(kind=kind, decayed=decayed(leaf), cast_at_use=kind in CAST_AT_USE,
              router_bias=kind == "router_bias",
              head=top in ("final_norm", "lm_head", "mtp") or (top == "embed" and cfg.tie_embeddings),
              output=top == "lm_head" or (top == "embed" and cfg.tie_embeddings),
              layer=top in ("layers", "dense_layers"), stacked=stacked,
              frozen=cfg.lora_rank > 0 and kind != "adapter", quant=_quant(cfg, names, kind),
              in_axis=lead + N_IN.get(leaf, 1) - 1, lead=lead)


def _experts(cfg: ModelConfig, names, stacked: bool) -> bool:
  """Whether the weight at `names` is MoE's experts' (X, in, out): an `mlp` of a MoE layer (not its shared MLP)."""
  if len(names) < 3 or names[-2] != "mlp" or not cfg.moe_experts:
    return False
  if stacked:  # the `layers` stack is all MoE layers (a dense prefix is `dense_layers`)
    return names[0] == "layers"
  return names[0] == "layers" and cfg.is_moe_layer(int(names[1]))


def _quant(cfg: ModelConfig, names, kind: str) -> str:
  """QLoRA quantizes the decoder layers' frozen projections only: embedding and head stay as LoRA keeps them (as
  bitsandbytes/PEFT QLoRA do), norms float32."""
  if cfg.lora_rank and kind == "matrix" and names[0] in ("layers", "dense_layers"):
    return cfg.lora_base_dtype
  return "none"


def tree(cfg: ModelConfig, params):
  """A tree of `Role`s shaped like `params` (a pure dict, or any tree of arrays)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: of(cfg, path), params)


def mask(cfg: ModelConfig, params, field: str):
  """A tree of bools shaped like `params`: the roles' `field`."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(of(cfg, path), field), params)


def stored(cfg: ModelConfig, params):
  """`params` (float32, as initialized or imported) in the dtypes the train state keeps: LoRA's frozen weights that
  are cast at use in the compute dtype (the model's own cast then changes nothing), the rest float32."""
  if not cfg.lora_rank:
    return params
  def one(path, p):
    role = of(cfg, path)
    if quant.is_quantized(p):  # an import's base, quantized as it was read
      return p
    if role.quant != "none":  # QLoRA: quantized once from the float32 weight, each matrix of a stack alone
      return quantized(role, p)
    return p.astype(cfg.dtype) if role.low_master else p
  return jax.tree_util.tree_map_with_path(one, params, is_leaf=quant.is_quantized)


def quantized(role: Role, w):
  """QLoRA's stored form of the weight `w` whose role is `role`."""
  return quant.quantize(w, role.quant, role.in_axis, role.lead)


def split(cfg: ModelConfig, tree) -> tuple[dict, dict]:
  """(trained, frozen): a tree shaped like the params (nested dicts) in two, each without the other's leaves;
  without LoRA (tree, {})."""
  if not cfg.lora_rank:
    return tree, {}

  def part(node, path, frozen):
    if not isinstance(node, dict):
      return node if of(cfg, path).frozen == frozen else None
    kept = {k: v for k, child in node.items() if (v := part(child, (*path, k), frozen)) is not None}
    return kept or None
  return part(tree, (), False) or {}, part(tree, (), True) or {}


def join(trained: dict, frozen: dict) -> dict:
  """The inverse of `split`: one tree with the leaves of both."""
  if not frozen:
    return trained
  if not isinstance(trained, dict):
    return trained
  return {**frozen, **{k: join(v, frozen[k]) if k in frozen else v for k, v in trained.items()}}
