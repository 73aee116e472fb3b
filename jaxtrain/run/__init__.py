"""Running a training job: the jitted step and its sharded set-up, loss scaling, the loop,
checkpoints and exact resume, the workdir's files and lock, metrics sinks, profiling.

May import core, model, parallel, data and analysis (the fit check); never a command."""
