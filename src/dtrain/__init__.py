"""dtrain: synchronous data-parallel PyTorch training on N slots, with the time cost measured and explained.

Two user APIs, one engine:

* ``class MyTrial(dtrain.PyTorchTrial)`` named in an experiment config, run by ``dtrain run``;
* ``ctx = dtrain.init()`` inside your own loop, run by ``dtrain launch --slots N script.py`` or ``torchrun``.
"""

from typing import Any

__all__ = ["DistributedContext", "LRScheduler", "LoopCallback", "PyTorchTrial", "StepMode", "TrialContext", "init"]
__version__ = "0.1.0"

_LAZY = {"DistributedContext": "dtrain.engine.context", "TrialContext": "dtrain.engine.context",
         "init": "dtrain.engine.context", "PyTorchTrial": "dtrain.engine.trial",
         "LoopCallback": "dtrain.engine.callbacks", "LRScheduler": "dtrain.engine.schedulers",
         "StepMode": "dtrain.engine.schedulers"}


def __getattr__(name: str) -> Any:
    # Lazy: `dtrain --help`, `dtrain doctor` and config errors need not pay torch's import time.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
