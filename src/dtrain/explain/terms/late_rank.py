"""``late_rank``: waiting for a chronically late rank (measured by the straggler sampler): what the step held
beyond the late rank's own exchange, every step whatever the aggregation; the share of it that is the late
rank's loading grows with the per-slot batch. None on one slot, and none where the late rank leaves (fewer
slots than the run, or the straggler fixed)."""

from __future__ import annotations

from dtrain.explain.terms import registry
from dtrain.explain.terms.base import MEASURED, At, Input, Term, ms


@registry.register
class LateRank(Term):
    name = "late_rank"
    uncertain = ()

    def seconds(self, at: At) -> float:
        model, target = at.model, at.target
        if target.slots <= 1 or model.late <= 0 or target.late_gone:
            return 0.0
        loading = min(model.late, at.facts.late_data)
        return model.late - loading + loading * at.shape.ratio

    def inputs(self, at: At) -> list[Input]:
        if at.model.late <= 0:
            return []
        return [Input("others' wait for the late rank per step", ms(at.model.late), MEASURED),
                Input("of it, the late rank's loading beyond the mean", ms(at.facts.late_data), MEASURED),
                Input("the late rank leaves", "yes" if at.target.late_gone else "no", "given")]
