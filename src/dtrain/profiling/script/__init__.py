"""A user's own training script profiled from outside, unchanged: the hooks that find its steps
(:mod:`.hooks`) and its ranks' figures turned into the run's ``profile.json`` and ``summary.json``
(:mod:`.merge`). The session around them (when to start, where to write, the end of the run) is
:mod:`dtrain.engine.scriptprof`'s."""
