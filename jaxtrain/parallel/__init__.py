"""Parallelism: the mesh, the rules table from logical axes to mesh axes, the execution plan (the model's `ops` on
the mesh), attention kernels and FP8, the hand-written collectives (ring and Ulysses attention, expert dispatch,
the pipeline schedule), data placement, multi-process start-up and XLA flags. May import jaxtrain.core and
jaxtrain.model (no import circle); never run, analysis, data, interop or the commands."""
