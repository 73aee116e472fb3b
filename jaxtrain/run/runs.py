"""A run directory's committed checkpoints, read back for tools other than the trainer
(hf export, generate): which step, its config, its parameters on a mesh."""

from __future__ import annotations

from pathlib import Path

from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.core.errors import UserError


def locate(workdir: str | Path, step: int | None) -> Path:
  """The committed step directory: the latest, or `step`."""
  ckdir = Path(workdir) / "checkpoints"
  steps = checkpoint.committed_steps(ckdir)
  if not steps:
    raise UserError(f"--workdir {workdir}: no committed checkpoint in {ckdir}")
  if step is None:
    return ckdir / str(steps[-1])
  if step not in steps:
    raise UserError(f"--step {step}: no committed checkpoint at that step in {ckdir}; committed steps: {steps}")
  return ckdir / str(step)


def config_of(manifest: dict) -> config.Config:
  """The Config a checkpoint was written with (its manifest holds every key), type-checked
  again; a checkpoint written before a key was renamed or added still loads."""
  return config.from_dict(manifest["config"], where="the checkpoint's config")


def restore_params(cfg: config.Config, mesh, step_dir: Path, stored: bool = False):
  """(step.Setup, params pure dict) restored from `step_dir` onto the mesh's shardings (a QLoRA base dequantized to
  float32, or with `stored` as its codes and scales, quant.QTensor). Only the parameters are read (orbax partial
  restore): the Adam moments, twice their size, stay on disk."""
  import jax
  import orbax.checkpoint as ocp
  from jaxtrain.run import step as step_lib
  setup = step_lib.Setup(cfg, mesh)
  cfg = setup.cfg  # with what the mesh implies
  manifest = checkpoint.read_manifest(step_dir)
  checkpoint.verify(step_dir, manifest, cfg.checkpoint.verify)
  # the compute layout, in device memory, whatever the run's optim.zero_stage / optim.offload stored
  want = {"params": jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                 setup.abstract_state()["params"], setup.layout.param_at_rest)}
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      state = ckptr.restore(step_dir / "default", args=ocp.args.PyTreeRestore(
          item=want, restore_args=ocp.checkpoint_utils.construct_restore_args(want), partial_restore=True))
  except Exception as e:  # noqa: BLE001 (orbax raises many types; one line for the user)
    raise checkpoint.CheckpointError(f"checkpoint {step_dir}: parameters could not be restored: "
                                     f"{checkpoint._reason(e)}") from e  # noqa: SLF001
  if cfg.model.lora_base_dtype == "none" or stored:
    return setup, state["params"]
  # QLoRA: the quantized base as the float32 weights its codes stand for (what export and decode read)
  from jaxtrain.model import quant
  dense = jax.jit(lambda p: quant.dequantized(p, jax.numpy.float32), out_shardings=setup.param_shardings)
  return setup, dense(state["params"])
