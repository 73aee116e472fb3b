"""Parallelism: the mesh, the rules table from logical axes to mesh axes, the execution plan,
the hand-written collectives (ring attention, expert dispatch, pipeline), schedules, data
placement, multi-process start-up and XLA flags. May import jaxtrain.core and jaxtrain.model
(no import circle); never run, analysis, data, interop or the commands."""
