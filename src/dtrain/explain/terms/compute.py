"""``compute``: forward + backward per slot at per-slot batch ``b`` and ``t`` threads, ``a_t + c_t b`` from the
end-of-run solo probe (Amdahl's ``s + p / t`` between thread counts probed), times the slots' contention for a
host's memory (measured: every rank at once over one alone), times a training step over the probe's (hooks,
autocast: measured on the run), over another precision's gain (its model steps timed at the end of the run)."""

from __future__ import annotations

from dtrain.explain.modelsources import describe_work
from dtrain.explain.terms import registry
from dtrain.explain.terms.base import ASSUMED, GIVEN, MEASURED, PROBED, At, Input, Term


@registry.register
class Compute(Term):
    name = "compute"
    uncertain = ("compute", "compute_given", "threads", "contention", "batch_extrapolation", "precision_probe",
                 "model steps' spread (precision)", "model steps' spread (batch)")

    def seconds(self, at: At) -> float:
        s, model = at.shape, at.model
        return at.facts.work.seconds(s.batch, s.threads) * s.contention * model.factor * s.crowd / s.gain

    def inputs(self, at: At) -> list[Input]:
        f, s = at.facts, at.shape
        probed = f.work.probed(s.threads)
        between = "no (probed)" if probed else "yes" if len(f.work.points) > 1 else "no: as at the threads probed"
        out = [Input("forward + backward alone by threads", describe_work(f.work),
                     GIVEN if f.batch_given else PROBED),
               Input("per-slot batch, threads", f"{s.batch:g}, {s.threads}",
                     MEASURED if (s.batch, s.threads) == (f.per_slot_batch, f.threads) else GIVEN),
               Input("threads between those probed (Amdahl)", between, PROBED if probed else ASSUMED),
               Input("training step over the probe's", f"{at.model.factor:.3f}x", MEASURED),
               Input("contention of slots on one machine", f"{s.contention:.3f}x",
                     MEASURED if f.local_slots > 1 or s.machine_slots <= 1 else ASSUMED)]
        if s.gain != 1.0:
            out.append(Input("precision's compute speed-up", f"{s.gain:.3f}x", PROBED))
        if s.crowd > 1.0:
            out.append(Input("threads over cores (shared-host set)", f"{s.crowd:.2f}x", MEASURED))
        return out

