"""What every factor sees (:class:`Context`: the run's step split once, the cost model, the shared plans) and
what it is (:class:`Factor`: its seconds of the step and its advice)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dtrain.explain import advice, precision, sharded
from dtrain.explain.diagnosis import Advice, Scaling
from dtrain.explain.predictor import Predictor, target_at
from dtrain.explain.terms import registry as term_registry
from dtrain.profiling.record import ProfileRecord

# The cost model's terms the built-in factors split into their rows (explain/terms/); any other term is its own row.
FACTORED_TERMS = ("compute", "data", "fixed", "exchange", "late_rank")
MIN_GAIN = advice.MIN_GAIN  # a change predicted to gain no more than this is not advised
AGGREGATION_TO_TRY = 4
# The change two models can propose (the straggler's fallback on two slots, and the scaling estimate).
ONE_SLOT = ("resources.slots_per_trial", 1)


@dataclass(frozen=True, slots=True)
class Context:
    """The run's step split into the parts the factors share (seconds per step), computed once."""

    profile: ProfileRecord
    predictor: Predictor
    step: float  # mean over ranks
    data: float  # the mean wait for a batch over ranks: the cost model's data term at the run
    # forward + backward, and optimizer + other: the cost model's compute and fixed terms at the run (a sharded or
    # parameter-server run's: each the least over ranks, advice.own_work, with FSDP's collectives out)
    compute: float
    fixed: float
    exposed: float  # the model's exchange and late rank at the run, less the ranks' measured waiting
    per_message: float  # share of the exposed time paid per message (latency), not per byte
    late: advice.Straggler | None  # the rank the others wait for, None with one slot
    loader: advice.LoaderPlan  # one loader plan for the data and straggler factors
    lower_precision: precision.PrecisionEstimate | None
    scaling: Scaling
    # Seconds at the run of the cost model's terms that no built-in factor splits (a term added in its own file):
    # each is a row of the table, out of what the straggler row would otherwise hold.
    others: dict[str, float] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return self.profile.slots

    @property
    def exchanges(self) -> bool:
        """Whether the run exchanged anything: several slots, or one worker with a parameter server."""
        return self.slots > 1 or self.predictor.model.facts.holds_exchange

    @property
    def exchange_words(self) -> str:
        """What the run's exchange is, in the doctor's words."""
        return "push and pull to the servers" if self.predictor.model.facts.holds_exchange else "all-reduce"

    @property
    def global_batch(self) -> int:
        return self.profile.global_batch_size

    @property
    def straggler(self) -> float:
        """Time ranks spend waiting for the slowest: what the other parts leave of the step."""
        return max(0.0, self.step - self.data - self.compute - self.fixed - self.exposed - sum(self.others.values()))

    @property
    def precision_saved(self) -> float:
        """Seconds of compute a lower precision saves, by the model's own steps timed in it (0 unmeasured)."""
        found = self.lower_precision
        if found is None or found.gain is None or found.gain <= 1.0:
            return 0.0
        waits = max(0.0, found.data - self.data) if found.data is not None else 0.0  # a host-bound step's fetch
        return max(0.0, self.compute * (1 - 1 / found.gain) - waits)

    @property
    def compute_per_step(self) -> float:
        """Seconds of forward + backward that did not grow at twice the batch (measured): Python, small layers,
        and on a GPU the host queueing kernels the device waits for. A bigger batch spreads them over more
        samples, as it does the fixed costs. Never more than the compute a lower precision leaves."""
        share = 1.0 - batch_growth(self.predictor)
        return min(self.compute * share, max(0.0, self.compute - self.precision_saved))


class Factor:
    """One cause of step time: its seconds per step (all factors' seconds add up to the step) and what to
    change. Subclasses set ``name`` and register with :func:`dtrain.explain.factors.registry.register`."""

    name: ClassVar[str]

    def seconds(self, ctx: Context) -> float:
        """Seconds per step this factor accounts for."""
        raise NotImplementedError

    def advise(self, ctx: Context) -> Advice:
        """The change to try (with its predicted gain from ``ctx.predictor``), or why there is none."""
        raise NotImplementedError


