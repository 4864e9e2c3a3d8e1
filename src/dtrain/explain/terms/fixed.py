"""``fixed``: the per-step work that is neither loading nor forward and backward (optimizer, bookkeeping), as
measured; on a CPU scaled by the probe's optimizer steps (alone at each thread count, and on every rank at once:
an optimizer streams memory, so threads and neighbours change it otherwise than matmuls), without that probe by
the model steps' contention. A sharded (FSDP) run's slots each step their shard of the parameters."""

from __future__ import annotations

from dtrain.explain.terms import registry, shared_host
from dtrain.explain.terms.base import ASSUMED, MEASURED, PROBED, At, Input, Term, ms


@registry.register
class Fixed(Term):
    name = "fixed"

    def seconds(self, at: At) -> float:
        f, s, target = at.facts, at.shape, at.target
        scale = _scale(at)
        per_core = s.crowd / shared_host.run_crowd(at.model)
        fixed = f.fixed * per_core * scale
        if f.sharded is not None:
            fixed += f.sharded.optimizer * per_core * scale * (f.slots / target.slots - 1)
        return fixed

    def inputs(self, at: At) -> list[Input]:
        f = at.facts
        # On a GPU the host's work stays as measured; on a CPU the optimizer probe scales it, else the model
        # steps' contention stands in for it.
        probed = f.optimizer_scale(at.shape.threads, at.shape.machine_slots) is not None
        source = MEASURED if f.device != "cpu" else PROBED if probed else ASSUMED
        return [Input("optimizer + other per step", ms(f.fixed), MEASURED),
                Input("its scale at the target's threads and neighbours", f"{_scale(at):.3f}x", source)]


def _scale(at: At) -> float:
    f, s = at.facts, at.shape
    scale = f.optimizer_scale(s.threads, s.machine_slots) if f.device == "cpu" else 1.0
    return scale if scale is not None else s.contention / at.model.contention_at(f.local_slots)
