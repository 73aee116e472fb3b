"""Restarts a failed trainer: one supervisor per host (or, with `processes` > 1, one for a local group).

A trainer that exits 0 finished (or was preempted and saved: the scheduler requeues it); exit 2 is a user
error, which a restart would only repeat; anything else (a crash, a signal, a lost peer, the hang watchdog)
is restarted after a backoff and resumes from the last committed checkpoint. Under SLURM or a JobSet each
host's supervisor restarts its own trainer: the survivors of a lost process exit on their own (heartbeat
timeout), and the group meets again through jax.distributed. The compiled step comes back from JAX's
persistent compilation cache in the workdir, so a restart skips the compile. The trainers die with their
supervisor, even a SIGKILLed one (it cannot forward that signal).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxtrain.run import goodput

USER_ERROR = 2


@dataclasses.dataclass(frozen=True)
class Policy:
  max_restarts: int = 3  # within `window_s`: one more failure stops the job
  window_s: float = 3600.0
  backoff_s: float = 10.0  # across hosts: long enough for the survivors to see the loss and exit
  processes: int = 1  # > 1: a local group with its own coordinator (one machine)


# the trainer's own exit codes (docs/training.md), named in the supervisor's lines
KNOWN_EXITS = {3: "hang watchdog", 134: "runtime abort, e.g. a lost peer"}


def cause(code: int) -> str:
  """'exit 1', 'exit 3 (hang watchdog)', 'signal SIGKILL' (subprocess gives a signal as -N)."""
  if code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"exit {code}" + (f" ({KNOWN_EXITS[code]})" if code in KNOWN_EXITS else "")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def trainer_commands(train_args: list[str], processes: int) -> list[list[str]]:
  """One `python -m jaxtrain.train` per process; a local group gets a fresh coordinator port per attempt (the
  old one may linger in TIME_WAIT)."""
  base = [sys.executable, "-m", "jaxtrain.train", *train_args]
  if processes == 1:
    return [base]
  addr = f"127.0.0.1:{_free_port()}"
  return [[*base, "--coordinator", addr, "--num-processes", str(processes), "--process-id", str(i)]
          for i in range(processes)]


def workdir_of(train_args: list[str]) -> str | None:
  for i, a in enumerate(train_args):
    if a == "--workdir" and i + 1 < len(train_args):
      return train_args[i + 1]
    if a.startswith("--workdir="):
      return a.split("=", 1)[1]
  return None


def workdir_path(train_args: list[str]) -> str:
  """The trainer's workdir as it resolves it (default runs/<config name>), absolute."""
  from jaxtrain.core import config, files
  return str(files.user_path(workdir_of(train_args) or os.path.join("runs", config.run_name(_config_of(train_args))),
                             "--workdir"))


def child_env(train_args: list[str], attempt_t: float) -> dict:
  """The compilation cache in the run's workdir unless one is set: a restarted trainer loads its programs, the
  small ones too (JAX caches only compiles over 1 s by default; a restart pays for each). And the attempt's
  start, from which the trainer's ledger counts its start-up."""
  env = {**os.environ, goodput.ATTEMPT_T: repr(attempt_t)}
  if "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(workdir_path(train_args), "compile_cache")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  return env


def writes_ledger(train_args: list[str]) -> bool:
  """Process 0's supervisor keeps the job's ledger (the workdir is shared): under SLURM, a JobSet or MPI the
  scheduler's rank says which that is, else the --process-id given."""
  ranks = [os.environ.get(k) for k in ("SLURM_PROCID", "JOB_COMPLETION_INDEX", "OMPI_COMM_WORLD_RANK")]
  ranks += [train_args[i + 1] for i, a in enumerate(train_args[:-1]) if a == "--process-id"]
  return all(r in (None, "0") for r in ranks)


def _config_of(train_args: list[str]) -> str:
  for i, a in enumerate(train_args):
    if a == "--config" and i + 1 < len(train_args):
      return train_args[i + 1]
    if a.startswith("--config="):
      return a.split("=", 1)[1]
  return "tiny"


# Run before each trainer, in its own process: the kernel kills the trainer when the supervisor dies, even by
# SIGKILL (Linux's parent-death signal; an exec keeps it), rather than leaving it to hold the devices and the
# workdir's lock beside the next supervisor's trainer. Then the trainer replaces it (the same process).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
                    "if os.getppid() != int(sys.argv[1]):\n  os._exit(128 + signal.SIGKILL)  # it died before\n"
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dies_with_supervisor(command: list[str]) -> list[str]:
  """`command`, run so that it dies with this process (Linux; elsewhere as it is)."""
  if not sys.platform.startswith("linux"):
    return command
  return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


