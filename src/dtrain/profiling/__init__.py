"""The step profiler, beside the strategies: clocks, the communication recorder, the step timer and
the end-of-run figures. Strategies only ever see a :class:`CommRecorder` (or :data:`NULL_RECORDER`)."""

from dtrain.profiling.comm import NULL_RECORDER, CommRecorder, DDPTiming
from dtrain.profiling.timer import COMM_FIELDS, PHASES, StepTimer

__all__ = ["COMM_FIELDS", "NULL_RECORDER", "PHASES", "CommRecorder", "DDPTiming", "StepTimer"]
