"""Looking at a run before and beside it: the analytic memory bill, communication per
axis, compiling the step for a GPU that is not here, compiled costs, the fit verdict,
step timing and baselines for `bench`.

May import core, model, parallel and run (the step's set-up); never a command."""