class Relay:
  """The stderr of a local group's processes, passed on line by line; a line that another process of the group
  already printed (its process index aside) is dropped: a refusal or a warning that every process meets is
  printed once, not once per process."""

  TAG = re.compile(rb"\[process \d+\]")

  def __init__(self, streams):
    self.first: dict[bytes, int] = {}  # a line (tag removed) -> the process that printed it first
    self.lock = threading.Lock()
    self.threads = [threading.Thread(target=self._pass, args=(i, s), daemon=True) for i, s in enumerate(streams)]
    for t in self.threads:
      t.start()

  def _pass(self, i: int, stream) -> None:
    for line in iter(stream.readline, b""):
      with self.lock:
        if self.first.setdefault(self.TAG.sub(b"", line), i) == i:
          sys.stderr.write(line.decode(errors="replace"))
          sys.stderr.flush()
    stream.close()

  def join(self, timeout_s: float = 10.0) -> None:
    """Until every process's stderr is closed (its last lines printed), or `timeout_s` (a grandchild holds it)."""
    deadline = time.monotonic() + timeout_s
    for t in self.threads:
      t.join(max(deadline - time.monotonic(), 0.0))


class Group:
  """The trainer processes of one attempt. A local group fails as one: the first failure stops the rest (as
  `srun --kill-on-bad-exit` does across hosts), since they would only wait for a peer that is gone. Each dies with
  the supervisor; a local group's stderr goes through a Relay."""

  def __init__(self, commands: list[list[str]], env: dict):
    pipe = subprocess.PIPE if len(commands) > 1 else None
    self.procs = [subprocess.Popen(dies_with_supervisor(c), env=env, stderr=pipe) for c in commands]
    self.relay = Relay([p.stderr for p in self.procs]) if pipe else None

  def signal(self, sig: int) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(sig)

  def wait(self) -> int:
    """0 when every process finished, else the first failure's code (the rest are stopped)."""
    while True:
      codes = [p.poll() for p in self.procs]
      failed = [c for c in codes if c not in (None, 0)]
      if failed:
        self.signal(signal.SIGKILL)
      if failed or all(c == 0 for c in codes):
        for p in self.procs:
          p.wait()
        if self.relay is not None:
          self.relay.join()
        return failed[0] if failed else 0
      time.sleep(0.2)


class Supervisor:
  def __init__(self, train_args: list[str], policy: Policy, say=None):
    self.train_args, self.policy = train_args, policy
    self.say = say or (lambda msg: print(f"jaxtrain.launch: {msg}", file=sys.stderr, flush=True))
    self.group: Group | None = None
    self.stopping = False
    self.failures: collections.deque = collections.deque()  # (monotonic time, cause) within the window

  def forward(self, signum, frame) -> None:
    """SIGTERM (preemption) and SIGINT reach the trainers, which save and exit; nothing is restarted after."""
    self.stopping = True
    if self.group is not None:
      self.group.signal(signum)

  def run(self) -> int:
    ledger = goodput.Ledger(workdir_path(self.train_args) if writes_ledger(self.train_args) else None)
    ledger.event("job", t=goodput.process_start())
    try:
      return self._attempts(ledger)
    finally:
      ledger.event("job_end")

  def _attempts(self, ledger) -> int:
    while True:
      started, t = time.monotonic(), time.time()
      ledger.event("attempt", t=t)
      self.group = Group(trainer_commands(self.train_args, self.policy.processes), child_env(self.train_args, t))
      code = self.group.wait()
      ledger.event("ended", cause=cause(code))
      if code in (0, USER_ERROR) or self.stopping:
        return code if code >= 0 else 128 - code
      if not self._may_restart(code):
        return 1
      self.say(f"trainer ended ({cause(code)}) after {time.monotonic() - started:.0f}s; restart "
               f"{len(self.failures)} of at most {self.policy.max_restarts} within {self.policy.window_s:g}s, in "
               f"{self.policy.backoff_s:g}s, from the last committed checkpoint")
      deadline = time.monotonic() + self.policy.backoff_s
      while time.monotonic() < deadline and not self.stopping:
        time.sleep(0.1)
      if self.stopping:
        return 128 + signal.SIGTERM

  def _may_restart(self, code: int) -> bool:
    now = time.monotonic()
    self.failures.append((now, cause(code)))
    while now - self.failures[0][0] > self.policy.window_s:
      self.failures.popleft()
    if len(self.failures) <= self.policy.max_restarts:
      return True
    causes = ", ".join(c for _, c in self.failures)
    self.say(f"error: {len(self.failures)} failures within {self.policy.window_s:g}s ({causes}); more than "
             f"--max-restarts {self.policy.max_restarts}: stopping; the last committed checkpoint is kept")
    return False


def supervise(train_args: list[str], policy: Policy) -> int:
  sup = Supervisor(train_args, policy)
  old = {s: signal.signal(s, sup.forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return sup.run()
  finally:
    for s, h in old.items():
      signal.signal(s, h)
