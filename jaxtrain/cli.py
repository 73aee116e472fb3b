"""The one start-up path of every command: flags, config, XLA flags (read once, when the
backend starts), distributed runtime (before any backend use), mesh; user mistakes exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Callable

from jaxtrain.core.errors import RunAborted, UserError, exit_with, path_error


class Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag in one line (no usage dump), exit 2; `type=int` and `type=float` flags take
  ASCII digits only (int() and float() also read full-width and other Unicode digits)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    from jaxtrain.core import parse
    self.register("type", int, parse.int_arg)
    self.register("type", float, parse.float_arg)

  def error(self, message):
    exit_with(UserError(f"{message} (see --help)"), self.prog)


def add_config_args(p: argparse.ArgumentParser, *, help_config: bool = True) -> None:
  p.add_argument("--config", default="tiny", help="preset name from configs/ or a path to a .toml file (default: tiny)")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                 help="override one config key (repeatable); see --help-config")
  if help_config:
    p.add_argument("--help-config", action="store_true", help="list every config key with type, default and meaning")


def add_mesh_args(p: argparse.ArgumentParser, *, cluster: bool = False) -> None:
  p.add_argument("--mesh", default="fsdp=-1",
                 help="axis=size pairs over pipeline/data/fsdp/expert/sequence/tensor (aliases pp/dp/fsdp/ep/sp/tp), "
                      "one size may be -1 to fill the rest; or a preset name from meshes/ (default: fsdp=-1)")
  if cluster:
    p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: address of process 0's coordinator")
    p.add_argument("--num-processes", type=int, help="multi-process run: number of processes (one per host)")
    p.add_argument("--process-id", type=int, help="multi-process run: this process's index, 0..N-1")


class PluginErrorInOneLine(logging.Filter):
  """A GPU plugin installed where its GPU is not (the gpu-aot extra on a laptop or a CPU CI host): JAX logs the
  plugin's failed start with a traceback, then goes on with the CPU. One line says that instead."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and record.getMessage().startswith("Jax plugin configuration error"):
      e = record.exc_info[1]
      plugin = record.args[0] if isinstance(record.args, tuple) and record.args else "a plugin"
      first = (str(e).splitlines() or [""])[0][:200]
      record.msg = f"note: {plugin} could not start ({type(e).__name__}: {first}); JAX goes on without it"
      record.args = None
      record.exc_info = record.exc_text = None
    return True


@dataclasses.dataclass
class Started:
  cfg: object
  mesh: object  # None when the command asked for no mesh
  prog: str  # the name errors are reported under (with the process index on multi-process runs)


def start(args: argparse.Namespace, prog: str, *, mesh: bool = True, overrides: list[str] = (), cfg=None,
          simulate_hosts: bool = False, runs_steps: bool = False) -> Started:
  """Config (or `cfg`, e.g. a checkpoint's), XLA flags, distributed runtime, mesh, in that order.
  `simulate_hosts`: a multi-host mesh on one process simulates its hosts (inspect). `runs_steps` (train, bench, generate):
  on CPU devices, the process-wide settings that make steps fast (`cpu_settings`)."""
  from jaxtrain.core import config
  from jaxtrain.parallel import distributed
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import observe
  from jaxtrain.parallel import xla_flags
  from jaxtrain.core import native
  logging.getLogger("jax._src.xla_bridge").addFilter(PluginErrorInOneLine())  # before the backend starts
  native.capture()  # before any backend starts: native library output goes to the run's log, not the terminal
  started = Started(cfg if cfg is not None else config.load(args.config, [*args.set, *overrides]), None, prog)
  cfg_given, cfg = cfg, started.cfg
  observe.parse_steps(cfg.run.profile_steps)  # a bad value fails before any device starts
  added = xla_flags.apply(cfg.run.xla_flags, xla_flags.extra(cfg), unknown=cfg.run.xla_flags_unknown,
                          with_preset=xla_flags.nccl_timeout(cfg))
  if added:
    print(f"xla flags: {len(added)} added to XLA_FLAGS (preset {cfg.run.xla_flags})")
  if not mesh:
    return started
  sizes, dcn = mesh_lib.parse_full(args.mesh)
  if cfg_given is None:  # a config to train (not a checkpoint's to read): its batch binds the mesh
    _check_batch(cfg, sizes)
  cluster = distributed.cluster_from(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                     getattr(args, "process_id", None))
  if cluster is not None:
    started.prog = f"{prog}[process {cluster.process_id if cluster.process_id is not None else '?'}]"
  distributed.initialize(cluster, sizes, cfg.distributed.heartbeat_timeout_s, cfg.distributed.init_timeout_s)
  import jax
  if jax.process_count() > 1:
    started.prog = f"{prog}[process {jax.process_index()}]"
    if jax.process_index() != 0:  # process 0 alone reports progress
      sys.stdout = open(os.devnull, "w")
  started.mesh = mesh_lib.build(sizes, dcn=dcn, simulate_hosts=simulate_hosts)
  if runs_steps and started.mesh.devices.flat[0].platform == "cpu":
    cpu_settings()
  return started


def cpu_settings() -> None:
  """Process-wide, once, for commands that run steps on CPU devices: bfloat16 matmuls lowered with float32 sums
  (the fast XLA:CPU kernel, the values GPUs give), and the step's temporaries reused from the heap."""
  from jaxtrain.core import cpu_dots, cpu_heap
  cpu_dots.install()
  cpu_heap.keep()


def _check_batch(cfg, sizes: dict[str, int]) -> None:
  """The batch's split over the mesh, checked before any simulated device is created (thousands take minutes)."""
  import math
  from jaxtrain.parallel import sharding
  ways = math.prod(sizes[a] for a in sharding.RULES["batch"])
  per_micro = cfg.train.batch_size // cfg.train.microbatches
  if -1 not in sizes.values() and per_micro % ways:
    raise UserError(f"train.batch_size={cfg.train.batch_size} / train.microbatches={cfg.train.microbatches} = "
                    f"{per_micro} sequences per microbatch must divide over {'*'.join(sharding.RULES['batch'])}="
                    f"{ways} devices")


def main(prog: str, body: Callable[[Callable[[str], None]], int | None], interrupted: str = "interrupted") -> int:
  """Runs `body(set_prog)`: UserError and a path that cannot be used (errors.path_error) exit 2, RunAborted 1
  (one line each), Ctrl-C 130; `set_prog` renames the command in error lines once the process index is known."""
  name = [prog]
  try:
    return body(lambda p: name.__setitem__(0, p)) or 0
  except (UserError, RunAborted) as e:
    if isinstance(e, RunAborted):
      from jaxtrain.parallel import distributed
      distributed.await_lost_peer_verdict(e)
    exit_with(e, name[0])
  except KeyboardInterrupt:
    print(interrupted, file=sys.stderr)
    return 130
  except BrokenPipeError:  # e.g. `... | head`: the reader left; nothing to report
    sys.stdout = open(os.devnull, "w")
    return 0
  except OSError as e:  # before the next clause: a path error is one line, else what follows decides
    if (err := path_error(e)) is None:
      raise
    exit_with(err, name[0])
  except Exception as e:  # a device out of memory: one line with the bill and what to change
    from jaxtrain.analysis import fit
    if (oom := fit.out_of_memory(e, name[0])) is None:
      raise
    exit_with(oom, name[0])
