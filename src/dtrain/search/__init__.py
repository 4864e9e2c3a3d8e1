"""Hyperparameter search (``dtrain search``): Determined's ``searcher`` section, with Optuna deciding.

* :mod:`dtrain.search.space`: hyperparameter ranges and the searcher settings, validated; Optuna's
  distributions, sampler and pruner for them;
* :mod:`dtrain.search.runner`: trials as real ``dtrain run`` processes packed onto the machine's slots,
  ASHA's stop/promote decisions at rung ends, resume after Ctrl-C or a crash;
* :mod:`dtrain.search.view`: the progress and final tables, ``best.yaml``, the HTML and PNG view.

Nothing here is imported by ``dtrain run``: a trial is an ordinary run with single hyperparameter values.
"""
