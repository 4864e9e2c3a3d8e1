"""``python -m dtrain.profile [--run-dir DIR] SCRIPT [ARGS...]``: a script profiled under any launcher.

For a user who keeps ``torchrun``, ``srun`` or a cluster's job: ``torchrun --nproc-per-node 2 -m dtrain.profile
--run-dir runs/mine train.py --epochs 1`` runs ``train.py`` unchanged on every rank, as
:mod:`dtrain.engine.script_main` runs it for ``dtrain launch``, and leaves the run directory ``dtrain doctor``
reads. Scripts that start their own processes (``mp.spawn``, Fabric or a Trainer launching itself) re-run
``sys.argv`` and slip past ``-m``: ``DTRAIN_PROFILE=DIR python train.py`` reaches those through the ``.pth``
file dtrain installs (:func:`from_environment`).

This module stays free of torch and of dtrain's rooms at import: the ``.pth`` file imports it at the start of
every Python process while ``DTRAIN_PROFILE`` is set, and most of those never train.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ENV = "DTRAIN_PROFILE"  # the same name as dtrain.engine.scriptprof.ENV (checked by the tests)
USAGE = "usage: python -m dtrain.profile [--run-dir DIR] SCRIPT [ARGS...]"


def default_run_dir(script: str, environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """A run directory every rank of one job names alike: after the script and the job (torchrun's run id, else
    its master port), else the time (one process)."""
    stem = Path(script).stem or "script"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return Path("runs") / f"{stem}-{run_id}"
    if environ.get("MASTER_PORT"):
        return Path("runs") / f"{stem}-{time.strftime('%Y%m%d')}-port{environ['MASTER_PORT']}"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _parse(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    args = list(argv)
    run_dir = None
    if args and args[0].startswith("--run-dir"):
        flag = args.pop(0)
        if "=" in flag:
            run_dir = flag.split("=", 1)[1]
        elif args:
            run_dir = args.pop(0)
        if not run_dir:
            _fail("--run-dir needs a directory: --run-dir runs/mine")
    if not args or args[0].startswith("-"):
        _fail(USAGE)
    if not os.path.isfile(args[0]):
        _fail(f"script {args[0]!r} does not exist; pass the path of a Python training script")
    return run_dir, args


def _fail(message: str) -> None:
    print(f"dtrain.profile: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """Run a script as ``python SCRIPT ARGS`` would, profiled into the run directory."""
    run_dir, args = _parse(sys.argv[1:] if argv is None else argv)
    target = Path(run_dir) if run_dir is not None else default_run_dir(args[0])
    os.environ[ENV] = str(target.resolve())
    if run_dir is None and os.environ.get("RANK", "0") == "0":
        print(f"dtrain.profile: profiling into {target}", file=sys.stderr)
    from dtrain.engine import script_main

    script_main.main(args, launcher="python -m dtrain.profile")


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Starts profiling once ``import torch`` has finished (torch's own ``__init__`` imports what the hooks
    wrap); asks nothing of any other import."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _start_from_environment()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _start_from_environment() -> None:
    pending = sys.modules.get("dtrain.engine.scriptprof")
    if pending is not None and not hasattr(pending, "start"):
        return  # torch was imported by dtrain's own entry (script_main), which starts profiling itself
    try:
        from dtrain.engine import scriptprof

        scriptprof.start(Path(os.environ[ENV]))
    except Exception as exc:  # the script must run whatever profiling does
        print(f"dtrain: DTRAIN_PROFILE: profiling could not start ({type(exc).__name__}: {exc})", file=sys.stderr)


def from_environment() -> None:
    """The ``.pth`` file's call in every Python process: with ``DTRAIN_PROFILE`` set, profile this process once
    torch is imported (at once where it is already)."""
    if not os.environ.get(ENV):
        return
    if "torch" in sys.modules:
        _start_from_environment()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


if __name__ == "__main__":
    main()
