"""Advice in the user's terms: what to check on a straggler's host, and what the machine can give.

The doctor (:mod:`dtrain.explain.doctor`) decides *which* factor matters and how much; this module words the
fix so that a person can act on it: the rank, its host, how late it arrives and what to look at there
for the phase it is slow in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dtrain.profiling.record import BatchScaling, ProfileRecord

# A change predicted to gain less than this is not advised: it changes nothing a user could measure.
MIN_GAIN = 1.02
# What slows one rank in each phase, and how to see it on that host (Linux tools that are always there
# first, then the GPU's).
CHECKS = {
    "data": ("its input pipeline: a slower or remote disk there (iostat -x 1, a network filesystem), a cold "
             "page cache, loader processes starved of CPU (top); more loader workers "
             "(data_loader.num_workers) overlap loading with the step"),
    "forward": ("other processes on its cores (top; ps -eo pcpu,comm --sort=-pcpu), CPU frequency or thermal "
                "throttling (grep MHz /proc/cpuinfo), more torch threads than cores (OMP_NUM_THREADS), on a GPU "
                "its clocks, temperature and other processes (nvidia-smi -q -d PERFORMANCE), and whether that "
                "rank gets bigger inputs (uneven lengths)"),
    "backward": ("gradient hooks or custom autograd functions doing extra work on that rank, other processes on "
                 "its cores (top), CPU frequency or thermal throttling (grep MHz /proc/cpuinfo), on a GPU its "
                 "clocks and temperature (nvidia-smi -q -d PERFORMANCE)"),
    "optimizer": ("memory pressure there (free -m; vmstat 1 shows swapping), other processes on its cores "
                  "(top), optimizer state on a slower device"),
    "other": ("work in train_batch that only that rank does (rank-conditional logging, metrics, printing) and "
              "other processes on its cores (top)"),
}


@dataclass(frozen=True, slots=True)
class Straggler:
    """The rank the others wait for: where, how late, slow in which phase; ``measured`` from arrival lags
    (``chronic``: last in most sampled steps), else from per-rank work (``chronic`` then unknown)."""

    rank: int
    host: str
    lag_seconds: float
    lag_p90_seconds: float | None
    last_fraction: float | None
    samples: int
    chronic: bool | None
    phase: str
    phase_excess_seconds: float
    measured: bool
    fixed_speedup: float | None = None  # the step without the waiting (a chronic straggler's row only)
    fixed_interval: tuple[float, float] | None = None  # its 80% interval, where the cost model priced it

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        for key in ("fixed_speedup", "fixed_interval"):
            if out[key] is None:
                del out[key]
        return out


@dataclass(frozen=True, slots=True)
class LoaderPlan:
    """Loader processes per slot to try, the step they predict, and why in words."""

    workers: int
    step_seconds: float
    why: str
    timed: bool = False  # the step with that many was timed after the run beside the training's work


@dataclass(frozen=True, slots=True)
class BatchChange:
    """A bigger global batch in the user's terms: the learning-rate rule, its factor, the ``--set`` changes
    that apply it, and a sentence."""

    sets: list[str]
    rule: str
    lr_factor: float
    text: str


def straggler(profile: ProfileRecord, work: list[float]) -> Straggler | None:
    """The rank everyone waits for, from ``profile.json``'s arrival lags (``stragglers``), else from the
    per-rank work (no lags sampled). None with one slot."""
    ranks = profile.per_rank
    if len(ranks) < 2:
        return None
    lags = profile.stragglers
    if lags is not None and lags.per_rank:
        per_rank = lags.per_rank
        chronic = lags.chronic_rank
        pick = chronic if chronic is not None else max(range(len(per_rank)),
                                                       key=lambda i: per_rank[i].lag_median_seconds)
        r = per_rank[pick]
        return Straggler(pick, r.host or "?", r.lag_median_seconds, r.lag_p90_seconds, r.last_fraction, lags.samples,
                         chronic is not None, r.slow_phase, r.slow_phase_excess_seconds, True)
    slowest = max(range(len(work)), key=lambda i: work[i])
    fastest = min(range(len(work)), key=lambda i: work[i])
    phases = ("data", "forward", "backward", "optimizer", "other")
    excess = {p: ranks[slowest].seconds_per_step.of(p) - min(r.seconds_per_step.of(p) for r in ranks) for p in phases}
    phase = max(phases, key=lambda p: excess[p])
    return Straggler(slowest, ranks[slowest].host or "?", work[slowest] - work[fastest], None, None, 0, None, phase,
                     excess[phase], False)


# How the last sentence of :func:`straggler_text` begins: the fallback, if the rank cannot be fixed.
FALLBACK_OPENINGS = ("If it cannot be fixed, ", "One slot fewer ")


def straggler_text(s: Straggler, fewer_slots: str, one_host: bool = False,
                   fallback_speedup: float | None = None) -> str:
    """One paragraph about a chronically late rank: who, where, how late, slow in what, what to check there,
    and the fallback (one slot fewer; on a multi-host run, leaving that rank out), offered only when
    ``fallback_speedup`` (its predicted speed-up) gains more than 2%."""
    ms = 1e3 * s.lag_seconds
    if s.measured:
        how = (f"arrives {ms:.2f} ms late at the gradient all-reduce (median over {s.samples} sampled steps; "
               f"p90 {1e3 * (s.lag_p90_seconds or 0.0):.2f} ms; last in {100 * (s.last_fraction or 0.0):.0f}% of "
               "them)")
    else:
        how = f"needs {ms:.2f} ms more work per step than the fastest rank"
    # Every rank shares the one host: there is no other host to move to, only fewer slots on this one.
    if fallback_speedup is not None and fallback_speedup > MIN_GAIN:
        fallback = FALLBACK_OPENINGS[0] + (f"run one slot fewer ({fewer_slots})" if one_host
                                           else f"leave it out ({fewer_slots})")
    else:
        shown = f"{fallback_speedup:.2f}x" if fallback_speedup is not None else "not predicted"
        fallback = f"{FALLBACK_OPENINGS[1]}({fewer_slots}) is predicted no faster ({shown}): fixing it is the way"
    return (f"rank {s.rank} (host {s.host}) {how}, slow in {s.phase} "
            f"(+{1e3 * s.phase_excess_seconds:.2f} ms per step over the fastest rank); the other ranks wait for "
            f"it. Check on {s.host}: {CHECKS[s.phase]}. {fallback}")


def split_fallback(text: str) -> tuple[str, str]:
    """:func:`straggler_text`'s paragraph as (the finding, its last sentence: the fallback), for a verdict that
    puts the figures of the fix between them; ("text", "") for another paragraph."""
    finding, _, last = text.rpartition(". ")
    if finding and last.startswith(FALLBACK_OPENINGS):
        return finding, last
    return text, ""


def turns_text(s: Straggler, waiting: float) -> str:
    """The straggler factor when no rank is chronically last: ranks take turns, so no rank or host is to
    blame (run-to-run noise, or cores every rank shares), and nothing is to leave out or check on one host."""
    wait = f"ranks wait {1e3 * waiting:.2f} ms per step for one another"
    who = f"rank {s.rank} (host {s.host})"
    if not s.measured:
        return (f"{wait}; no arrival lags were sampled, so no rank is known to be chronically last ({who} has "
                f"{1e3 * s.lag_seconds:.2f} ms more work per step than the fastest): ranks may take turns, "
                "with noise or cores shared by all ranks")
    return (f"{wait}, but no rank is chronically last: ranks take turns (the latest, {who}, is last in "
            f"{100 * (s.last_fraction or 0.0):.0f}% of {s.samples} sampled steps): noise, or cores shared by all "
            "ranks; no one rank to fix or leave out")


def usable_cores(profile: ProfileRecord) -> int | None:
    """CPU cores the run's host offered (recorded by the run), or None where none were recorded."""
    return profile.cpu_cores or None


