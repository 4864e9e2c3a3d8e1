"""Hyperparameter ranges in Determined's forms, and a search's plan: validated before any trial starts.

A hyperparameter is either a plain value, a nested mapping of hyperparameters, or a range::

    lr: {type: log, minval: -3, maxval: 0, base: 10}        # 10^x, x uniform in [-3, 0]
    hidden: {type: int, minval: 16, maxval: 256, count: 4}  # count: points on grid search's grid
    momentum: {type: double, minval: 0.0, maxval: 0.95}
    act: {type: categorical, vals: [relu, tanh]}
    seed_offset: {type: const, val: 3}

Each range becomes an Optuna distribution; Optuna's samplers pick the values (a grid for ``grid``,
uniform random draws for ``random`` and ``adaptive_asha``) and its ``SuccessiveHalvingPruner`` makes
ASHA's stop/promote decisions. dtrain only turns the config into those objects and back.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import optuna
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dtrain.config.determined import translate
from dtrain.config.filevalues import check_replaced
from dtrain.config.rungs import Brackets, brackets, too_few_trials
from dtrain.config.schema import (
    HPARAM_TYPES,
    ExperimentConfig,
    SearcherConfig,
    _read_yaml,
    apply_override,
    config_from_dict,
)
from dtrain.errors import ConfigError

Scalar = str | int | float | bool | None  # what Optuna can store as a categorical choice


class _Range(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Bounded(_Range):
    # Grid search: how many evenly spaced values between minval and maxval (inclusive) make the grid.
    count: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> _Bounded:
        if self.minval > self.maxval:  # type: ignore[attr-defined]
            raise ValueError(f"minval {self.minval} is above maxval {self.maxval}; swap them")  # type: ignore[attr-defined]
        return self


class ConstRange(_Range):
    """One value, written in range form."""

    type: Literal["const"]
    val: Any


class IntRange(_Bounded):
    """An integer, uniform in [minval, maxval]."""

    type: Literal["int"]
    minval: int
    maxval: int


class DoubleRange(_Bounded):
    """A float, uniform in [minval, maxval]."""

    type: Literal["double"]
    minval: float
    maxval: float


class LogRange(_Bounded):
    """``base ** x`` with ``x`` uniform in [minval, maxval]: as in Determined, the bounds are exponents."""

    type: Literal["log"]
    minval: float
    maxval: float
    base: float = Field(default=10.0, gt=0)

    @field_validator("base")
    @classmethod
    def _not_one(cls, base: float) -> float:
        if base == 1:
            raise ValueError("base 1 gives the same value for every exponent; use e.g. base: 10")
        return base


class CategoricalRange(_Range):
    """One of ``vals``."""

    type: Literal["categorical"]
    vals: list[Any] = Field(min_length=1)

    @field_validator("vals")
    @classmethod
    def _scalars(cls, vals: list[Any]) -> list[Any]:
        bad = [v for v in vals if not (v is None or isinstance(v, (str, int, float, bool)))]
        if bad:
            raise ValueError(f"categorical vals must be numbers, strings, booleans or null (Optuna stores them); "
                             f"got {bad[0]!r}")
        return vals


Range = ConstRange | IntRange | DoubleRange | LogRange | CategoricalRange
RANGES: dict[str, type[_Range]] = {"const": ConstRange, "int": IntRange, "double": DoubleRange, "log": LogRange,
                                   "categorical": CategoricalRange}
_EXAMPLES = {"const": "{type: const, val: 3}", "int": "{type: int, minval: 16, maxval: 256}",
             "double": "{type: double, minval: 0.0, maxval: 0.9}", "log": "{type: log, minval: -4, maxval: -1}",
             "categorical": "{type: categorical, vals: [relu, tanh]}"}
_RANGE_KEYS = {"val", "minval", "maxval", "base", "vals", "count"}


def _meant_as_range(value: Any) -> bool:
    """A mapping with ``type`` is a range when the type is one (or a near miss of one), or when it has a
    range's keys; otherwise it is a nested group of hyperparameters that happens to hold a ``type``."""
    if not isinstance(value, dict) or "type" not in value:
        return False
    kind = value["type"]
    if kind in HPARAM_TYPES:
        return True
    near = isinstance(kind, str) and difflib.get_close_matches(kind, HPARAM_TYPES, n=1, cutoff=0.6)
    return bool(near) or bool(set(value) & _RANGE_KEYS)


