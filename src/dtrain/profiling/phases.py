"""The phases of a training step, in order (see :mod:`dtrain.profiling.timer`); a leaf module, so that the
timer and the straggler sampler it feeds can both import them."""

PHASES = ("data", "forward", "backward", "comm_exposed", "optimizer", "other")
