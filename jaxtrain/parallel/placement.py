"""Which rows of each global batch this process feeds, and the global arrays they become."""

from __future__ import annotations

import jax

from jaxtrain.core.errors import UserError

BATCH_AXES = ("batch", "length")


class Placement:

  def __init__(self, plan, batch_size: int, seq_len: int):
    self.plan = plan
    self.shape = (batch_size, seq_len)
    self.sharding = plan.sharding(BATCH_AXES, self.shape)
    self.block, self.blocks = self._rows()

  def _rows(self) -> tuple[int, int]:
    """(block, blocks): this process feeds rows [block*B/blocks, (block+1)*B/blocks), those its devices hold."""
    B = self.shape[0]
    spans = {(ix[0].start or 0, B if ix[0].stop is None else ix[0].stop)
             for ix in self.sharding.addressable_devices_indices_map(self.shape).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    size = hi - lo
    if B % size or lo % size or sum(b - a for a, b in spans) < size:
      raise UserError(f"this process's devices hold batch rows {sorted(spans)}, not one contiguous block; "
                      "put the batch axes (data, fsdp, expert) outside the axes that span hosts")
    return lo // size, B // size

  def rows(self) -> tuple[int, int]:
    return self.block, self.blocks

  def device_batch(self, local: dict) -> dict:
    """This process's rows -> global arrays sharded over the batch axes; a batch smaller than the largest
    (train.batch_ramp) is the same share of its rows, under the same sharding (each size divides over the axes)."""
    self.plan.check_rows(local["segment_ids"])
    shape = (len(local["inputs"]) * self.blocks, self.shape[1])
    return {k: jax.make_array_from_process_local_data(self.sharding, v, shape) for k, v in local.items()}

