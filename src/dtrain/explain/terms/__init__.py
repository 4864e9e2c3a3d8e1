"""The cost model's terms: a step is ``data + compute + fixed + exchange + late_rank``, one module each
(:mod:`.base` says what a term is, :mod:`.registry` finds them). :mod:`.shared_host` is the optional set of
effects only a crowded shared host shows (more threads than cores, a peer off its core, test hosts sharing one
machine's memory, a token-bucket shaper). docs/prediction.md explains the whole model."""
