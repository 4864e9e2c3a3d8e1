"""The Trial API, in the spirit of Determined's PyTorchTrial."""

from __future__ import annotations

import contextlib
import importlib
import sys
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torch.utils.data import DataLoader, Dataset

from dtrain.engine import data
from dtrain.engine.callbacks import LoopCallback
from dtrain.engine.context import TrialContext
from dtrain.errors import ConfigError


class PyTorchTrial(ABC):
    """Subclass this, name it in ``entrypoint``, and dtrain runs it on N slots.

    Build models and optimizers in ``__init__`` through ``context.wrap_model`` / ``wrap_optimizer``;
    return Datasets (dtrain shards and batches them with the per-slot batch size); in ``train_batch`` call
    ``context.backward(loss)`` and ``context.step_optimizer(opt)`` and return metrics. To act at the loop's
    hooks (epochs, steps, validation, checkpoints), return callbacks from ``build_callbacks``.
    """

    # The context class dtrain builds for this trial (a subclass of TrialContext adds an API of its own, as
    # dtrain.determined's PyTorchTrialContext does).
    context_class: ClassVar[type[TrialContext]] = TrialContext

    def __init__(self, context: TrialContext) -> None:
        self.context = context

    @abstractmethod
    def build_training_data(self) -> Dataset:
        """The training records. Batches reach ``train_batch`` already on the slot's device."""

    def build_validation_data(self) -> Dataset | None:
        """The validation records, or None for no validation."""
        return None

    @abstractmethod
    def train_batch(self, batch: Any, epoch_idx: int, batch_idx: int) -> dict[str, Any]:
        """One training step on this slot's share of the global batch; returns scalar metrics."""

    def evaluate_batch(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """Metrics for one validation batch, as means over its records (dtrain weights them exactly)."""
        raise NotImplementedError("override evaluate_batch to validate")

    def evaluate_full_dataset(self, data_loader: DataLoader) -> dict[str, Any]:
        """Instead of ``evaluate_batch``: metrics over the whole validation set, computed by the first slot
        alone from an unsharded loader (the other slots wait) and handed to every slot. Overriding it
        selects it."""
        raise NotImplementedError("override evaluate_full_dataset or evaluate_batch to validate")

    def get_batch_length(self, batch: Any) -> int:
        """Records in a validation batch (weights its metrics); override for batch types without a leading
        tensor dimension."""
        return data.batch_size_of(batch)

    def loader_options(self, split: str) -> dict[str, Any]:
        """Extra DataLoader options for the ``"train"`` or ``"eval"`` loader (``collate_fn``, ``num_workers``,
        ...: see :meth:`TrialContext.loader`); dtrain still shards and batches."""
        return {}

    def build_callbacks(self) -> dict[str, LoopCallback]:
        """Callbacks the loop calls at its hooks (:class:`dtrain.LoopCallback`), by name: a callback's name
        keys its state in checkpoints, so keep it across resumes. Called once per slot, after ``__init__``."""
        return {}


# Import names whose pip package is called something else (the usual surprises).
PIP_NAMES = {"sklearn": "scikit-learn", "cv2": "opencv-python", "PIL": "pillow", "yaml": "pyyaml",
             "skimage": "scikit-image", "bs4": "beautifulsoup4", "attr": "attrs", "google.protobuf": "protobuf"}


def _import_fresh(module_name: str, code_dir: str) -> None:
    """Make the next import of ``module_name`` read its file now, from ``code_dir`` first.

    One process can load several trials: ``--verify`` and bench runs, a test suite, and every worker
    forked from dtrain's fork server (:mod:`dtrain.launcher.forkstart`) inherits the server's modules. A
    module of the same name imported earlier may come from another folder, or from the file before it was
    edited.
    """
    with contextlib.suppress(ValueError):
        sys.path.remove(code_dir)
    sys.path.insert(0, code_dir)
    top = module_name.split(".")[0]
    if top != "dtrain":  # dtrain's own modules stay: the running code is made of them
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]
    importlib.invalidate_caches()


def load_trial_class(entrypoint: str, code_dir: str) -> type[PyTorchTrial]:
    """Import ``module:Class`` from ``code_dir`` and check that it is a PyTorchTrial."""
    module_name, _, class_name = entrypoint.partition(":")
    _import_fresh(module_name, code_dir)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            # The trial's file was found; something it imports was not (a package not installed here).
            top = missing.split(".")[0]
            raise ConfigError(f"entrypoint {entrypoint!r}: module {module_name!r} imports {missing!r}, which is not "
                              f"installed in this Python ({sys.executable}); install it: pip install "
                              f"{PIP_NAMES.get(top, top)}") from None
        raise ConfigError(f"entrypoint {entrypoint!r}: cannot import module {exc.name!r} from {code_dir}; "
                          "check the module name and that the file sits beside the config") from None
    except Exception as exc:  # the user's module raised while importing
        raise ConfigError(f"entrypoint {entrypoint!r}: importing {module_name!r} failed with "
                          f"{type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        names = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, PyTorchTrial)
                 and v is not PyTorchTrial]
        raise ConfigError(f"entrypoint {entrypoint!r}: module {module_name!r} has no {class_name!r}"
                          f"{'; Trials there: ' + ', '.join(names) if names else ''}")
    if not (isinstance(cls, type) and issubclass(cls, PyTorchTrial)):
        raise ConfigError(f"entrypoint {entrypoint!r}: {class_name} is not a subclass of dtrain.PyTorchTrial")
    missing_methods = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing_methods:  # found here, in one line, rather than as a TypeError in every worker
        raise ConfigError(f"entrypoint {entrypoint!r}: {class_name} does not define {', '.join(missing_methods)}, "
                          "which every Trial needs; add them (see dtrain.PyTorchTrial)")
    return cls
