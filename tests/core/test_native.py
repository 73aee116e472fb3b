"""Native library output (jaxtrain.core.native): what C++ writes to file descriptors 1 and 2 goes to the run's
log, except what the user must see; a peer lost by the distributed runtime is one line on the terminal. The
native text below is what jaxlib 0.10.2 printed in a two-process run whose process 1 was killed."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers import clean_env

LOST_PEER = b"""\
E1123 21:54:18.374691    1206 coordination_service.cc:1549] [95364] Use error polling to propagate the following \
error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) \
to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1123 21:54:18.375544    1217 coordination_service_agent.cc:289] Polled an error from coordination service (this \
can be an error from this or another task).
F1123 21:54:18.375704    1217 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details.
1
*** Check failure stack trace: ***
    @     0x7fef59c40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
LOST_COORDINATOR = b"""\
E1123 21:54:39.198266    1767 coordination_service_agent.cc:289] Polled an error from coordination service (this \
can be an error from this or another task).
F1123 21:54:39.199077    1767 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details.
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
*** Check failure stack trace: ***
"""

SCRIPT = r"""
import os, sys
from jaxtrain.core import native
native.capture()
print("progress line")
os.write(1, b"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks.\n1 is connected to 1 peer ranks.\n")
os.write(2, b"W1123 21:56:38.777804    4138 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization\n")
os.write(2, b"E1123 21:56:38.777804    4138 x.cc:1] an error record before the log is known\n")
native.tell("log", sys.argv[1] + "/jaxtrain.log")
native.tell("process", int(sys.argv[3]))
if sys.argv[4] == "joined":  # what jaxtrain.parallel.distributed tells once jax.distributed.initialize returns
  native.tell("joined", 1)
print("jaxtrain: error: a Python error line", file=sys.stderr)
if sys.argv[2] == "raise":
  native.LOST_PEER_GRACE_S = 0
  raise TimeoutError("Timed out while waiting for async_write_complete barrier.\nmore")
if sys.argv[2] == "lost":
  os.write(2, sys.stdin.buffer.read())
  os.abort()
os.write(2, b"F1123 21:56:38.777804    4138 x.cc:1] a fatal record\n*** Check failure stack trace: ***\n")
"""


def _run(tmp_path, mode, stdin=b"", process=0, joined=True):
  r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode, str(process), "joined" if joined else "-"],
                     input=stdin, capture_output=True,
                     env=clean_env(PYTHONPATH=REPO), timeout=60)
  log = (tmp_path / "jaxtrain.log").read_bytes().decode() if (tmp_path / "jaxtrain.log").exists() else ""
  return r, r.stderr.decode().splitlines(), log


def test_native_records_go_to_the_log_and_fatal_ones_to_the_terminal(tmp_path):
  r, err, log = _run(tmp_path, "plain")
  assert r.returncode == 0 and r.stdout.decode() == "progress line\n"
  assert sorted(err) == sorted(["jaxtrain: error: a Python error line",
                                "E1123 21:56:38.777804    4138 x.cc:1] an error record before the log is known",
                                "F1123 21:56:38.777804    4138 x.cc:1] a fatal record",
                                "*** Check failure stack trace: ***"]), err
  assert "[SPMD] Involuntary full rematerialization" in log and log.count("is connected to 1 peer ranks") == 2


NEVER_JOINED = b"""\
F1126 03:37:33.549515    6663 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details. absl::Status: \
DEADLINE_EXCEEDED: Deadline Exceeded
"""


@pytest.mark.parametrize("process, text, who, joined", [
    (0, LOST_PEER, "process 1 stopped answering (no heartbeat within distributed.heartbeat_timeout_s)", True),
    (1, LOST_COORDINATOR, "process 0 (the coordinator) is gone", True),
    (0, NEVER_JOINED, "not every process joined within distributed.init_timeout_s (one did not start, or died "
                      "starting)", False)])
def test_a_lost_peer_is_one_line_naming_process_step_and_checkpoint(tmp_path, process, text, who, joined):
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
  for step, committed in ((2, True), (3, False)):  # 3 never committed (no manifest)
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    if committed:
      (tmp_path / "checkpoints" / str(step) / "manifest.json").write_text("{}")
  r, err, log = _run(tmp_path, "lost", text, process, joined)
  assert r.returncode == -6
  assert sorted(err) == sorted([  # in any order: two processes write to the terminal
      "E1123 21:56:38.777804    4138 x.cc:1] an error record before the log is known",
      "jaxtrain: error: a Python error line",
      f"jaxtrain[process {process}]: error: {who} after step 3, so this process stops too; last committed "
      f"checkpoint: step 2; run the same command on every process to go on (details in {tmp_path}/jaxtrain.log)"]), err
  native = "".join(l for l in log.splitlines(True) if "peer ranks" not in l)  # gloo's stdout lines interleave
  assert text.decode() in native  # the runtime's own text and stack trace, whole


def test_an_unexpected_error_of_a_multi_process_run_is_one_line(tmp_path):
  """Often the echo of a lost peer (a barrier it never reaches): the traceback goes to the log."""
  r, err, log = _run(tmp_path, "raise")
  assert r.returncode == 1
  assert ("jaxtrain[process 0]: error: TimeoutError: Timed out while waiting for async_write_complete barrier. "
          f"(traceback in {tmp_path}/jaxtrain.log)") in err and len(err) == 3, err
  assert "Traceback (most recent call last)" in log and 'line 16, in <module>' in log
