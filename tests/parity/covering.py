"""The pairwise matrix of jaxtrain's options: a covering array where every pair of option values that can run
together is in some row, each row a config and mesh that must equal its one-device run; and one row per refused
pair, which must be refused in one line naming both options. `python -m tests.parity.covering` prints it.

A factor may be conditional (`when`): a schedule only means something with a pipeline, the sequence attention with a
sequence axis, the routing bias with experts. A pair counts as covered only in a row where both are in force. The
generator is greedy (each new row takes the values that cover the most uncovered pairs, in a seeded order), so the
matrix is the same on every machine. The VIEWS (run.trackers, train.eval_tasks) never change the step: their levels
are given to those rows afterwards, and their refusals are listed with the others."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

AXES = ("data", "fsdp", "tensor", "sequence", "expert", "pipeline")


@dataclass(frozen=True)
class Factor:
  name: str
  levels: tuple
  when: tuple[str, tuple] | None = None  # (factor, the levels it needs) to be in force

  def active(self, row: dict) -> bool:
    return self.when is None or row.get(self.when[0]) in self.when[1]


FACTORS = (
    *(Factor(a, (1, 2)) for a in AXES),
    Factor("sequence_attention", ("ring", "ulysses"), when=("sequence", (2,))),
    Factor("sequence_parallel", (False, True)),
    Factor("schedule", ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"), when=("pipeline", (2,))),
    Factor("zero_stage", (0, 1, 2)),
    Factor("offload", ("none", "host")),
    Factor("remat", ("none", "full", "save_dots")),
    Factor("scan_layers", (False, True)),
    Factor("microbatches", (1, 2)),
    Factor("attention", ("mha", "gqa", "mla")),
    Factor("tied", (False, True)),
    Factor("qk_norm", (False, True)),
    Factor("moe", ("dense", "capacity", "dropless")),
    Factor("routing_bias", (False, True), when=("moe", ("capacity", "dropless"))),
    Factor("mtp", (False, True)),
    Factor("fp8", ("none", "tensorwise")),
    Factor("dtype", ("float32", "bfloat16", "float16")),
    Factor("lora", ("off", "on", "nf4")),  # nf4: QLoRA, the frozen base stored in 4 bits
    Factor("objective", ("lm", "dpo")),
    Factor("optim", ("adamw", "muon")),  # optim.name
    # the LR schedule: in steps; in tokens (train.tokens, optim.warmup_tokens, optim.lr_reference_batch); or that
    # with train.batch_ramp (its steps run below train.batch_size)
    Factor("schedule_in", ("steps", "tokens", "ramp")),
    Factor("qk_clip", (False, True)),  # optim.qk_clip (MuonClip's rescale after the update)
    Factor("state_dtype", ("float32", "bfloat16", "int8")),  # optim.state_dtype: no refused pair (Muon's momentum,
    # offload's units, LoRA's adapters and ZeRO/FSDP shards keep it too)
    Factor("window", ("none", "local", "alternate")),  # model.sliding_window on every layer, or every other
    Factor("sinks", (False, True)),  # model.attention_sinks
    Factor("kernel", ("auto", "blocked")),  # model.attention: auto (the XLA reference on CPU), or the blocked kernel
    Factor("in_backward", (False, True)),  # optim.in_backward
    Factor("attention_bias", (False, True)),  # model.attention_bias (GPT-OSS's q/k/v/o biases)
    Factor("moe_bias", (False, True), when=("moe", ("capacity", "dropless"))),  # model.moe_bias: router, experts
    Factor("activation", ("swiglu", "swiglu_clamped", "gelu_tanh")),  # model.mlp_activation
    # Gemma 3's block: model.norm_convention=one_plus, post_norms, embed_scale (its GeGLU: `activation`),
    # attention_scale (and rope_local_theta with a window). Not under float16: in float32 a gemma row equals its
    # one-device run to 1e-6, but float16's 10-bit mantissa moved the third step's gradient norm by 1.8e-3 (over
    # float16's 1e-3) and with FP8 by 0.23 (fsdp=2,tensor=2,pipeline=2, interleaved, MTP, sinks)
    Factor("gemma", (False, True), when=("dtype", ("float32", "bfloat16"))),
)
# Options that never change the step (what is logged where, what is evaluated beside it): their levels are given to
# the rows of the factors above after those are chosen (so those rows stay as they were), and a row added for them
# alone repeats a step already in the matrix (`math_rows`: each step once).
VIEWS = (
    Factor("trackers", ("tensorboard", "wandb,mlflow", "none")),  # run.trackers
    Factor("eval_tasks", (False, True)),  # train.eval_tasks every train.eval_tasks_interval steps
)
ALL = FACTORS + VIEWS
BY_NAME = {f.name: f for f in ALL}

# Pairs refused in one line, with the words the refusal must contain (both options named) and why.
REFUSED = {
    (("pipeline", 2), ("sequence", 2)): (("pipeline=2", "sequence=2"), "the pipeline's region is manual over "
                                         "`pipeline` only; ring and Ulysses attention would nest their own regions"),
    (("pipeline", 2), ("microbatches", 1)): (("train.microbatches=1", "pipeline"), "every stage needs a microbatch"),
    **{(("lora", lora), pair): (("model.lora_rank=", words), "LoRA trains attention, MLP and expert projections, "
                                "with the optimizer state on the device, on a mesh without a pipeline")
       for lora in ("on", "nf4")
       for pair, words in ((("mtp", True), "model.mtp_layers=1"),
                           (("fp8", "tensorwise"), "model.fp8='tensorwise'"),
                           (("offload", "host"), "optim.offload='host'"), (("pipeline", 2), "pipeline=2"))},
    **{(("objective", "dpo"), pair): (("train.objective=dpo", words), "DPO (jaxtrain.run.dpo.check): its pairs "
                                      "and reference pass not on a pipeline, nor with MTP, MoE or host offload yet")
       for pair, words in ((("pipeline", 2), "pipeline=2"), (("mtp", True), "model.mtp_layers=1"),
                           (("moe", "capacity"), "model.moe_experts=4"), (("moe", "dropless"), "model.moe_experts=4"),
                           (("offload", "host"), "optim.offload=host"))},
    **{(("optim", "muon"), pair): (("optim.name='muon'", words), "Muon (core.checks.check_optim): its state on the "
                                   "device, its matrices the model's own projections")
       for pair, words in ((("offload", "host"), "optim.offload='host'"), (("lora", "on"), "model.lora_rank="),
                           (("lora", "nf4"), "model.lora_rank="))},
    **{(("eval_tasks", True), pair): (("train.eval_tasks=", words), "lm-eval's model (interop/harness.py) runs the "
                                      "whole layer stack on device-resident, dense parameters")
       for pair, words in ((("pipeline", 2), "pipeline=2"), (("offload", "host"), "optim.offload='host'"),
                           (("lora", "nf4"), "model.lora_base_dtype='nf4'"))},
    **{(("qk_clip", True), pair): (("optim.qk_clip=", words), "QK-clip (core.checks.check_qk_clip, step's mesh "
                                   "check): a rule for grouped-query W_q/W_k only, its pass outside a pipeline")
       for pair, words in ((("attention", "mla"), "model.attention_type='mla'"), (("qk_norm", True), "model.qk_norm"),
                           (("lora", "on"), "model.lora_rank="), (("lora", "nf4"), "model.lora_rank="),
                           (("offload", "host"), "optim.offload='host'"), (("mtp", True), "model.mtp_layers=1"),
                           (("pipeline", 2), "pipeline=2"), (("window", "local"), "model.sliding_window="),
                           (("window", "alternate"), "model.sliding_window="),
                           (("sinks", True), "model.attention_sinks=true"),
                           (("attention_bias", True), "model.attention_bias=true"))},
    **{(("attention", "mla"), pair): (("model.attention_type=mla", words), "sliding windows, sinks and q/k/v/o "
                                      "biases are grouped-query attention's (core.checks.validate)")
       for pair, words in ((("window", "local"), "model.sliding_window="), (("window", "alternate"),
                                                                            "model.sliding_window="),
                           (("sinks", True), "model.attention_sinks=true"),
                           (("attention_bias", True), "model.attention_bias=true"))},
    (("gemma", True), ("attention", "mla")): (("model.attention_scale=", "model.attention_type=mla"), "MLA's softmax "
                                              "scale is its own (core.checks.validate)"),
    **{(("activation", "gelu_tanh"), ("moe", moe)): (("model.mlp_activation='gelu_tanh'", "model.moe_experts="),
                                                     "the experts are SwiGLU (core.checks.validate)")
       for moe in ("capacity", "dropless")},
    (("window", "alternate"), ("pipeline", 2)): (("model.layer_types='alternate'", "pipeline=2"), "the matrix's "
                                                 "pipelines hold one layer a chunk: their chunks' windows differ"),
    **{(("in_backward", True), pair): (("optim.in_backward=true", words), "the update in the backward "
                                       "(core.checks.check_in_backward): AdamW on dense scanned layers, one "
                                       "microbatch, the state where the step computes")
       for pair, words in ((("microbatches", 2), "train.microbatches="), (("scan_layers", False), "model.scan_layers"),
                           (("moe", "capacity"), "model.moe_experts=4"), (("moe", "dropless"), "model.moe_experts=4"),
                           (("lora", "on"), "model.lora_rank="), (("lora", "nf4"), "model.lora_rank="),
                           (("objective", "dpo"), "train.objective=dpo"), (("optim", "muon"), "optim.name='muon'"),
                           (("zero_stage", 1), "optim.zero_stage=1"), (("zero_stage", 2), "optim.zero_stage=2"),
                           (("offload", "host"), "optim.offload='host'"),
                           (("state_dtype", "bfloat16"), "optim.state_dtype="), (("state_dtype", "int8"),
                                                                                "optim.state_dtype="),
                           (("qk_clip", True), "optim.qk_clip="), (("schedule_in", "tokens"), "train.tokens="),
                           (("schedule_in", "ramp"), "train.tokens="),
                           (("window", "local"), "model.sliding_window="),
                           (("window", "alternate"), "model.sliding_window="))},
    # (with a pipeline, which needs 2 microbatches here, the pair is never alone: test_in_backward refuses it)
}


def feasible(row: dict) -> bool:
  """What a row must satisfy besides the refusals: at most 8 devices (the suite's), every factor set."""
  return math.prod(row[a] for a in AXES) <= 8


def refused(row: dict) -> list[tuple]:
  """The refused pairs a row holds."""
  return [pair for pair in REFUSED
          if all(row.get(n) == v and BY_NAME[n].active(row) for n, v in pair)]


def _pairs(row: dict, factors: tuple = ALL) -> set:
  act = [(f.name, row[f.name]) for f in factors if f.name in row and f.active(row)]
  return {tuple(sorted(p)) for p in itertools.combinations(act, 2)}


def all_pairs(factors: tuple = ALL) -> set:
  """Every pair of (factor, level) that some feasible, unrefused row holds with both in force."""
  out = set()
  for a, b in itertools.combinations(factors, 2):
    for la, lb in itertools.product(a.levels, b.levels):
      pair = tuple(sorted([(a.name, la), (b.name, lb)]))
      if _completable(dict(pair)):
        out.add(pair)
  return out


def _completable(fixed: dict) -> bool:
  """Whether a feasible unrefused row holds `fixed` with every factor of it in force."""
  row = _complete(fixed, random.Random(0), None)
  return row is not None and all(BY_NAME[n].active(row) for n in fixed)


def _complete(fixed: dict, rng: random.Random, want: set | None, factors: tuple = ALL):
  """A feasible, unrefused row holding `fixed`: `factors` in a seeded order, each the level that covers most of
  `want` with what is chosen so far (None: the first that keeps the row possible)."""
  row = dict(fixed)
  for name in fixed:  # a conditional factor's value means something only with its condition
    if (when := BY_NAME[name].when) is not None:
      if row.setdefault(when[0], when[1][0]) not in when[1]:
        return None
  # the factors others depend on first, so that `when` can be honoured
  order = sorted((f for f in factors if f.name not in row), key=lambda f: (f.when is not None, rng.random()))
  for f in order:
    levels = list(f.levels)
    rng.shuffle(levels)
    best = None
    for lv in levels:
      trial = {**row, f.name: lv}
      if not _possible(trial):
        continue
      gain = 0 if want is None else sum(
          1 for other, olv in trial.items() if other != f.name and BY_NAME[other].active(trial) and f.active(trial)
          and tuple(sorted([(f.name, lv), (other, olv)])) in want)
      if best is None or gain > best[0]:
        best = (gain, lv)
    if best is None:
      return None
    row[f.name] = best[1]
  return row if feasible(row) and not refused(row) else None


def _possible(partial: dict) -> bool:
  """A partial row that can still be completed: within the device budget with the rest at 1, nothing refused."""
  if math.prod(partial.get(a, 1) for a in AXES) > 8:
    return False
  return not [pair for pair in REFUSED if all(partial.get(n) == v for n, v in pair)]


def matrix(seed: int = 0, candidates: int = 30) -> list[dict]:
  """Rows covering every pair of `all_pairs`: those of FACTORS greedily (the best of `candidates` seeded rows at
  each step), then the VIEWS' levels given to them, and rows of the same steps added for the VIEWS' pairs left."""
  rng = random.Random(seed)
  want, rows = all_pairs(FACTORS), []
  while want:
    first = sorted(want)[0]  # an uncovered pair seeds every candidate: progress is guaranteed
    best = None
    for _ in range(candidates):
      row = _complete(dict(first), rng, want, FACTORS)
      if row is None or not all(BY_NAME[n].active(row) for n, _ in first):
        continue
      gain = len(_pairs(row, FACTORS) & want)
      if best is None or gain > best[0]:
        best = (gain, row)
    if best is None:
      raise AssertionError(f"no row holds {first}")
    rows.append(best[1])
    want -= _pairs(best[1], FACTORS)
  return _with_views(rows)


def _with_views(steps: list[dict]) -> list[dict]:
  """`steps` with the VIEWS' levels that cover most pairs still wanted, then copies of them with other levels for
  the pairs left (each the copy that covers most; a new step where none of them can hold a pair)."""
  want, rows = all_pairs() - set().union(*(_pairs(r, FACTORS) for r in steps)), []

  def viewed(step: dict, fixed: dict) -> dict | None:
    row = {**step, **fixed}
    for f in VIEWS:
      if f.name not in fixed:
        fits = [lv for lv in f.levels if not refused({**row, f.name: lv})]
        row[f.name] = max(fits, key=lambda lv: len(_pairs({**row, f.name: lv}) & want), default=None)
    return row if not refused(row) and None not in row.values() else None
  for step in steps:
    rows.append(viewed(step, {}))
    want -= _pairs(rows[-1])
  while want:
    first = sorted(want)[0]
    fixed = {n: v for n, v in first if n in {f.name for f in VIEWS}}
    options = [r for r in (viewed(step, fixed) for step in steps) if r is not None and set(first) <= set(r.items())]
    if not options:  # no step so far can hold it: a new step for it
      options = [r for r in (_complete(dict(first), random.Random(i), want) for i in range(30)) if r is not None]
    if not options:
      raise AssertionError(f"no row holds {first}")
    rows.append(max(options, key=lambda r: len(_pairs(r) & want)))
    want -= _pairs(rows[-1])
  return rows


def math_rows(rows: list[dict]) -> list[dict]:
  """Each step of `rows` once (the first row of it): the VIEWS do not change it."""
  seen, out = set(), []
  for r in rows:
    if (key := tuple(r[f.name] for f in FACTORS)) not in seen:
      seen.add(key)
      out.append(r)
  return out


def refusal_rows() -> list[tuple[dict, tuple, str]]:
  """One row per refused pair, every other factor at its first level that refuses nothing else: (row, words,
  why)."""
  out = []
  for pair, (words, why) in REFUSED.items():
    row = dict(pair)
    row.update({BY_NAME[n].when[0]: BY_NAME[n].when[1][0] for n, _ in pair if BY_NAME[n].when})  # pair in force
    for f in ALL:
      if f.name not in row:
        row[f.name] = next(lv for lv in f.levels if refused({**row, f.name: lv}) == [pair])
    out.append((row, words, why))
  return out


if __name__ == "__main__":
  rows = matrix()
  print(f"{len(rows)} rows ({len(math_rows(rows))} steps) cover {len(all_pairs())} pairs; {len(REFUSED)} refused "
        "pairs")
  for r in rows:
    print({k: v for k, v in r.items() if BY_NAME[k].active(r)})
