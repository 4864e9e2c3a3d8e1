"""The experiment config: its strict schema (:mod:`.schema`), bounds (:mod:`.bounds`) and bounded YAML
reader (:mod:`.safeyaml`). Torch-free: a config error costs no torch import."""