def parse_range(name: str, raw: dict[str, Any], source: str) -> Range:
    """Validate one range; a mistake is one line naming ``hyperparameters.<name>...`` and the fix."""
    where = f"hyperparameters.{name}"
    kind = raw["type"]
    if kind not in RANGES:
        close = difflib.get_close_matches(str(kind), HPARAM_TYPES, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"use one of {', '.join(HPARAM_TYPES)}"
        raise ConfigError(f"{source}: {where}.type: unknown hyperparameter type {kind!r}; {hint}")
    model = RANGES[kind]
    for key in raw:
        if key not in model.model_fields:
            close = difflib.get_close_matches(str(key), list(model.model_fields), n=1, cutoff=0.6)
            hint = (f"did you mean '{where}.{close[0]}'?" if close
                    else f"valid keys for type {kind}: {', '.join(model.model_fields)}")
            raise ConfigError(f"{source}: unknown key '{where}.{key}'; {hint}")
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            raise ConfigError(f"{source}: {where}: type {kind} needs '{loc}'; e.g. {name}: {_EXAMPLES[kind]}") from None
        got = f" (got {err['input']!r})" if loc and not err["type"].startswith("value_error") else ""
        raise ConfigError(f"{source}: {where}{'.' + loc if loc else ''}: {msg}{got}") from None


def _spaced(low: float, high: float, count: int) -> list[float]:
    # The end points are the bounds themselves, not low + (count-1) * step, which can miss high by an ulp
    # and fall outside Optuna's distribution.
    if count == 1:
        return [low]
    return [low + (high - low) * i / (count - 1) if i < count - 1 else high for i in range(count)]


@dataclass(frozen=True)
class SearchSpace:
    """The ``hyperparameters`` section with its ranges found (dotted names for nested groups)."""

    hyperparameters: dict[str, Any]
    ranges: dict[str, Range]

    @classmethod
    def parse(cls, hyperparameters: dict[str, Any], source: str) -> SearchSpace:
        ranges: dict[str, Range] = {}

        def walk(node: dict[str, Any], prefix: str) -> None:
            for key, value in node.items():
                name = f"{prefix}{key}"
                if _meant_as_range(value):
                    ranges[name] = parse_range(name, value, source)
                elif isinstance(value, dict):
                    walk(value, f"{name}.")

        walk(hyperparameters, "")
        return cls(hyperparameters, ranges)

    @property
    def searched(self) -> dict[str, Range]:
        """The ranges Optuna samples (constants excluded)."""
        return {n: r for n, r in self.ranges.items() if not isinstance(r, ConstRange)}

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        dists: dict[str, optuna.distributions.BaseDistribution] = {}
        for name, r in self.searched.items():
            if isinstance(r, IntRange):
                dists[name] = optuna.distributions.IntDistribution(r.minval, r.maxval)
            elif isinstance(r, DoubleRange):
                dists[name] = optuna.distributions.FloatDistribution(r.minval, r.maxval)
            elif isinstance(r, LogRange):  # log-uniform between the powers: the same law as Determined's
                dists[name] = optuna.distributions.FloatDistribution(r.base ** r.minval, r.base ** r.maxval, log=True)
            elif isinstance(r, CategoricalRange):
                dists[name] = optuna.distributions.CategoricalDistribution(r.vals)
        return dists

    def grid(self, source: str) -> dict[str, list[Scalar]]:
        """Grid search's values per range; numeric ranges need ``count``."""
        grid: dict[str, list[Scalar]] = {}
        for name, r in self.searched.items():
            if isinstance(r, CategoricalRange):
                grid[name] = list(r.vals)
                continue
            if r.count is None:  # type: ignore[union-attr]
                raise ConfigError(f"{source}: hyperparameters.{name}: grid search needs 'count', the number of values "
                                  f"between minval and maxval, e.g. count: 3")
            if isinstance(r, IntRange):
                points = min(r.count, r.maxval - r.minval + 1)
                grid[name] = sorted({round(v) for v in _spaced(r.minval, r.maxval, points)})
            elif isinstance(r, DoubleRange):
                grid[name] = _spaced(r.minval, r.maxval, r.count)  # type: ignore[arg-type]
            elif isinstance(r, LogRange):
                grid[name] = [r.base ** x for x in _spaced(r.minval, r.maxval, r.count)]  # type: ignore[arg-type]
        return grid

    def fill(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The hyperparameters with every range replaced: by ``values[name]``, or its value if a constant."""
        filled = copy.deepcopy(self.hyperparameters)
        for name, r in self.ranges.items():
            node = filled
            *parents, leaf = name.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = r.val if isinstance(r, ConstRange) else values[name]
        return filled

    def example(self) -> dict[str, Any]:
        """Hyperparameters with a value inside every range: enough to validate the rest of the config."""
        values: dict[str, Any] = {}
        for name, r in self.searched.items():
            if isinstance(r, CategoricalRange):
                values[name] = r.vals[0]
            elif isinstance(r, LogRange):
                values[name] = r.base ** r.minval
            else:
                values[name] = r.minval  # type: ignore[union-attr]
        return self.fill(values)


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its ``study.stop()`` after the last point: that call only works inside
    ``study.optimize``, and the search counts its grid points itself."""

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        return None


class _BracketView:
    """The trials of one ASHA bracket, as Optuna's successive halving reads a study: each bracket selects
    among its own trials only (Optuna's HyperbandPruner filters its brackets the same way)."""

    def __init__(self, study: optuna.Study, keep: Callable[[int], bool]) -> None:
        self._study, self._keep = study, keep

    @property
    def direction(self) -> optuna.study.StudyDirection:
        return self._study.direction

    @property
    def _storage(self) -> Any:  # where the pruner records a trial's completed rungs
        return self._study._storage

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[optuna.trial.FrozenTrial]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states) if self._keep(t.number)]


