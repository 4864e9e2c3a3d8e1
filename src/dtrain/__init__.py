"""dtrain: synchronous data-parallel PyTorch training on N slots, with the time cost measured and explained.

Two user APIs, one engine:

* ``class MyTrial(dtrain.PyTorchTrial)`` named in an experiment config, run by ``dtrain run``;
* ``ctx = dtrain.init()`` inside your own loop, run by ``dtrain launch --slots N script.py`` or ``torchrun``.
"""

from dtrain.context import DistributedContext, TrialContext, init
from dtrain.trial import PyTorchTrial

__all__ = ["DistributedContext", "PyTorchTrial", "TrialContext", "init"]
__version__ = "0.1.0"
