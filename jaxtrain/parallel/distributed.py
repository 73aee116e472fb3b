"""Multi-process start-up on JAX's multi-controller runtime (NCCL on GPUs, gloo on CPUs): the cluster from
explicit flags or JAX's own detection, else one process."""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from jaxtrain.core import native
from jaxtrain.core.errors import UserError


@dataclasses.dataclass(frozen=True)
class Cluster:
  coordinator: str | None  # None: JAX detects it
  num_processes: int
  process_id: int | None


def _detected() -> Cluster | None:
  """The cluster JAX's own detection sees, if any (its detectors live in a private module)."""
  try:
    from jax._src import clusters
    detectors = list(clusters.ClusterEnv._cluster_types)  # noqa: SLF001 (no public API lists them)
  except Exception as e:  # noqa: BLE001 (a jax without them: only the explicit flags start several processes)
    print(f"note: cannot read JAX's cluster detection ({type(e).__name__}: {e}); a multi-process run needs "
          "--coordinator, --num-processes and --process-id", file=sys.stderr)
    return None
  for env in detectors:
    try:
      present = not getattr(env, "opt_in_only_method", False) and env.is_env_present()
    except Exception:  # noqa: BLE001 (a detector that fails to probe means "not this cluster")
      present = False
    if present:
      return Cluster(None, env.get_process_count(), env.get_process_id())
  return None


def cluster_from(coordinator: str | None, num_processes: int | None, process_id: int | None) -> Cluster | None:
  given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
  if any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    if missing:
      raise UserError(f"multi-process runs need --coordinator, --num-processes and --process-id; missing {', '.join(missing)}")
    host, _, port = coordinator.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):  # isdigit() alone takes full-width digits
      raise UserError(f"--coordinator {coordinator!r} must look like HOST:PORT")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise UserError(f"--process-id {process_id} must lie in [0, --num-processes={num_processes})")
    return Cluster(coordinator, num_processes, process_id)
  detected = _detected()
  return detected if detected and detected.num_processes > 1 else None


def initialize(cluster: Cluster | None, mesh_sizes: dict[str, int], heartbeat_timeout_s: int, init_timeout_s: int) -> None:
  """Starts the distributed runtime (before any JAX backend) and provides CPU devices."""
  import jax
  from jaxtrain.parallel import mesh as mesh_lib
  total = math.prod(mesh_sizes.values())
  if cluster is None:
    if -1 not in mesh_sizes.values():
      mesh_lib.provide_cpu_devices(total)
    return
  n = cluster.num_processes
  if -1 in mesh_sizes.values():
    raise UserError("a multi-process run needs every mesh axis size given (no -1)")
  if total % n:
    raise UserError(f"mesh of {total} devices does not split evenly over {n} processes")
  mesh_lib.provide_cpu_devices(total // n)
  if not mesh_lib.has_accelerator_plugin():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  native.tell("process", "?" if cluster.process_id is None else cluster.process_id)  # names a lost peer's line
  jax.distributed.initialize(cluster.coordinator, num_processes=n, process_id=cluster.process_id,
                             initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
  native.tell("process", jax.process_index())
  native.tell("joined", 1)  # from here a lost peer is found by its heartbeats, not by the start-up deadline
  _heartbeat_s[0] = heartbeat_timeout_s


_heartbeat_s = [0]  # set once the runtime runs with several processes
# How a collective reports a peer that vanished mid-call (gloo on CPUs; NCCL's remote errors on GPUs)
_PEER_GONE = ("Gloo", "Connection reset by peer", "Connection closed by peer", "remote process exited")


def await_lost_peer_verdict(err: BaseException) -> None:
  """A collective that fails because a peer died is reported before the runtime has missed its heartbeats, and
  its text names no process. Wait (up to the heartbeat timeout) for the runtime's verdict: it ends this
  process, and the native-output filter prints which process stopped answering and how far the run got. The
  verdict comes within one heartbeat timeout of the death (the collective fails at once), so waiting longer only
  delays the exit. Returns at once for any other error, or where the verdict does not come."""
  chain, text = err, ""
  while chain is not None:
    text, chain = text + str(chain), chain.__cause__ or chain.__context__
  if _heartbeat_s[0] and any(s in text for s in _PEER_GONE):
    time.sleep(_heartbeat_s[0] + 2)
