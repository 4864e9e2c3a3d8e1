"""Write pytest's cache of rewritten test modules once, before `make test` starts its two pytest processes.

pytest rewrites the asserts of every test module (and conftest.py) it imports, and keeps the result in the
module's __pycache__, but only where bytecode may be written: with PYTHONDONTWRITEBYTECODE set (as on this
machine) each pytest process rewrites them all again, about 3 s of CPU each. This writes that cache with
pytest's own functions, under pytest's own file names, checked by pytest against the source's hash as usual (a
file edited later is rewritten in memory). Those functions are pytest's internals: should they differ in
another pytest, this writes nothing and the suite runs as before.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace


def main(root: Path) -> int:
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, get_cache_dir
    except ImportError:
        return 0
    quiet = SimpleNamespace(trace=lambda *_: None)  # the AssertionState _write_pyc reports failures to
    for source in sorted(root.rglob("*.py")):
        if not (source.name.startswith("test_") or source.name == "conftest.py"):
            continue
        cache = get_cache_dir(source)
        pyc = cache / (source.name[:-3] + PYC_TAIL)
        try:
            if _read_pyc(source, pyc) is not None:  # written before, for this very source
                continue
            source_hash, code = _rewrite_test(source, None)  # type: ignore[arg-type] # no config: pytest's defaults
            cache.mkdir(exist_ok=True)
            _write_pyc(quiet, code, source_hash, pyc)  # type: ignore[arg-type]
        except Exception:  # a file pytest cannot rewrite: pytest rewrites (and reports) it itself
            continue
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests")))
