"""Imported first by the fork server (:mod:`dtrain.launcher.forkstart`), before torch.

The fork server shares the launcher's process group, so a terminal's Ctrl-C reaches it too; during its
imports (seconds) that printed a ``KeyboardInterrupt`` traceback on the node's console, though the
launcher itself stops its workers (:mod:`dtrain.launcher.supervise`). Python's fork server ignores SIGINT
only once its imports are done; this makes it ignore SIGINT from the start. Workers forked from it set
their own handlers (:func:`dtrain.launcher.forkchild.become_worker`).

It also notes which files its standard output and error are: a worker forked from it whose agent left them
as they are (rank 0 keeps the launcher's terminal) takes the launcher's current ones instead, which a host
process (a test, a notebook) may have pointed elsewhere since the server started.
"""

import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)


def identity(fd: int) -> tuple[int, int] | None:
    """The file ``fd`` is open on (device, inode), None where it is closed."""
    try:
        found = os.fstat(fd)
    except OSError:
        return None
    return found.st_dev, found.st_ino


STREAMS = {fd: identity(fd) for fd in (1, 2)}
