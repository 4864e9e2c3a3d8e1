"""``det.experimental``: Determined's Python SDK (``client``: experiments, trials, checkpoints and models on a
master's REST API). There is no master here: every name says so in one line when used."""

from __future__ import annotations

from dtrain.determined._notes import module_getattr

__getattr__ = module_getattr("det.experimental", {}, default=(
    "Determined's SDK drives a Determined master over its REST API, and there is none here; a dtrain run is "
    "a directory (metrics.jsonl, summary.json, checkpoints/<batches>/model.pt): read it, or use dtrain report"))