def build_context(profile: ProfileRecord, predictor: Predictor) -> Context:
    """Split ``profile``'s step into the shared parts; the loader plan, the lower precision and the scaling
    estimate, each made once for every factor that needs it."""
    ranks = [r.seconds_per_step for r in profile.per_rank]
    step = sum(r.step for r in ranks) / len(ranks)
    # The data wait is the cost model's data term at the run, the mean over ranks: the table and the predictions
    # split the step one way. (The least over ranks left a slower loader's excess to the straggler row while the
    # model priced it as data; the mean is what the model's held-out rows were fitted with, and a chronically late
    # rank's wait for its batch is the late_rank term's beyond it.)
    data = predictor.base.parts["data"]
    work = [r.data + r.forward + r.backward + r.optimizer + r.other for r in ranks]
    late = advice.straggler(profile, work)
    # The rank the others wait for: the one that arrives last at the collectives (measured), else the one
    # with the most work; its exposed time is pure communication (it waited for no one).
    slowest = late.rank if late is not None else max(range(len(ranks)), key=lambda i: work[i])
    compute, fixed = advice.own_work(profile)
    # One loader plan for one change, the data factor's, the straggler factor's and --try's alike.
    loader = advice.loader_plan(profile, *advice.loader_inputs(profile))
    comm = profile.comm
    busy = comm.busy_seconds_per_step
    per_message = min(1.0, comm.buckets_per_step * comm.latency_seconds / busy) if busy > 0 else 0.0
    exposed = ranks[slowest].comm_exposed
    inside = sharded.split(profile, compute)
    if inside is not None:  # FSDP: its collectives ran inside forward and backward; the probe took them out
        compute, exposed, per_message = inside.compute, inside.collectives, 0.0
    parts = predictor.base.parts
    waited = max(0.0, step - data - compute - fixed - exposed)  # the ranks' waiting beyond their measured phases
    if inside is None and not predictor.model.facts.holds_exchange:
        # The table is the cost model's terms at the run: compute and fixed as the model prices them (the probe's
        # work times the contention and crowding it measured), so a row's share and a change's prediction split
        # the step one way. What a rank's measured phases held beyond them (DDP's hooks, the backend's threads on
        # the same cores) the model calibrated into the exchange: so does the table.
        compute, fixed = parts["compute"], parts["fixed"]
    others = {name: seconds for name, seconds in parts.items()
              if name in term_registry.names() and name not in FACTORED_TERMS}
    # What the other terms leave of the step is the model's exchange and late rank (calibrated so): the straggler
    # row is the ranks' measured waiting within it, the exchange's rows the rest.
    exchanges = max(0.0, step - data - compute - fixed - sum(others.values()))
    exposed = exchanges - min(waited, exchanges)
    return Context(profile, predictor, step, data, compute, fixed, exposed, per_message, late,
                   loader, precision.best(profile), scaling(profile, predictor), others)


def batch_growth(predictor: Predictor) -> float:
    """How much of one slot's forward + backward grows from its batch to twice it, 0 (none) to 1 (all), as the
    cost model prices a bigger batch (the end-of-run probe's work at both): the factor and the prediction of the
    change are one model's."""
    facts = predictor.model.facts
    batch = facts.per_slot_batch
    return advice.growth(facts.work.seconds(batch, facts.threads), facts.work.seconds(2 * batch, facts.threads))


def scaling(profile: ProfileRecord, predictor: Predictor) -> Scaling:
    """One slot doing the whole global batch, by the cost model: its data and compute at N x the per-slot
    batch as the end-of-run probe measured them (a small model's step is mostly per-step overhead, which
    N x the batch does not multiply), with the host's cores to itself, and no exchange."""
    if profile.slots == 1:  # one worker beside parameter servers: one slot alone would drop them, not priced
        return Scaling(None, False) if predictor.model.facts.holds_exchange else Scaling(1.0, False, 1.0)
    action = f"{ONE_SLOT[0]}: {ONE_SLOT[1]}"
    one = predictor.gain(action, slots=1, nodes=1)
    if one is None:  # a strategy whose exchange the model does not price: not estimated
        return Scaling(None, False)
    low, high = predictor.intervals[action]
    speedup = 1 / one  # N slots' samples/s over one slot's
    # A model not timed at twice its batch: one slot's step at N x the batch is a range, and "N slots are slower"
    # is said only where all of it is.
    slower = speedup < 1.0 and (predictor.model.facts.batch_growth_probed or low > 1.0)
    return Scaling(one, slower, speedup / profile.slots, speedup, (1 / high, 1 / low),
                   predictor.predict(target_at(predictor.model, 1, 1)).prediction.step,
                   advice.probe_growth(profile.batch_scaling)[0] if profile.batch_scaling is not None else None)


def nothing_to_exchange() -> Advice:
    return Advice(None, None, "one slot: no gradients to exchange", None)


def gains(speedup: float | None) -> bool:
    """Whether a predicted speed-up is worth a change (more than ``MIN_GAIN``)."""
    return speedup is not None and speedup > MIN_GAIN


def mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB"


def aggregation_gain(ctx: Context) -> float | None:
    """Exchanging gradients every ``AGGREGATION_TO_TRY`` batches, by the cost model."""
    k = AGGREGATION_TO_TRY
    return ctx.predictor.gain(f"optimizations.aggregation_frequency: {k}", aggregation=k)


def loader_gain(ctx: Context) -> float | None:
    """The cost model with the loader plan's step (:func:`dtrain.explain.advice.loader_priced`)."""
    plan = ctx.loader
    left, less = advice.loader_priced(plan, ctx.step - ctx.predictor.base.parts["data"])
    return ctx.predictor.gain(f"data_loader.num_workers: {plan.workers}", less_step=less, data_workers_step=left,
                              data_workers_timed=plan.timed)
