"""Weight-synchronization strategies, one module each (:mod:`dtrain.sync.ddp`, ...), behind
:class:`dtrain.sync.base.SyncStrategy`, selected by name through :mod:`dtrain.sync.registry`; their options in
:mod:`dtrain.sync.options`. Kept empty so that importing the options does not import torch."""
