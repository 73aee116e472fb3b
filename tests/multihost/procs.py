"""Harness: N trainer processes on localhost (gloo), each with its share of simulated CPU devices."""

import os
import socket
import subprocess
import sys
import time

from tests import helpers


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def clean_env(extra=None):
  """tests.helpers.clean_env with `extra`, unbuffered so the process logs arrive as written."""
  return helpers.clean_env(**{**(extra or {}), "PYTHONUNBUFFERED": "1"})


def launch(module_args, n, cwd, env=None, each=None):
  """Starts n processes of `python -m ...module_args --coordinator ... --process-id i` (logs in `cwd`);
  `each(i)` -> (working directory, extra args) of process i, when they differ."""
  port = free_port()
  procs = []
  for i in range(n):
    log = open(os.path.join(cwd, f"process{i}.log"), "w")
    where, extra = each(i) if each else (cwd, [])
    procs.append(subprocess.Popen(
        [sys.executable, "-m", *module_args, *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
         "--process-id", str(i)], cwd=where, env=clean_env(env), stdout=log, stderr=subprocess.STDOUT, text=True))
  return procs


def wait_all(procs, timeout):
  """Waits for every process (killing all past the timeout); returns exit codes."""
  deadline = time.monotonic() + timeout
  codes = []
  try:
    for p in procs:
      codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return codes


def log_of(cwd, i) -> str:
  with open(os.path.join(cwd, f"process{i}.log")) as f:
    return f.read()
