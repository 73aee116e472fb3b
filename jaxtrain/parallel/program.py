"""A pipeline schedule's table as the program's columns: per (tick, device) which branch runs on which microbatch
and chunk, and the buffer slot every input is read from and every output written to (pure numpy)."""

from __future__ import annotations

import numpy as np

from jaxtrain.parallel import schedule as schedule_lib

# Branches of the per-tick switch: BWD a whole backward, or as B (X) and W; PAIRED[k]: a forward and branch k of
# another microbatch in one tick (dualpipev).
IDLE, FWD, BWD, BWD_X, BWD_W = range(5)
PAIRED = {BWD: 5, BWD_X: 6, BWD_W: 7}
# Columns of the per-(tick, device) table (XSLOT: where chunk 0's input gradient replaces its input; ESLOT: where
# the gradient of the MTP module's target embeddings, made by the last chunk's weight gradient, replaces them;
# WSLOT: where B leaves what W needs). MB..SLOT: the backward op's (a single forward's too); FMB..FSLOT: the
# forward's. Then one per link (`links`): the slot an activation (then a gradient) arriving over it lands in.
BRANCH, MB, CHUNK, GCHUNK, SLOT, GSLOT, XSLOT, ESLOT, WSLOT, FMB, FCHUNK, FGCHUNK, FSLOT = range(13)
NCOL = 13


def links(t: schedule_lib.Table) -> list[tuple[tuple[int, int], ...]]:
  """The device pairs activations move over, one tuple of (source, target) per ppermute (a fixed offset
  mod p; (s, s) = kept on the device, the V's turn); gradients go back over the same links reversed."""
  by_offset = {}
  for c in range(t.chunks - 1):
    a, b = t.device_of(c)[0], t.device_of(c + 1)[0]
    by_offset.setdefault((b - a) % t.p, set()).add((a, b))
  return [tuple(sorted(pairs)) for _, pairs in sorted(by_offset.items())]


def paired(t: schedule_lib.Table) -> bool:
  """Whether some tick pairs a forward with a backward op (the program then reads the forward's own columns)."""
  return any(isinstance(cell, schedule_lib.Pair) for row in t.grid for cell in row)


def program_table(t: schedule_lib.Table) -> tuple[np.ndarray, int, int, int]:
  """The table as int32 (ticks, p, NCOL + 2 x links) columns, and the stash, gradient and W slot counts (+1
  trash each)."""
  stash, grads, wait = ([schedule_lib.assign_slots(iv) for iv in ivs]
                        for ivs in (t.stash_intervals(), t.grad_intervals(), t.w_intervals()))
  S, G, WN = (max(max(n for _, n in slots), 1) for slots in (stash, grads, wait))
  ls = links(t)
  out = np.zeros((t.ticks, t.p, NCOL + 2 * len(ls)), np.int32)
  out[:, :, SLOT], out[:, :, FSLOT], out[:, :, GSLOT], out[:, :, XSLOT], out[:, :, ESLOT] = S, S, G, t.m, t.m
  out[:, :, WSLOT], out[:, :, NCOL:NCOL + len(ls)], out[:, :, NCOL + len(ls):] = WN, S, G
  link = {pair: k for k, pairs in enumerate(ls) for pair in pairs}
  for tick, s, op in t.ops():
    _place_op(t, out, tick, s, op, (stash, grads, wait), link, len(ls))
  return out, S, G, WN


def _branch(t: schedule_lib.Table, op: schedule_lib.Op, c: int) -> int:
  F, B, W, BW = schedule_lib.F, schedule_lib.B, schedule_lib.W, schedule_lib.BW
  if not t.split:
    return {F: FWD, B: BWD}[op.kind]
  if c == 0:  # chunk 0's split B has no input gradient to give: its W is its whole backward
    return {F: FWD, B: IDLE, W: BWD, BW: BWD}[op.kind]
  return {F: FWD, B: BWD_X, W: BWD_W, BW: BWD}[op.kind]


def _place_op(t, out, tick, s, op, slots, link, nl) -> None:
  """Writes one op's columns (a pair's forward and backward each write their own) and its sends' target slots."""
  stash, grads, wait = slots
  last, F, B = t.chunks - 1, schedule_lib.F, schedule_lib.B
  c, r = t.chunk_of(s, op.chunk), out[tick, s]
  branch = _branch(t, op, c)
  cols = (FMB, FCHUNK, FGCHUNK, FSLOT) if op.kind == F else (MB, CHUNK, GCHUNK, SLOT)
  r[cols[0]], r[cols[1]], r[cols[2]] = op.mb, op.chunk, c
  if c > 0:  # the chunk's stashed input (chunk 0 reads the embedded tokens)
    r[cols[3]] = stash[s][0][(op.mb, c)]
  if op.kind == F:
    r[MB], r[CHUNK], r[GCHUNK], r[SLOT] = r[FMB], r[FCHUNK], r[FGCHUNK], r[FSLOT]  # a single forward reads these
    if c < last:  # the activation goes to chunk c + 1's device
      d = t.device_of(c + 1)[0]
      out[tick, d, NCOL + link[(s, d)]] = stash[d][0][(op.mb, c + 1)]
  if op.kind in (B, schedule_lib.BW) and c > 0:  # the input gradient goes to chunk c - 1's device
    d = t.device_of(c - 1)[0]
    out[tick, d, NCOL + nl + link[(d, s)]] = grads[d][0][(op.mb, c - 1)]
  if c == 0 and branch == BWD:  # its input is used for the last time: its gradient takes its slot
    r[XSLOT] = op.mb
  if c == last and branch in (BWD, BWD_X):  # the head's gradients, the target embeddings' with them
    r[ESLOT] = op.mb
  if branch in (BWD_X, BWD_W):  # B leaves the projections' inputs and output gradients for W here
    r[WSLOT] = wait[s][0][(op.mb, c)]
  if op.kind != F and c < last:
    r[GSLOT] = grads[s][0][(op.mb, c)]
  if branch != IDLE:  # a pair's forward comes first; its backward op makes the branch paired
    r[BRANCH] = branch if r[BRANCH] == IDLE else PAIRED[branch]


def reversed_rows(t: schedule_lib.Table) -> list[bool]:
  """Per local chunk j: whether devices hold global chunks in reverse (a V's second row: 2p-1-s), else j*p + s."""
  order = np.array([[t.chunk_of(s, j) for s in range(t.p)] for j in range(t.v)])
  rev = [t.p > 1 and order[j, 0] > order[j, 1] for j in range(t.v)]
  assert all((row == j * t.p + (np.arange(t.p)[::-1] if r else np.arange(t.p))).all()
             for j, (row, r) in enumerate(zip(order, rev))), order
  return rev