class _RungPruner(optuna.pruners.BasePruner):
    """Optuna's ``SuccessiveHalvingPruner`` on rung numbers: a report at the end of rung k (its length in the
    plan, Determined's ``max_length // divisor ** (r - 1 - k)``) is shown to it at step ``divisor ** k``,
    where it looks for rung k; among the trials of the same bracket only."""

    def __init__(self, plan: SearchPlan) -> None:
        self._plan = plan
        self._halving = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=plan.searcher.divisor,
                                                               min_early_stopping_rate=0)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        lengths, step = self._plan.lengths_of(trial.number), trial.last_step
        if step is None or step not in lengths:
            return False
        shown = copy.copy(trial)
        rung = lengths.index(step)
        shown.intermediate_values = {self._plan.searcher.divisor ** rung: trial.intermediate_values[step]}
        brackets = self._plan.brackets
        if len(brackets.trials) == 1:
            return self._halving.prune(study, shown)
        mine = brackets.of(trial.number)
        return self._halving.prune(_BracketView(study, lambda n: brackets.of(n) == mine), shown)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SearchPlan:
    """Everything a search needs to know before its first trial, checked once."""

    raw: dict[str, Any]  # the config in dtrain's vocabulary, overrides applied, code_dir made absolute
    source: str
    config: ExperimentConfig  # validated with a value inside every range
    searcher: SearcherConfig
    space: SearchSpace
    unit: Literal["batches", "epochs"]
    lengths: tuple[int, ...]  # rung ends of the first bracket (the most rungs), in `unit`; the last: a full trial
    max_trials: int
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # said at the start of the search, as the notes are, but louder
    brackets: Brackets | None = None  # every bracket's rungs and trials (None: one bracket, `lengths`)

    def __post_init__(self) -> None:
        if self.brackets is None:
            object.__setattr__(self, "brackets", Brackets(self.unit, (self.lengths,), (self.max_trials,)))

    @property
    def direction(self) -> str:
        return "minimize" if self.searcher.smaller_is_better else "maximize"

    @property
    def is_asha(self) -> bool:
        return any(len(lengths) > 1 for lengths in self.brackets.lengths)  # type: ignore[union-attr]

    def lengths_of(self, number: int) -> tuple[int, ...]:
        """The rung ends of trial ``number``'s bracket."""
        return self.brackets.lengths[self.brackets.of(number)]  # type: ignore[union-attr]

    def next_length(self, done: int | None, number: int = 0) -> int:
        """The length trial ``number`` trains to next, given the length of its last reported rung (None: none
        yet)."""
        return next(n for n in self.lengths_of(number) if done is None or n > done)

    def rungs_text(self) -> str:
        """The rung ends, bracket by bracket: "3, 9, 27" or "3, 9, 27 (11 trials) | 9, 27 (5 trials)"."""
        b = self.brackets
        assert b is not None
        if len(b.trials) == 1:
            return ", ".join(map(str, b.lengths[0]))
        return " | ".join(f"{', '.join(map(str, ls))} ({n} trial{'s' if n != 1 else ''})"
                          for ls, n in zip(b.lengths, b.trials, strict=True))

    def trial_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """A plain ``dtrain run`` config: single hyperparameter values, the full length, no searcher."""
        cfg = copy.deepcopy(self.raw)
        cfg.pop("searcher", None)
        cfg["hyperparameters"] = self.space.fill(values)
        cfg["max_length"] = {self.unit: self.lengths[-1]}
        return cfg

    def sampler(self, number: int) -> optuna.samplers.BaseSampler:
        """The sampler for trial ``number``."""
        if self.searcher.name == "grid":
            return _GridSampler(self.space.grid(self.source), seed=self.config.seed)
        # One seeded sampler per trial: trial n draws the same values whatever ran before it, across a resume
        # (Optuna keeps no sampler state) and between searchers (random and adaptive_asha draw alike, which
        # makes their comparison one of scheduling only).
        # Seeds from a SeedSequence: consecutive integer seeds give numpy's legacy generator (Optuna's) nearly
        # the same first draws.
        seed = int(np.random.SeedSequence([self.config.seed, number]).generate_state(1)[0])
        return optuna.samplers.RandomSampler(seed=seed)

    def pruner(self) -> optuna.pruners.BasePruner:
        if not self.is_asha:
            return optuna.pruners.NopPruner()
        return _RungPruner(self)


