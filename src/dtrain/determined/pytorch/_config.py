"""The experiment config of a ``pytorch.init()`` / ``Trainer.fit()`` run, from Determined's arguments.

``init(hparams=..., exp_conf=...)`` gives the hyperparameters (Determined's ``get_hparams()``) and an
experiment config in Determined's vocabulary; ``fit(max_length=..., validation_period=...)`` gives the
lengths. The keys of ``exp_conf`` that dtrain models (``name``, ``resources``, ``optimizations``, ``seed``,
``precision``, ``sync``, ``data``, ...) configure the run as in ``dtrain run``; within them, keys dtrain
does not model (``resources.resource_pool``) are dropped, as are whole sections with no meaning here
(``environment``, ``bind_mounts``, ``searcher``: one line lists them), and ``exp_conf``'s
``hyperparameters`` (the ``hparams`` argument is the trial's, as in Determined). Everything kept is
validated as a dtrain config is: a bad value is one line naming its key.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel

from dtrain.config.schema import ExperimentConfig
from dtrain.errors import UserError

# Set by fit() (or meaningless for one run of a Trainer), whatever exp_conf says.
_FIT_OWNED = frozenset({"entrypoint", "max_length", "min_validation_period", "min_checkpoint_period",
                        "hyperparameters", "code_dir", "searcher"})
# An entrypoint the schema accepts until fit() names the trial's class.
_PLACEHOLDER_ENTRYPOINT = "__main__:PyTorchTrial"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The config section type of a field (``Resources`` of ``resources``), or None for a plain value."""
    for candidate in getattr(annotation, "__args__", None) or (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _known(section: Mapping[str, Any], model: type[BaseModel], prefix: str, dropped: list[str]) -> dict[str, Any]:
    """``section`` with only the keys ``model`` has (nested sections alike); the others into ``dropped``."""
    kept: dict[str, Any] = {}
    for key, value in section.items():
        if key not in model.model_fields:
            dropped.append(f"{prefix}{key}")
            continue
        sub = _submodel(model.model_fields[key].annotation)
        kept[key] = _known(value, sub, f"{prefix}{key}.", dropped) if sub and isinstance(value, Mapping) else value
    return kept


def config_for_init(hparams: Mapping[str, Any] | None, exp_conf: Mapping[str, Any] | None, world_size: int,
                    aggregation_frequency: int) -> tuple[dict[str, Any], dict[str, Any], list[str], bool]:
    """The raw dtrain config for ``init()`` (lengths are placeholders until ``fit()``), the keys of
    ``exp_conf`` kept aside (for ``get_experiment_config()``), the keys ignored, and whether the global batch
    is unknown (no ``global_batch_size`` in ``hparams``: the training loader's batch size sets it)."""
    given = copy.deepcopy(dict(exp_conf or {}))
    dropped: list[str] = []
    raw: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in given.items():
        if key in ExperimentConfig.model_fields and key not in _FIT_OWNED:
            sub = _submodel(ExperimentConfig.model_fields[key].annotation)
            raw[key] = _known(value, sub, f"{key}.", dropped) if sub and isinstance(value, Mapping) else value
        else:
            extras[key] = value
    seed = given.get("reproducibility", {}).get("experiment_seed") if isinstance(given.get("reproducibility"),
                                                                                 Mapping) else None
    if "seed" not in raw and seed is not None:
        raw["seed"] = seed  # Determined's name for it
    optimizations = raw.get("optimizations")
    if isinstance(optimizations, dict) and isinstance(optimizations.get("gradient_compression"), bool):
        # Determined's is a switch for fp16 compression.
        optimizations["gradient_compression"] = "fp16" if optimizations["gradient_compression"] else "none"
    if aggregation_frequency != 1:
        raw.setdefault("optimizations", {})["aggregation_frequency"] = aggregation_frequency
    ignored = [k for k in extras if k not in ("hyperparameters", "reproducibility", "data")] + dropped
    hp = dict(hparams or {})
    from_loader = "global_batch_size" not in hp
    raw["hyperparameters"] = {**hp, "global_batch_size": hp.get("global_batch_size", world_size)}
    raw["resources"] = {**raw.get("resources", {}), "slots_per_trial": world_size}  # the launcher's, here
    raw.setdefault("name", "trainer")
    raw["entrypoint"] = _PLACEHOLDER_ENTRYPOINT
    raw["max_length"] = {"batches": 1}
    raw["code_dir"] = os.getcwd()
    return raw, extras, ignored, from_loader


def agreed_run_dir(given: str | os.PathLike[str] | None, name: str, rank: int, world_size: int) -> tuple[Path, bool]:
    """The run directory every rank uses, and whether the user named it: ``given``, else ``DTRAIN_RUN_DIR``,
    else a new ``./runs/<name>-<time>`` the chief picks (and the others are told)."""
    named = given if given is not None else os.environ.get("DTRAIN_RUN_DIR") or None
    box: list[str | None] = [None]
    if rank == 0:
        if named is not None:
            path = Path(named).expanduser().absolute()
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = Path("runs").absolute() / f"{name}-{stamp}"
            n = 1
            while path.exists():  # two runs started in one second
                n += 1
                path = path.with_name(f"{name}-{stamp}-{n}")
        try:
            (path / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"run directory {path}: cannot create it ({exc.strerror}); choose another with "
                            "DTRAIN_RUN_DIR or pytorch.init(run_dir=...)") from None
        box[0] = str(path)
    if world_size > 1 and dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return Path(str(box[0])), named is not None
