"""The doctor's factors: one module each, registering itself (:mod:`dtrain.explain.factors.registry`)."""
