"""Output of the native libraries (XLA's C++ logging, gloo) off the terminal. They write straight to file
descriptors 1 and 2, so `capture()` points both at a pipe read by a small filter process, and Python's own
sys.stdout/sys.stderr at copies of the original descriptors. The filter sends info and warning records and
gloo's "[Gloo] Rank N is connected" lines to the run's log once `tell("log", path)` names it (dropped if none
is ever named), error records there too once it is named, and everything else (fatal records, crash dumps,
text it does not recognise) to the terminal's stderr, with one exception: when the distributed runtime aborts
this process because a peer was lost (its fatal record and C++ stack trace go to the log), the filter prints
the one line that says which process, how far the run got and how to go on. A separate process, so it
outlives the abort and nothing is lost."""

from __future__ import annotations

import io
import os
import subprocess
import sys

_FILTER = r"""
import json, os, re, signal, sys, threading
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command reports Ctrl-C; this process ends at its EOF
signal.signal(signal.SIGTERM, signal.SIG_IGN)
RECORD = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
LOST = b"Terminating process because the JAX distributed service detected fatal errors"
out, told, held, recent, to_log = sys.stdout.buffer, {}, [], [], False


def to_file(line):
  try:
    told["file"] = told.get("file") or open(told["log"], "ab", buffering=0)  # made at its first line
    told["file"].write(line)
  except OSError:  # a log on a full disk: losing a line is not worth a report
    pass


def lost_peer_line():
  # Which process: the service names tasks that stopped sending heartbeats; a lost coordinator
  # (process 0) shows as a closed connection. How far: the run's files (workdir = the log's folder).
  text = b"".join(recent).decode(errors="replace")
  named = re.search(r"stopped sending heartbeats\):\s*\n([\d, \n]+?)\n[A-Z]", text)
  if named:
    who = (f"process {', '.join(named.group(1).split())} stopped answering (no heartbeat within "
           "distributed.heartbeat_timeout_s)")
  elif "joined" not in told:  # start-up: the runtime gives up on a peer that never connected
    who = "not every process joined within distributed.init_timeout_s (one did not start, or died starting)"
  else:
    who = "process 0 (the coordinator) is gone" if told.get("process") != "0" else "a process is gone"
  where, work = "", os.path.dirname(told.get("log", b"")) if "log" in told else None
  try:
    with open(os.path.join(work, b"metrics.jsonl"), "rb") as f:
      where = f" after step {json.loads(f.read().splitlines()[-1])['step']}"
  except Exception:
    pass
  try:
    ck = os.path.join(work, b"checkpoints")
    steps = [int(n) for n in os.listdir(ck) if n.isdigit() and os.path.exists(os.path.join(ck, n, b"manifest.json"))]
    last = f"; last committed checkpoint: step {max(steps)}" if steps else "; no checkpoint committed yet"
  except Exception:
    last = ""
  details = f" (details in {told['log'].decode(errors='replace')})" if "log" in told else ""
  return (f"jaxtrain[process {told.get('process', '?')}]: error: {who}{where}, so this process stops too{last}; "
          f"run the same command on every process to go on{details}\n")


def from_stderr(line):
  global recent, to_log
  if line.startswith(b"\0tell "):
    key, _, value = line[6:-1].partition(b"=")
    told[key.decode()] = value if key == b"log" else value.decode()
    if key == b"log":
      for h in held:
        to_file(h)
      held.clear()
    return
  recent = (recent + [line])[-50:]
  if RECORD.match(line):  # a record's unprefixed continuation lines go where it went
    to_log = line[:1] in (b"IWE" if "log" in told else b"IW") or LOST in line
    if LOST in line:
      out.write(lost_peer_line().encode())
      out.flush()
  elif line.startswith((b"Fatal Python error", b"terminate called")):
    to_log = False
  if not to_log:
    out.write(line)
    out.flush()
  else:
    from_stdout(line)


def from_stdout(line):  # the libraries' stdout (gloo's "connected" lines, from several threads at once)
  if "log" in told:
    to_file(line)
  elif len(held) < 10000:
    held.append(line)


def pump(stream, handle):
  for line in stream:
    with lock:
      handle(line)


lock = threading.Lock()
stdout_pump = threading.Thread(target=pump, args=(os.fdopen(int(sys.argv[1]), "rb"), from_stdout))
stdout_pump.start()
pump(sys.stdin.buffer, from_stderr)
stdout_pump.join()
"""
_captured = False
_told: dict = {}  # what `tell` said, for this process too
LOST_PEER_GRACE_S = 5


def _reopened(stream, fd: int):
  """A text stream like `stream` (same buffering: stderr's bytes are unbuffered) on a copy of descriptor `fd`."""
  stream.flush()
  raw = io.FileIO(os.dup(fd), "w")
  return io.TextIOWrapper(raw if isinstance(stream.buffer, io.RawIOBase) else io.BufferedWriter(raw),
                          encoding=stream.encoding, errors=stream.errors, line_buffering=stream.line_buffering,
                          write_through=stream.write_through)


def capture() -> None:
  """From now on native output goes through the filter; Python's prints are unchanged. Once per process."""
  global _captured
  try:
    real = sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
  except (AttributeError, ValueError, OSError):  # replaced streams (a test's capture): leave them
    real = False
  if _captured or not real:
    return
  (err_r, err_w), (out_r, out_w) = os.pipe(), os.pipe()
  subprocess.Popen([sys.executable, "-S", "-c", _FILTER, str(out_r)], stdin=err_r, stdout=2, pass_fds=(out_r,))
  sys.stdout, sys.stderr = _reopened(sys.stdout, 1), _reopened(sys.stderr, 2)
  for pipe_r, pipe_w, fd in ((err_r, err_w, 2), (out_r, out_w, 1)):
    os.dup2(pipe_w, fd)
    os.close(pipe_w)
    os.close(pipe_r)
  _captured = True


def tell(key: str, value) -> None:
  """Tells the filter the run's log (`log`; the held records go there first) or this process's index in a
  multi-process run (`process`; from then on an uncaught error ends in one line, `_multi_process_excepthook`)."""
  _told[key] = os.path.abspath(value) if key == "log" else value
  if key == "process":
    sys.excepthook = _multi_process_excepthook
  if _captured:
    os.write(2, b"\0tell " + key.encode() + b"=" + os.fsencode(str(_told[key])) + b"\n")


def _multi_process_excepthook(kind, value, tb) -> None:
  """An unexpected error of a multi-process run: often the echo of a lost peer (a barrier the dead process
  never reaches), which the runtime is about to report (the filter's one line), so its traceback goes to the
  log and, a moment later, one line names it."""
  import time
  import traceback
  log = _told.get("log")
  try:
    with open(log, "a") as f:
      f.write("".join(traceback.format_exception(kind, value, tb)))
  except (OSError, TypeError):  # no log: the traceback as usual
    sys.__excepthook__(kind, value, tb)
    return
  time.sleep(LOST_PEER_GRACE_S)
  first = (str(value).strip().splitlines() or [""])[0]
  print(f"jaxtrain[process {_told['process']}]: error: {kind.__name__}: {first} (traceback in {log})", file=sys.stderr)
