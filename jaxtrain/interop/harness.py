"""jaxtrain's model as an lm-eval-harness `LM` (the `lm-eval` package): log-likelihoods batched on the mesh and
generation with the KV-cached decoder (interop/decode.py). Text is encoded as lm-eval's own Hugging Face backend
encodes it (TemplateLM: no special tokens added; an empty context is BOS, or EOS without one), so the numbers of the
two backends are the same on the same weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from jaxtrain.interop import decode
from jaxtrain.model import ops
from jaxtrain.parallel import plan as plan_lib, sharding


def _bucket(n: int, limit: int) -> int:
  """Rows padded to a power of two (at least 16, at most `limit`): few shapes, few compiles."""
  return min(max(16, 1 << (n - 1).bit_length()), limit)


class JaxtrainLM(TemplateLM):
  backend = "causal"

  def __init__(self, cfg, mesh, graphdef, params, tok, max_length: int, batch_size: int = 16, compute=None):
    """`params` are used as they are, never copied (training's live parameters); `compute`: params -> the ones the
    model computes with, inside the scoring program (training's Layout.compute: ZeRO's gathered copy)."""
    super().__init__()
    self.cfg, self.mesh, self.graphdef, self.params, self.tok = cfg, mesh, graphdef, params, tok
    self.max_length = max_length
    ways = int(np.prod([mesh.shape[a] for a in sharding.RULES["batch"]]))
    self.batch_size = -(-batch_size // ways) * ways  # rows split over the batch axes
    self._score = _scorer(cfg, mesh, graphdef, compute)

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.eos_id if self.tok.bos_id is None else self.tok.bos_id

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    return self.tok.encode_batch([string])[0].tolist()

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    out = []
    for i in range(0, len(requests), self.batch_size):
      out += self._score_rows([(ctx, cont) for _, ctx, cont in requests[i:i + self.batch_size]])
    return out

  def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives the continuation) of each row; a row
    longer than the context keeps its last max_length + 1 tokens."""
    whole = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in rows]
    L = _bucket(max(len(w) - 1 for w in whole), self.max_length)
    B = self.batch_size
    tokens, targets, seg, mask = (np.zeros((B, L), np.int32) for _ in range(4))
    for b, (w, (_, cont)) in enumerate(zip(whole, rows)):
      n = len(w) - 1
      tokens[b, :n], targets[b, :n], seg[b, :n] = w[:-1], w[1:], 1
      mask[b, n - len(cont):n] = 1
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    logp, greedy = jax.device_get(self._score(self.params, tokens, pos, seg, targets, mask))
    return [(float(logp[b]), bool(greedy[b])) for b in range(len(rows))]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's log-likelihood in windows of max_length tokens, the first predicted from the prefix token."""
    windows, owner = [], []
    for i, (text,) in enumerate(req.args for req in requests):
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append(((None, None), list(ctx), list(cont)))
        owner.append(i)
    sums = np.zeros(len(requests))
    for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
      sums[i] += logp
    return sums.tolist()

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, as gen_kwargs say) continuations, cut at the first `until` string or EOS."""
    out = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    for idx in groups.values():
      kw = dict(requests[idx[0]].args[1])
      until = kw.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = min(int(kw.pop("max_gen_toks", 256)), self.max_length - 1)  # the prompt keeps one token at least
      temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
      for j in range(0, len(idx), self.batch_size):
        part = idx[j:j + self.batch_size]
        prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] or [self.prefix_token_id]
                   for i in part]
        ids = decode.generate(self.cfg, self.mesh, self.graphdef, self.params, prompts, max_new,
                              temperature=temperature, eos_id=self.tok.eos_id)
        for i, new in zip(part, ids):
          text = self.tok.decode([t for t in new if t != self.tok.eos_id])
          for stop in until:
            text = text.split(stop)[0] if stop else text
          out[i] = text
    return out


@functools.lru_cache(maxsize=4)
def _scorer(cfg, mesh, graphdef, compute=None):
  """params, tokens, positions, segments, targets, mask (B, L) -> (sum of masked target log-probs, all masked
  targets argmax) per row, the batch split over the mesh's batch axes."""
  plan = plan_lib.build(cfg, mesh)

  def score(params, tokens, pos, seg, targets, mask):
    with ops.use(plan):
      logits_BxLxV = nnx.merge(graphdef, params if compute is None else compute(params))(tokens, pos, seg)
    logp_BxL = jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV, -1), targets[..., None], -1)[..., 0]
    hit_BxL = jnp.argmax(logits_BxLxV, -1) == targets
    return (logp_BxL * mask).sum(-1), jnp.all(hit_BxL | (mask == 0), -1)
  return jax.jit(score)
