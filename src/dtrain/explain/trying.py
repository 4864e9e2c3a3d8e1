"""``dtrain doctor RUN_DIR --try KEY=VALUE``: any change the cost model knows, predicted, or why not.

Keys are spelled as the config spells them (``--set``), and a value is checked by the config's own schema
(the run's ``config.yaml`` with the change applied), so a bad key or value fails in one line as ``--set``
does; a value that is good but that the run's strategy cannot honour gets its own line, as a change the
model cannot price for the run's strategy does (:mod:`dtrain.explain.exchange`). ``nodes=N`` (not a config
key: ``dtrain plan --nodes``) spreads the run's slots per host over N hosts.
Each change is one :class:`~dtrain.explain.costmodel.Target` priced by the same
:class:`~dtrain.explain.predictor.Predictor` call as the doctor's table and ``dtrain plan``'s row for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtrain.config.bounds import MAX_SLOTS
from dtrain.config.schema import ExperimentConfig, load_config
from dtrain.errors import ConfigError, UserError
from dtrain.explain import advice, precision, sharded
from dtrain.explain.costmodel import GROWTH_NOT_PROBED, Link, Target
from dtrain.explain.diagnosis import ConfigValue, Diagnosis, TryResult
from dtrain.explain.exchange import SLOTS
from dtrain.explain.plan import LOOPBACK_BETWEEN_HOSTS, as_ran, build_model, parse_link
from dtrain.explain.plandoc import explain_text, explained
from dtrain.explain.predictor import Predictor, TargetValue, target_at, too_wide, wide_reason
from dtrain.profiling.record import ProfileRecord

# Each key the cost model prices, and how to read its value from a validated config.
READ: dict[str, Callable[[ExperimentConfig], ConfigValue]] = {
    "precision": lambda c: c.precision,
    "hyperparameters.global_batch_size": lambda c: c.global_batch_size,
    "resources.slots_per_trial": lambda c: c.resources.slots_per_trial,
    "optimizations.aggregation_frequency": lambda c: c.optimizations.aggregation_frequency,
    "optimizations.gradient_compression": lambda c: c.optimizations.gradient_compression,
    "optimizations.tensor_fusion_threshold": lambda c: c.optimizations.tensor_fusion_threshold,
    "data_loader.num_workers": lambda c: c.data_loader.num_workers,
}
NODES = "nodes"
# Beside a prediction at another per-slot batch of a run whose model was not timed at twice its batch.
GROWTH_NOTE = ("the run's model was not timed at twice its batch after the run (rank 0's log says why), so how much of "
               "its compute and loading grows with the batch is unknown: the figure is halfway between all of it "
               "and none, the interval spans both (--verify measures it)")
STRATEGY = "sync.strategy"  # priced only as DDP instead of a sharded run's FSDP (dtrain.explain.sharded)


@dataclass(frozen=True, slots=True)
class Priced:
    """A change as the cost model takes it: a target (None: not priceable, ``why``), and what it changed."""

    target: Target | None
    inputs: dict[str, str]
    why: str | None = None  # no target: why; a target: a note beside the figure
    less_step: float = 0.0


class Tries:
    """Prices ``--try`` changes of one run; the model with a link (``dtrain plan``'s) is built only where a
    change needs one (``link_model``: a callable giving it, so a one-slot run is probed only then)."""

    def __init__(self, run_dir: Path, profile: ProfileRecord, predictor: Predictor,
                 link_model: Callable[[], Predictor], link: Link | None) -> None:
        self.run_dir, self.profile, self.predictor = run_dir, profile, predictor
        self._link_model, self._linked, self.link = link_model, None, link

    def predict(self, item: str) -> TryResult:
        """``item`` (KEY=VALUE) predicted; :class:`UserError` for a key or value the config refuses."""
        key, value, refused = self.parse(item)
        if key == STRATEGY and refused is None:
            return self._strategy(item, str(value))
        unpriced = self.predictor.unpriced
        if refused is None and unpriced is not None and unpriced.covers_key(key):
            refused = unpriced.message(f"{key}: {value}")
        priced = self.price(key, value) if refused is None else Priced(None, {"change": f"{key}: {value}"}, refused)
        why = self.predictor.refusal(priced.target) if priced.target is not None and unpriced is not None else None
        if why is not None and unpriced is not None:  # a value of a priced key that is not (one slot of FSDP)
            priced = Priced(None, priced.inputs, unpriced.message(f"{key}: {value}", why))
        if priced.target is None:
            return TryResult(item, key, value, None, None, None, None, priced.inputs, priced.why)
        predictor = self.predictor if not self._needs_link(priced.target) else self.linked()
        found = predictor.predict(priced.target, priced.less_step)
        inputs = {**priced.inputs, **{s.name: f"{s.value} [{s.source}]" for s in predictor.model.sources}}
        # A given link that replaces the one the run's hosts measured: the gain is over the run as it ran.
        over = predictor.base.samples_per_second / as_ran(self.profile, predictor.model).samples_per_second
        gain, low, high = found.value * over, found.low * over, found.high * over
        terms = explained(predictor.model, priced.target, priced.less_step)
        why = priced.why
        if found.prediction.widest == GROWTH_NOT_PROBED:
            why = "; ".join(filter(None, [why, GROWTH_NOTE]))
        if too_wide(gain, low, high):  # no point figure: the interval, and what measures it
            wide = wide_reason(f"{key}: {value}", low, high, found.prediction.widest, item)
            return TryResult(item, key, value, None, None, low, high, inputs, "; ".join(filter(None, [wide, why])),
                             terms)
        return TryResult(item, key, value, gain * self.profile.samples_per_second, gain, low, high, inputs, why,
                         terms)

    def _strategy(self, item: str, name: str) -> TryResult:
        """DDP instead of a sharded run's FSDP, as the doctor prices it (:mod:`dtrain.explain.sharded`); any
        other change of strategy is measured, not priced."""
        p = self.profile
        found = sharded.ddp_instead(p) if name == "ddp" else None
        inputs = {"change": f"{STRATEGY}: {name}"}
        if found is None:
            why = (f"cannot predict {STRATEGY}: {name} from a {p.strategy} run: the cost model prices DDP instead of "
                   "FSDP only, where the FSDP run's end-of-run probe timed its collectives apart (the gathered "
                   f"model fit) and its ranks measured a link; dtrain compare CONFIG --strategies {p.strategy},{name} "
                   "measures it")
            return TryResult(item, STRATEGY, name, None, None, None, None, inputs, why)
        inputs["compute held gathered, FSDP's collectives"] = "measured at the end of the run [measured]"
        return TryResult(item, STRATEGY, name, found.gain * p.samples_per_second, found.gain, found.low, found.high,
                         inputs, sharded.NOT_MEASURED)

    # ------------------------------------------------------------------------------------------ input
    def parse(self, item: str) -> tuple[str, ConfigValue, str | None]:
        """(key, value, why the run's strategy cannot take it or None) of ``KEY=VALUE``, the value as the
        config's schema reads it."""
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise UserError(f"--try expects KEY=VALUE as --set takes it (e.g. precision=bf16-mixed); got {item!r}")
        if key == NODES:
            if not text.strip().isdigit() or not 1 <= int(text) <= MAX_SLOTS:
                raise UserError(f"--try {item}: nodes must be a whole number from 1 to {MAX_SLOTS}")
            return key, int(text), None
        path, refused = self.run_dir / "config.yaml", None
        try:
            config = load_config(path, [f"{key}={text}"])
        except ConfigError as exc:
            # Good for the schema, refused by the run's strategy alone (fp16 compression under FSDP, one slot
            # of a parameter server): that change's own line, not the end of every other change's. A change of
            # the strategy's own keys is checked as given.
            as_ddp = None if key.startswith("sync.") else _under_ddp(path, f"{key}={text}")
            if as_ddp is None:
                raise UserError(f"--try: {str(exc).replace('--set', '--try')}") from None
            config = as_ddp
            refused = f"cannot predict {key}: {text.strip()} because {str(exc).removeprefix(f'{path}: ')}"
        read = READ.get(key)
        return key, read(config) if read is not None else text.strip(), refused

    # ------------------------------------------------------------------------------------------ pricing
    def price(self, key: str, value: ConfigValue) -> Priced:
        """The target of ``key: value``, or why the cost model cannot price it."""
        p, model = self.profile, self.predictor.model
        change = {"change": f"{key}: {value}"}
        if key == "precision":
            return self._precision(str(value), change)
        if key == NODES:
            return self._nodes(int(str(value)), change)
        if key == "resources.slots_per_trial":
            slots = int(str(value))
            nodes = max(1, min(p.hosts, slots))
            return Priced(target_at(model, slots, nodes), {**change, "nodes": f"{nodes} (the run's hosts, at most "
                                                                               "one per slot)"})
        if key == "hyperparameters.global_batch_size":
            batch = int(str(value))
            if batch % p.slots:
                raise UserError(f"--try {key}={batch}: the global batch must split evenly over the run's "
                                f"{p.slots} slot(s); try a multiple of {p.slots}")
            return self._priced(change, global_batch=batch)
        if key == "optimizations.aggregation_frequency":
            return self._priced(change, aggregation=int(str(value)))
        if key == "optimizations.gradient_compression":
            return self._compression(str(value), change)
        if key == "optimizations.tensor_fusion_threshold":
            return self._fusion(float(str(value)), change)
        if key == "data_loader.num_workers":
            return self._loader(int(str(value)), change)
        return Priced(None, change, f"cannot predict {key} because the cost model does not price it (it prices "
                      f"{', '.join([*READ, NODES])})")

    def _priced(self, inputs: dict[str, str], **changes: TargetValue) -> Priced:
        return Priced(target_at(self.predictor.model, **changes), inputs)

    def _precision(self, name: str, inputs: dict[str, str]) -> Priced:
        found = precision.estimate(self.profile, name)
        inputs = {**inputs, "precision": found.source}
        if found.gain is not None:
            return self._priced(inputs, **found.changes())
        if found.bound is not None:
            bound = self.predictor.predict(target_at(self.predictor.model, precision_gain=found.bound)).value
            return Priced(None, inputs, f"cannot predict precision: {name} because the model's own step was not "
                          f"timed in it; {found.source}: at most {bound:.2f}x samples/s (a bound, if the whole "
                          "compute were matmuls)")
        return Priced(None, inputs, f"cannot predict precision: {name} because {found.source}")

    def _nodes(self, nodes: int, inputs: dict[str, str]) -> Priced:
        p = self.profile
        local = advice.local_slots(p)
        if nodes > 1 and p.hosts == 1 and self.link is None:
            return Priced(None, inputs, f"cannot predict nodes: {nodes} because the run had one host and no link "
                          "between hosts was measured; give it with --link RATE[,LATENCY] (e.g. 200mbit)")
        return Priced(target_at(self.predictor.model, local * nodes, nodes),
                      {**inputs, "slots": f"{local * nodes} ({local} per node, as the run had)",
                       "link between hosts": self._between_hosts()})

    def _between_hosts(self) -> str:
        if self.link is not None and self.link.bytes_per_second is not None:
            return self.link.label
        return "as the run's hosts measured it" if self.profile.hosts > 1 else LOOPBACK_BETWEEN_HOSTS

    def _compression(self, name: str, inputs: dict[str, str]) -> Priced:
        p = self.profile
        if name not in p.strategy_compressions:
            return Priced(None, inputs, f"cannot predict gradient_compression: {name} because sync.strategy "
                          f"{p.strategy} cannot compress gradients that way")
        if name == "powersgd" and p.compression_cost is None:
            return Priced(None, inputs, "cannot predict gradient_compression: powersgd because the run did not "
                          "measure PowerSGD's cost (a run with 2 or more slots measures it at its end)")
        note = "one slot: no gradients are exchanged" if p.slots == 1 else None
        return Priced(target_at(self.predictor.model, compression=name), inputs, note)

    def _fusion(self, mb: float, inputs: dict[str, str]) -> Priced:
        p = self.profile
        gradients = self.predictor.model.facts.gradient_total
        if p.tensor_fusion_threshold_mb is None:
            return Priced(target_at(self.predictor.model), inputs, f"sync.strategy {p.strategy} does not fuse "
                          "gradients into buckets: the threshold changes nothing")
        if mb == p.tensor_fusion_threshold_mb:
            return self._priced(inputs)
        if mb * 2**20 >= gradients:
            return Priced(target_at(self.predictor.model, one_bucket=True),
                          {**inputs, "buckets": f"one ({gradients / 1e6:.2f} MB of gradients fit {mb:g} MB)"})
        model = self.predictor.model
        tensors = sum(len(t) for t in model.facts.gradient_bytes)
        if mb <= 0 and not tensors:
            return Priced(None, inputs, "cannot predict tensor_fusion_threshold: 0 because it puts each gradient "
                          "tensor in its own bucket and the run did not record its tensors' count")
        count = len(model.buckets(gradients, False, mb))
        how = (f"DDP's layout of the run's {tensors} gradient tensors" if tensors else
               f"the run's {len(model.buckets(gradients, False))} measured, scaled by DDP's layout at each threshold"
               if model.facts.buckets >= 1 else "DDP's layout")
        return Priced(target_at(model, bucket_mb=mb),
                      {**inputs, "buckets": f"{count} ({gradients / 1e6:.2f} MB of gradients in {mb:g} MB buckets: "
                       f"{how})"})

    def _loader(self, workers: int, inputs: dict[str, str]) -> Priced:
        """The loader plan's step with ``workers`` processes per slot, as the data factor predicts it."""
        data, step, work = advice.loader_inputs(self.profile)
        plan = advice.loader_plan(self.profile, data, step, work, workers=workers)
        left, less = advice.loader_priced(plan, step - self.predictor.base.parts["data"])
        return Priced(target_at(self.predictor.model, data_workers_step=left, data_workers_timed=plan.timed),
                      {**inputs, "loader": plan.why}, less_step=less)

    # ------------------------------------------------------------------------------------------ the link
    def _needs_link(self, target: Target) -> bool:
        """A target priced by ``dtrain plan``'s model: a one-slot run's exchanges (probed), another host count
        than one (the link between hosts), or any count of hosts where a link between them was given. Never
        for a change the model does not price for the run's strategy."""
        found = self.predictor.unpriced
        if found is not None and (found.covers_key(SLOTS) or self.predictor.refusal(target) is not None):
            return False  # (a sharded run with its collectives counted prices its slots and hosts: it may)
        given = self.link is not None and self.link.bytes_per_second is not None
        return target.slots > 1 and (self.predictor.model.link is None
                                     or (target.nodes > 1 and (self.profile.hosts == 1 or given)))

    def linked(self) -> Predictor:
        """``dtrain plan``'s model of the run (a local probe for a one-slot run, ``--link`` between hosts)."""
        if self._linked is None:
            self._linked = self._link_model()
        return self._linked


def _under_ddp(path: Path, change: str) -> ExperimentConfig | None:
    """The run's config with ``change`` and DDP as its strategy, or None where the change is bad in itself."""
    try:
        return load_config(path, [change, "sync.strategy=ddp"])
    except ConfigError:
        return None


def predict_all(run_dir: Path, profile: ProfileRecord, predictor: Predictor, items: list[str],
                link_text: str | None) -> list[TryResult]:
    """``--try``'s changes, each by the doctor's model, or by ``dtrain plan``'s where a link is needed (a local
    probe for a one-slot run, ``--link`` between hosts), built once and only then. A script's run takes the keys
    of a change from outside (:mod:`dtrain.explain.scriptadvice`)."""
    if profile.script is not None:
        from dtrain.explain.scriptadvice import try_one

        return [try_one(profile, item) for item in items]
    link = parse_link(link_text)
    between = link if link is not None and link.bytes_per_second is not None else None
    tries = Tries(run_dir, profile, predictor, lambda: Predictor(profile, build_model(run_dir, between)[1]), link)
    return [tries.predict(item) for item in items]


def explain_doctor(predictor: Predictor, diagnosis: Diagnosis) -> str:
    """``dtrain doctor --explain``: the run's step as the cost model's terms (they add up to the step the factor
    table shows: the model is calibrated to the run), then each ``--try``'s terms at the run and at the change."""
    run = explained(predictor.model, predictor.here)
    text = (f"explained: the run's step ({1e3 * diagnosis.step_seconds:.3f} ms) as the cost model's terms, each "
            "input with where it came from\n" + explain_text(run, change=False))
    for t in diagnosis.tries:
        reason = f"  {t.reason}\n" if t.reason and (t.gain is None or not t.terms) else ""
        text += f"try {t.change}:\n" + (explain_text(t.terms) if t.terms else "") + reason
    return text
