"""``import dtrain.determined as det``: a home for model_def.py files written against Determined AI's API.

Change two lines of a Determined trial, ``import determined as det`` -> ``import dtrain.determined as det``
and ``from determined import pytorch`` -> ``from dtrain.determined import pytorch``, and it runs on dtrain's
engine: ``dtrain run`` with ``entrypoint: model_def:MyTrial``, or ``pytorch.init()`` + ``pytorch.Trainer``
under ``dtrain launch`` / torchrun / python. There is no Determined cluster here: ``get_cluster_info()`` is
None, and what talks to a master (``det.core`` beyond ``DistributedContext``, ``det.experimental``) or to
other frameworks (``det.keras``...) says so in one line when used. The mapping: docs/from-determined.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from dtrain import __version__
from dtrain.determined import core, experimental, pytorch
from dtrain.determined._notes import NotHere, module_getattr
from dtrain.errors import UserError

__all__ = [
    "LOG_FORMAT",
    "InvalidHP",
    "NotHere",
    "__version__",
    "core",
    "experimental",
    "get_cluster_info",
    "import_from_path",
    "pytorch",
]

# Determined's log line layout (level, process id, logger, message), for logging.basicConfig(format=...).
LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"


class InvalidHP(UserError):
    """Raised by a trial whose hyperparameters cannot work: the run ends with this one line (exit code 2),
    and a ``dtrain search`` records the trial as failed."""


def get_cluster_info() -> None:
    """None: no Determined cluster runs this process (what Determined returns outside one)."""
    return None


def import_from_path(module_name: str, path: str | Path) -> ModuleType:
    """Import the file ``path`` as ``module_name`` (registered in ``sys.modules``) and return it."""
    spec = importlib.util.spec_from_file_location(module_name, Path(path))
    if spec is None or spec.loader is None:
        raise UserError(f"import_from_path: {path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


_FRAMEWORK = "dtrain trains PyTorch trials only (PyTorchTrial, or your own loop with dtrain.init())"
_CLUSTER = "it belongs to a Determined cluster's machinery, and there is none here"
__getattr__: Any = module_getattr("det", {
    "keras": _FRAMEWORK, "estimator": _FRAMEWORK, "tensorflow": _FRAMEWORK, "lightning": _FRAMEWORK,
    "transformers": _FRAMEWORK, "horovod": "dtrain exchanges gradients with torch.distributed (sync.strategy)",
    "deepspeed": "use sync.strategy: fsdp for sharded models", "launch": "use dtrain launch or dtrain run",
    "exec": _CLUSTER, "cli": "use the dtrain command", "common": _CLUSTER, "deploy": _CLUSTER, "ipc": _CLUSTER,
    "workload": _CLUSTER, "TrialController": _CLUSTER, "LegacyTrial": "subclass det.pytorch.PyTorchTrial",
    "ClusterInfo": "get_cluster_info() is None here", "errors": "dtrain.errors holds dtrain's own exceptions",
})
