"""Observability beside metrics.jsonl: TensorBoard scalars and jax.profiler traces.

TensorBoard: `EventWriter` writes the standard event file (<workdir>/tb/events.out.tfevents.*)
directly, with no TensorFlow or tensorboardX dependency: a TFRecord stream (little-endian
u64 length, masked CRC-32C of the length, the bytes, masked CRC-32C of the bytes) of
`Event` protobufs {wall_time: double = 1, step: int64 = 2, file_version: string = 3,
summary: Summary = 5}, Summary {repeated Value value = 1}, Value {tag: string = 1,
simple_value: float = 2}. View with `tensorboard --logdir <workdir>/tb` (pip install tensorboard).

Profiling: `Profiler` traces the steps of `train.profile_steps` ("5-7" or "5") into
<workdir>/profile/ (open with TensorBoard's profile plugin or Perfetto).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from jaxtrain.errors import UserError


def _crc32c_table():
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  c = 0xFFFFFFFF
  for b in data:
    c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
  c = crc32c(data)
  return struct.pack("<I", (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negatives
  out = bytearray()
  while True:
    b, n = n & 0x7F, n >> 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, *, file_version: str | None = None, scalars: dict[str, float] | None = None) -> bytes:
  ev = _varint(1 << 3 | 1) + struct.pack("<d", time.time()) + _varint(2 << 3 | 0) + _varint(step)
  if file_version is not None:
    ev += _field_bytes(3, file_version.encode())
  if scalars:
    values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", v))
                      for tag, v in scalars.items())
    ev += _field_bytes(5, values)
  return ev


class EventWriter:
  """Appends scalar summaries to one TensorBoard event file in `logdir`."""

  def __init__(self, logdir: Path):
    logdir.mkdir(parents=True, exist_ok=True)
    self.path = logdir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.file = self.path.open("ab")
    self._record(_event(0, file_version="brain.Event:2"))

  def _record(self, data: bytes) -> None:
    header = struct.pack("<Q", len(data))
    self.file.write(header + _masked(header) + data + _masked(data))

  def scalars(self, step: int, values: dict) -> None:
    """Writes the numeric entries of `values` (bools and None are skipped) as scalars at `step`."""
    nums = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    self._record(_event(step, scalars=nums))
    self.file.flush()

  def close(self) -> None:
    self.file.close()


def parse_steps(text: str) -> tuple[int, int] | None:
  """'5-7' -> (5, 7), '5' -> (5, 5), '' -> None."""
  if not text.strip():
    return None
  a, _, b = text.strip().partition("-")
  try:
    first, last = int(a), int(b or a)
  except ValueError:
    raise UserError(f"train.profile_steps={text!r}: write FIRST-LAST or one step, e.g. 5-7") from None
  if not 1 <= first <= last:
    raise UserError(f"train.profile_steps={text!r}: steps start at 1 and FIRST must not exceed LAST")
  return first, last


class Profiler:
  """Starts a jax.profiler trace before step `first` is dispatched and stops it once step
  `last` has finished (its outputs are waited for, so the trace holds the whole step)."""

  def __init__(self, steps: str, logdir: Path, enabled: bool = True):
    self.window = parse_steps(steps) if enabled else None
    self.logdir, self.active = logdir, False

  def before(self, step: int) -> None:
    if self.window and step == self.window[0]:
      import jax
      self.logdir.mkdir(parents=True, exist_ok=True)
      jax.profiler.start_trace(str(self.logdir))
      self.active = True
      print(f"profiler: tracing steps {self.window[0]}-{self.window[1]} into {self.logdir}", flush=True)

  def after(self, step: int, outputs) -> None:
    if self.active and step >= self.window[1]:
      import jax
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.active = False

  def close(self) -> None:
    if self.active:  # the run ended inside the window
      import jax
      jax.profiler.stop_trace()
      self.active = False
