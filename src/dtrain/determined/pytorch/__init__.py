"""``from dtrain.determined import pytorch``: Determined's PyTorch API (``determined.pytorch``) on dtrain.

Supported: ``PyTorchTrial``, ``PyTorchTrialContext``, ``PyTorchCallback``, ``DataLoader``, ``TorchData``,
``LRScheduler`` (its ``StepMode`` is dtrain's), ``Reducer`` (``AVG``), ``Batch``/``Epoch``/``TrainUnit``,
``init``/``Trainer``, ``to_device``, ``data_length``. What needs a Determined cluster or another framework
says so in one line when used. The full table: docs/from-determined.md.
"""

from __future__ import annotations

from dtrain.determined._notes import module_getattr
from dtrain.determined.pytorch._callback import PyTorchCallback
from dtrain.determined.pytorch._context import PyTorchExperimentalContext, PyTorchTrialContext
from dtrain.determined.pytorch._data import DataLoader, TorchData, data_length, to_device
from dtrain.determined.pytorch._trainer import Trainer, init
from dtrain.determined.pytorch._trial import PyTorchTrial, Reducer
from dtrain.determined.pytorch._units import Batch, Epoch, TrainUnit
from dtrain.engine.schedulers import LRScheduler

__all__ = ["Batch", "DataLoader", "Epoch", "LRScheduler", "PyTorchCallback", "PyTorchExperimentalContext",
           "PyTorchTrial", "PyTorchTrialContext", "Reducer", "TorchData", "TrainUnit", "Trainer", "data_length",
           "init", "to_device"]

__getattr__ = module_getattr("pytorch", {
    "deepspeed": "DeepSpeed trials are not supported; dtrain shards models with sync.strategy: fsdp",
    "lightning": "Lightning trials are not supported; write a PyTorchTrial (or use your own loop with dtrain.init())",
    "samplers": "dtrain shards the data itself; return a pytorch.DataLoader of the whole data set",
    "experimental": "Determined's batch-inference API needs a Determined master; run inference in your own loop "
                    "with dtrain.init() (dtrain launch)",
    "MetricReducer": "custom reducers are not supported (validation metrics are record-weighted means); compute "
                     "other reductions in evaluate_full_dataset",
    "load_trial_from_checkpoint_path": "a checkpoint's weights are RUN_DIR/checkpoints/<batches>/model.pt (a plain "
                                       "state_dict): build your model and load_state_dict(torch.load(...))",
    "CheckpointLoadContext": "see load_trial_from_checkpoint_path: load RUN_DIR/checkpoints/<batches>/model.pt",
})