def local_slots(profile: ProfileRecord) -> int:
    """Slots per host (the run's ranks over its distinct host names)."""
    return max(1, profile.slots // profile.hosts)


# Loader processes per slot dtrain will advise at most (each is a process with its own dataset copy).
MAX_ADVISED_WORKERS = 8


def loader_plan(profile: ProfileRecord, data: float, step: float, cpu_work: float,
                workers: int | None = None) -> LoaderPlan:
    """How many loader processes per slot to try (``workers``: that many, as given) and the step they predict,
    from what the machine has.

    ``data`` is the wait for a batch per step, ``cpu_work`` the training process's own busy time per step (on a
    CPU host with its exchange's). With W loader processes a slot gets a batch every ``T / W`` seconds, hidden
    behind the rest of the step; but each batch is handed over from the loader's process, which costs the
    training process ``R`` (both probed after the run through one loader process,
    :mod:`dtrain.profiling.handoff`), and the loaders' CPU time and the training threads' share the slot's
    cores, which bounds the step from below::

        step(W) = max(step - data + R, T / W, (threads x cpu_work + R + cpu_share x T) / cores_per_slot)

    On a CPU host that bound is too kind: a loader that waits (a file, a sleep) waits again for a core at every
    wake-up while the training keeps the cores busy. There the step with W = 1, 2, ... loader processes was timed
    after the run beside the training's own work (``data_crowded_step_seconds``), and with the run's own W
    (``data_crowded_own_step_seconds``): each such step, as its ratio to the run's own, times the run's step,
    replaces the formula for those W, and beyond them the crowding (that step over the formula's) grows on as it
    grew over the last two timed.

    So on 2 cores with 2 slots, CPU-bound loaders gain little (they take the training's core), loaders that
    mostly wait (disk, network) need no core and hide up to W batches of waiting, and a batch that loads
    faster in place than it is handed over is slower through any loader process. Without the handoff probe
    (older profiles), ``T`` is the in-place load and ``R`` nothing. A run that has loader processes is also
    offered none (``W = 0``, each batch loaded in place), where the handoff was probed: timed the same way after
    the run (``data_crowded_none_step_seconds``: without its loaders the training's own phases have the cores to
    themselves), else ``step - data + load``, which keeps what the loaders took from those phases: low.
    """
    current = profile.data_loader_workers
    load = profile.data_load_seconds_per_batch or data
    handoff = profile.data_handoff_seconds_per_batch
    receive = (profile.data_handoff_cpu_seconds_per_batch or 0.0) if handoff is not None else 0.0
    through = handoff if handoff is not None else load
    share = profile.data_load_cpu_share
    cpu_share = share if share is not None else 1.0  # not probed: assume loading needs a core
    cores = usable_cores(profile)
    per_slot = cores / local_slots(profile) if cores else None
    threads = profile.threads_per_slot
    rest = max(0.0, step - data)
    if profile.device == "cpu":  # Gloo's exchange is the cores' work too on a CPU host (TCP copies at both ends)
        # The least exposed over ranks: the last to arrive waited for no one; the others' held their waiting.
        cpu_work += min(r.seconds_per_step.comm_exposed for r in profile.per_rank)

    def modelled(workers: int) -> float:
        bound = max(rest + receive, through / workers)
        if per_slot is not None:
            bound = max(bound, (threads * cpu_work + receive + cpu_share * through) / per_slot)
        return bound

    # The probe's steps run faster or slower than the run's (its timers, the cores' state after it): each is
    # taken as its ratio to the probe's step with the run's own loader processes, times the run's step.
    own = profile.data_crowded_own_step_seconds
    scale = step / own if own else 1.0
    # 0: a count the probe had no time for (it times the most processes first).
    timed = {w: seconds for w, seconds in enumerate(profile.data_crowded_step_seconds or [], start=1) if seconds > 0}
    crowded = {w: seconds * scale for w, seconds in timed.items()}
    most, fewest = max(crowded, default=0), min(crowded, default=0)
    none = profile.data_crowded_none_step_seconds if own and current else None  # the run's step with none
    if none:
        crowded[0], timed[0] = none * scale, none

    def crowding(workers: int) -> float:
        """The timed step over the formula's: how much the cores' sharing added (at least nothing)."""
        return max(1.0, crowded[workers] / modelled(workers))

    def predicted(workers: int) -> float:
        if workers in crowded:  # timed beside the training's own work: the cores' sharing is in it
            return crowded[workers]
        if most and workers > most:  # more crowded still, as the last counts timed grew it (or as crowded)
            growth = crowding(most) - crowding(most - 1) if most > 1 and most - 1 in crowded else 0.0
            return modelled(workers) * (crowding(most) + max(0.0, growth) * (workers - most))
        if fewest and workers < fewest:  # fewer processes crowd less: none at none, as timed at the fewest
            return modelled(workers) * (1 + (crowding(fewest) - 1) * workers / fewest)
        return modelled(workers)

    limit = MAX_ADVISED_WORKERS
    if cores:  # the preflight's own limit on loader processes per slot
        from dtrain.launcher.preflight import PROCESSES_PER_CORE

        limit = max(1, min(limit, PROCESSES_PER_CORE * cores // local_slots(profile)))
    def step_with(workers: int) -> float:
        if workers == current:
            return step
        if workers == 0:  # the training process loads each batch itself: nothing hides it, nothing to hand over
            return crowded[0] if 0 in crowded else rest + load
        if current == 0 and handoff is not None:  # the handoff is new: it can make the step slower
            return predicted(workers)
        # Fewer processes than the run had can only be slower, more can only be faster.
        return predicted(workers) if workers < current else min(step, predicted(workers))

    if workers is None:
        # None at all, for a run that has them and whose in-place load was probed (small in-memory batches
        # are faster loaded than handed over); then more.
        fewer = [0] if current > 0 and handoff is not None else []
        candidates = fewer + list(range(current + 1, max(current + 1, limit) + 1))
        best = min(step_with(w) for w in candidates)
        workers = next(w for w in candidates if step_with(w) <= best * 1.03)  # fewest processes within 3%
    new_step = step_with(workers)
    where = (f"{per_slot:g} core(s) per slot, {threads} torch thread(s) each" if per_slot is not None
             else "cores per slot not recorded")
    probed = (f"{1e3 * load:.2f} ms to load a batch, {100 * cpu_share:.0f}% of it on the CPU (probed after the run)"
              if share is not None else f"{1e3 * load:.2f} ms to load a batch (CPU share not probed: assumed all)")
    if handoff is not None:
        probed += (f"; through a loader process {1e3 * handoff:.2f} ms a batch, {1e3 * receive:.2f} ms of it "
                   "the training process's to receive it")
    if workers in crowded:
        against = (f" against {1e3 * own:.2f} ms with the run's {current}, so {1e3 * crowded[workers]:.2f} ms in "
                   "the run" if own else "")
        probed += (f"; a step with {workers} loader process(es) per slot timed {1e3 * timed[workers]:.2f} ms "
                   f"beside the training's own work{against} (probed after the run)")
    elif most and workers > most:
        probed += (f"; beyond the {most} loader process(es) per slot timed beside the training's work, the cores "
                   f"crowded on as the counts timed crowded them")
    if workers == 0:
        after = "" if 0 in crowded else f"after the {1e3 * rest:.2f} ms rest of the step, "
        return LoaderPlan(0, new_step, f"{probed}; with no loader process each slot loads its batch in place, "
                          f"{after}on {where}", timed=0 in crowded)
    return LoaderPlan(workers, new_step, f"{probed}; {workers} loader process(es) per slot overlap it with the "
                      f"{1e3 * rest:.2f} ms rest of the step, on {where}",
                      timed=workers in crowded and workers != current)


def own_work(profile: ProfileRecord) -> tuple[float, float]:
    """A training process's own work per step, waiting for no one: (forward + backward, optimizer + the rest).
    Each phase is the least over ranks, and where a rank is chronically late, no more than that rank's less its
    excess over the fastest (measured step by step on raw timings). Not the rank with the least work: a rank
    that waits for a late peer can carry part of that wait in its backward, where DDP's busy time bounds the
    exposed wait (DDP times other steps than the profile's). Planted stragglers on the 2-core VM: the early
    rank's backward read 1.7-4.2 ms, the late rank's 0.4 ms (0.3 ms less its excess where it was slow in
    backward), and the same runs without a slow rank 0.2-0.6 ms."""
    phases = ("forward", "backward", "optimizer", "other")
    least = {p: min(r.seconds_per_step.of(p) for r in profile.per_rank) for p in phases}
    late = chronic_rank(profile)
    if late is not None and profile.stragglers is not None:
        own, excess = profile.per_rank[late].seconds_per_step, profile.stragglers.per_rank[late].excess_seconds
        least = {p: max(0.0, min(least[p], own.of(p) - getattr(excess, p))) for p in phases}
    return least["forward"] + least["backward"], least["optimizer"] + least["other"]


def chronic_rank(profile: ProfileRecord) -> int | None:
    """The rank measured chronically last at the exchange (``stragglers.chronic_rank``), None where none was
    (ranks that take turns are noise, not a rank to wait for) or the record does not hold it."""
    lags = profile.stragglers
    late = lags.chronic_rank if lags is not None else None
    if lags is None or late is None or late >= min(len(profile.per_rank), len(lags.per_rank)):
        return None
    return late


def loader_inputs(profile: ProfileRecord) -> tuple[float, float, float]:
    """The loader plan's inputs for the doctor and ``--try`` alike: the data wait to hide (a rank chronically
    late with its batch sets it, else the least over ranks), the step (the mean over ranks) and the training
    process's own work per step (:func:`own_work`)."""
    ranks = [r.seconds_per_step for r in profile.per_rank]
    step = sum(r.step for r in ranks) / len(ranks)
    work = [r.data + r.forward + r.backward + r.optimizer + r.other for r in ranks]
    late = straggler(profile, work)
    chronic_data = late is not None and late.chronic and late.phase == "data"
    data = ranks[late.rank].data if late is not None and chronic_data else min(r.data for r in ranks)
    return data, step, sum(own_work(profile))


def loader_priced(plan: LoaderPlan, rest: float) -> tuple[float, float]:
    """The data wait a loader plan leaves in the cost model, and the seconds of the rest of the step (``rest``,
    the run's step less its data wait) it removes. The plan's step is a whole step, timed after the run or the
    formula's, whose rest holds no waiting for a rank late with its batch: the predicted step is it. (Added to
    the run's rest, a chronic loading straggler's fix was priced 1.8x where 4 loader processes gave 4.4x: the
    others' rest held their wait for it.)"""
    return max(0.0, plan.step_seconds - rest), max(0.0, rest - plan.step_seconds)


# Optimizers whose step is normalized by a running gradient scale: a k times bigger batch lowers the
# gradient noise by sqrt(k), and the square-root rule keeps the update's noise scale (Hoffer et al. 2017,
# Malladi et al. 2022); plain SGD (with momentum) takes the linear rule (Goyal et al. 2017).
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor")


def batch_change(profile: ProfileRecord, new_gbs: int) -> BatchChange:
    """A bigger global batch in the user's terms: the learning-rate rule that keeps training equivalent
    for the run's optimizer, the config changes (``--set`` form) that apply it, and a sentence."""
    old = profile.global_batch_size
    ratio = new_gbs / old
    optimizer = profile.optimizer or ""
    adaptive = optimizer in ADAPTIVE
    rule, factor = ("square-root", ratio ** 0.5) if adaptive else ("linear", ratio)
    which = optimizer or "your optimizer"
    lr = profile.lr_hyperparameter
    sets: list[str] = []
    if lr is not None and lr.name:
        new_lr = float(lr.value) * factor
        sets.append(f"hyperparameters.{lr.name}={new_lr:.6g}")
        lr_text = f"hyperparameters.{lr.name}: {lr.value:g} -> {new_lr:.6g}"
    else:
        lr_text = f"the learning rate x {factor:.3g}"
    text = (f"global_batch_size {old} -> {new_gbs} ({ratio:g}x): with {which} use the {rule} rule, {lr_text} "
            f"({'square root for Adam-like optimizers' if adaptive else 'linear for SGD'}), and warm up: ramp the "
            f"learning rate from the old value to the new one over the first few epochs (e.g. "
            f"torch.optim.lr_scheduler.LinearLR(opt, start_factor={1 / factor:.3g}, total_iters=<steps of ~5 "
            "epochs>)) so the first big steps do not diverge")
    return BatchChange(sets, rule, factor, text)


def growth(single: float, double: float) -> float:
    """How much of the work grows with the batch: 0 (all per-step overhead) to 1 (all per-sample)."""
    if single <= 0 or double <= 0:
        return 1.0
    return min(1.0, max(0.0, double / single - 1.0))


def probe_growth(probe: BatchScaling | None) -> tuple[float, float]:
    """(work, loading) growth with the batch from the end-of-run probe; 1 (all per-sample) if not probed."""
    if probe is None:
        return 1.0, 1.0
    return growth(probe.work_seconds, probe.work_double_seconds), growth(probe.load_seconds, probe.load_double_seconds)
