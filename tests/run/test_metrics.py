"""TensorBoard scalars (decoded with an independent reader: CRC-32C framing and protobuf
from TensorBoard's field numbers) and the profiler trace, next to metrics.jsonl."""

import json

import pytest


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), bit by bit: the test's own reference for the TFRecord framing."""
  c = 0xFFFFFFFF
  for b in data:
    c ^= b
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
  return c ^ 0xFFFFFFFF


def _read_events(path, torn_tail=False):
  """(step, {tag: value}) per record, decoded with Google's protobuf runtime from a
  descriptor of TensorBoard's Event/Summary messages (field numbers from event.proto).
  `torn_tail`: the file was cut short (a full disk), its last record may be partial and is dropped."""
  import struct
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
  fd = descriptor_pb2.FileDescriptorProto(name="tb_event_test.proto", package="tbtest", syntax="proto3")
  F = descriptor_pb2.FieldDescriptorProto
  def msg(name, *fields):
    m = fd.message_type.add(name=name)
    for fname, num, ftype, label, tname in fields:
      f = m.field.add(name=fname, number=num, type=ftype, label=label)
      if tname:
        f.type_name = tname
  msg("Value", ("tag", 1, F.TYPE_STRING, F.LABEL_OPTIONAL, None), ("simple_value", 2, F.TYPE_FLOAT, F.LABEL_OPTIONAL, None))
  msg("Summary", ("value", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tbtest.Value"))
  msg("Event", ("wall_time", 1, F.TYPE_DOUBLE, F.LABEL_OPTIONAL, None), ("step", 2, F.TYPE_INT64, F.LABEL_OPTIONAL, None),
      ("file_version", 3, F.TYPE_STRING, F.LABEL_OPTIONAL, None),
      ("summary", 5, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tbtest.Summary"))
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fd)
  Event = message_factory.GetMessageClass(pool.FindMessageTypeByName("tbtest.Event"))
  assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
  data, out, i = path.read_bytes(), [], 0
  while i < len(data):
    (n,) = struct.unpack_from("<Q", data, i) if i + 8 <= len(data) else (len(data),)
    if torn_tail and i + 12 + n + 4 > len(data):
      break
    body = data[i + 12:i + 12 + n]
    c = crc32c(body)
    assert struct.unpack_from("<I", data, i + 12 + n)[0] == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    ev = Event.FromString(body)
    out.append((ev.file_version, ev.step, {v.tag: v.simple_value for v in ev.summary.value}))
    i += 12 + n + 4
  return out


@pytest.mark.slow
def test_tensorboard_scalars_and_profile_trace_next_to_metrics(run_cli, tmp_path):
  r = run_cli("jaxtrain.train", "--mesh", "dp=2", "--steps", "3", "--workdir", "w",
              "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.profile_steps=2-3",
              "--set", "train.xla_flags=gpu-default", "--set", "train.xla_flags_extra=--xla_jaxtrain_bogus=1",
              "--set", "run.xla_flags_unknown=warn",
              "--set", "model.remat=save_named", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
  assert r.returncode == 0, r.stderr[-2000:]
  assert "attention: xla (reference XLA attention: backend is cpu, not a CUDA GPU); remat save_named" in r.stdout
  assert "dropping XLA flag(s) this jaxlib does not know: --xla_jaxtrain_bogus=1" in r.stderr
  assert "xla flags: 13 added to XLA_FLAGS (preset gpu-default)" in r.stdout  # its 12 and the NCCL termination timeout
  w = tmp_path / "w"
  records = [json.loads(l) for l in (w / "metrics.jsonl").read_text().splitlines()]
  (event_file,) = (w / "tb").glob("events.out.tfevents.*")
  events = _read_events(event_file)
  assert events[0][0] == "brain.Event:2"
  by_step = {}
  for _, step, scalars in events[1:]:  # one event per record (a step)
    by_step.setdefault(step, {}).update(scalars)
  assert sorted(by_step) == [rec["step"] for rec in records] == [1, 2, 3]
  for rec in records:
    scalars = by_step[rec["step"]]
    for k in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s"):
      assert scalars[k] == pytest.approx(rec[k], rel=1e-6)
    assert "mfu" not in scalars and "skipped" not in scalars  # None and bool are not scalars
  traces = list((w / "profile").rglob("*.xplane.pb"))
  assert traces and all(t.stat().st_size > 0 for t in traces)


def test_the_run_log_on_a_full_disk_raises_nothing():
  """/dev/full fails every write with ENOSPC: the buffered line's flush and close must not replace the run's error."""
  import logging

  from jaxtrain.run import runfiles
  handler = runfiles._QuietFileHandler("/dev/full")
  handler.emit(logging.LogRecord("jaxtrain", logging.ERROR, __file__, 1, "run ended: %s", ("x",), None))
  handler.flush()
  handler.close()


def test_the_log_after_the_run_raises_nothing_once_its_workdir_is_removed(tmp_path):
  """The handler that keeps taking records after a run (orbax reports late) opens its file at the first record: a
  removed workdir must not make that record raise in whoever logged it."""
  import logging

  from jaxtrain.run import runfiles
  handler = runfiles._QuietFileHandler(tmp_path / "gone" / "jaxtrain.log", delay=True)
  handler.emit(logging.LogRecord("absl", logging.INFO, __file__, 1, "finished %s", ("x",), None))
  handler.close()


def test_tensorboard_on_a_full_disk_is_one_warning_line_and_never_blocks_the_run(tmp_path, capsys, monkeypatch):
  """A tmpfs of 64 KiB fills within the records: the sink says so once, closes, and every later write returns (the
  queued writer of tensorboardX blocked the run forever once its thread died of ENOSPC). Without mount permission
  the events file is /dev/full, which fails every write with ENOSPC the same way."""
  import subprocess
  import threading

  import tensorboardX.record_writer

  from jaxtrain.run import metrics
  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = not subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                               capture_output=True).returncode
  if not mounted:
    monkeypatch.setattr(tensorboardX.record_writer, "open_file", lambda path: open("/dev/full", "wb"))
  try:
    sink = metrics.TensorBoardSink(disk / "tb")
    rec = {f"scalar_{i:02d}": float(i) for i in range(40)}
    worker = threading.Thread(target=lambda: [sink.write(step, rec) for step in range(1, 2001)], daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "a write to the full disk blocked"
    sink.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "TensorBoard events stops at step" in warnings[0], warnings
    assert "No space left on device" in warnings[0]
    if mounted:
      (events,) = (disk / "tb").glob("events.out.tfevents.*")
      steps = [step for _, step, _ in _read_events(events, torn_tail=True)[1:]]
      assert steps and steps == list(range(1, len(steps) + 1))  # what reached the disk before it filled reads back
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # -l: even while a file there is open