def load_plan(path: Path, overrides: list[str] | None = None) -> SearchPlan:
    """Read a search config (ranges in ``hyperparameters``, a ``searcher`` section) and validate all of it."""
    raw = _read_yaml(path)
    written = copy.deepcopy(raw) if overrides else raw
    for item in overrides or []:
        apply_override(raw, item)
    raw.setdefault("code_dir", str(path.resolve().parent))
    plan = plan_from_raw(raw, str(path))
    if overrides:  # as dtrain run: the file's own values, where --set replaces them, must be valid too
        check_replaced(written, overrides, str(path), plan.config.global_batch_size)
    return plan


def plan_from_raw(raw: dict[str, Any], source: str) -> SearchPlan:
    """The plan of a search config; a Determined config is read in dtrain's vocabulary first (the plan keeps
    that form: trials never see Determined's keys), its ignored keys named in one of the plan's warnings."""
    translation = translate(raw, source)
    raw, ignored = translation.raw, translation.warning(source)
    hparams = raw.get("hyperparameters")
    if not isinstance(hparams, dict):
        raise ConfigError(f"{source}: hyperparameters must be a mapping with at least global_batch_size; "
                          f"got {type(hparams).__name__}")
    space = SearchSpace.parse(hparams, source)
    config = config_from_dict({**raw, "hyperparameters": space.example()}, source, warn=False)
    searcher = config.searcher
    if searcher is None:
        raise ConfigError(f"{source}: no 'searcher' section; add one, e.g. searcher: {{name: random, "
                          "metric: validation_loss, max_trials: 8}")
    if Path(config.checkpoint_storage.path).is_absolute():
        raise ConfigError(f"{source}: checkpoint_storage.path {config.checkpoint_storage.path!r} is absolute, so every "
                          "trial would write its checkpoints to the same place; use a relative path (each trial's "
                          "run directory holds its own)")
    length = searcher.max_length or config.max_length
    plan_brackets = brackets(searcher, length)
    notes: list[str] = [plan_brackets.note] if plan_brackets.note else []
    if searcher.name == "adaptive_asha" and searcher.mode is None and not searcher.bracket_rungs:
        notes.append("searcher.mode not given: one bracket of ASHA (mode aggressive); Determined's default, "
                     "standard, also runs brackets of fewer rungs: set searcher.mode: standard for that")
    warnings = [w for w in (ignored, too_few_trials(searcher, length)) if w]
    if searcher.name == "grid":
        points = math.prod(len(v) for v in space.grid(source).values())
        max_trials = min(points, searcher.max_trials or points)
        if max_trials < points:
            notes.append(f"the grid has {points} points; searcher.max_trials {max_trials} runs the first {max_trials}")
    elif searcher.name == "single":
        max_trials = 1
    else:
        max_trials = sum(plan_brackets.trials)  # max_trials, but a bracket always has a trial
    return SearchPlan(raw, source, config, searcher, space, plan_brackets.unit, plan_brackets.lengths[0], max_trials,
                      tuple(notes), tuple(warnings), plan_brackets if searcher.name == "adaptive_asha" else None)
