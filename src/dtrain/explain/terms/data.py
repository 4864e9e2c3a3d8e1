"""``data``: the wait for the next batch, the mean over ranks as the run measured it (the factor table's
``data_loading`` is the same figure), plus what the probe's own load of a batch grew by at twice the batch
(loader processes hide part of it: then in proportion). On a crowded host only the share the probe spent on the
CPU slows down; the rest waited (disk, network). Another loader count is the loader plan's step (its hand-over
probed, or its steps timed after the run beside the training); a host-bound step in another precision waits at
least what it waited there."""

from __future__ import annotations

from dtrain.explain.terms import registry, shared_host
from dtrain.explain.terms.base import ASSUMED, MEASURED, PROBED, At, Input, Term, ms


@registry.register
class Data(Term):
    name = "data"
    uncertain = ("data", "loader_workers", "loader_workers_timed")

    def seconds(self, at: At) -> float:
        f, s, model, target = at.facts, at.shape, at.model, at.target
        if target.data_workers_step is not None:
            data = target.data_workers_step
        else:
            # Without the late rank, the mean over ranks' data wait less its share of it.
            gone = target.late_gone and model.late > 0  # a late rank measured: a run of two slots or more
            waited = max(0.0, f.data - min(model.late, f.late_data) / (f.slots - 1)) if gone else f.data
            data = waited + growth(at, waited)
            data *= f.data_cpu_share * s.crowd / shared_host.run_crowd(model) + 1 - f.data_cpu_share
        if target.precision_data is not None:
            data = max(data, target.precision_data)
        return data

    def inputs(self, at: At) -> list[Input]:
        f, target = at.facts, at.target
        out = [Input("data wait (mean over ranks)", ms(f.data), MEASURED),
               Input("share of a load that grows with the batch", f"{f.load_growth:.2f}",
                     PROBED if f.batch_growth_probed else ASSUMED),
               # 1 is also what an unprobed share reads as (all of it on the CPU: the crowd's worst case)
               Input("share of a load spent on the CPU", f"{f.data_cpu_share:.2f}",
                     PROBED if f.data_cpu_share < 1.0 else ASSUMED)]
        if target.data_workers_step is not None:
            out.append(Input("data wait with the loader plan's processes", ms(target.data_workers_step),
                             PROBED if target.data_workers_timed else ASSUMED))
        if target.precision_data is not None:
            out.append(Input("least data wait in the other precision", ms(target.precision_data), PROBED))
        return out


def growth(at: At, waited: float) -> float:
    """Seconds the run's data wait (``waited``) grows by (shrinks, below 1) at the target's per-slot batch. The
    probe loads alone in a tight loop, faster than the run, whose loads ran between steps (caches gone) beside the
    host's other slots. With as many local slots that slowdown stays and grows with the batch: the whole wait grows
    as the probe's load did. With fewer, an unmeasured share of it leaves with the slots: the wait grows by no more
    than the probe's load did. With loader processes only what they did not hide."""
    f, s = at.facts, at.shape
    relative = waited * f.load_growth
    if f.load_increment > 0 and s.machine_slots < f.local_slots:
        return (s.ratio - 1) * min(relative, f.load_increment)
    return (s.ratio - 1) * relative
