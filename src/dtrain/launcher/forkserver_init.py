"""Imported first by the fork server (:mod:`dtrain.launcher.forkstart`), before torch.

The fork server shares the launcher's process group, so a terminal's Ctrl-C reaches it too; during its
imports (seconds) that printed a ``KeyboardInterrupt`` traceback on the node's console, though the
launcher itself stops its workers (:mod:`dtrain.launcher.supervise`). Python's fork server ignores SIGINT
only once its imports are done; this makes it ignore SIGINT from the start. Workers forked from it set
their own handlers (:func:`dtrain.launcher.forkstart.become_worker`).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
