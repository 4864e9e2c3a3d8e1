"""Run-wide settings and fixtures: one thread per rank; CUDA hidden from every test not marked ``gpu`` (from
pytest_configure on, so fixtures of every scope and the processes tests start see none); reference runs
that several test modules compare with are trained once."""

import fcntl
import os
import shutil
import sys
from pathlib import Path

# One torch thread per rank (the tests' rule), also for 1-slot runs and before anything imports torch: the
# launcher then forks its workers from its fork server (dtrain.launcher.forkstart), whose imports are done.
os.environ["OMP_NUM_THREADS"] = "1"
# report.html costs about a second of matplotlib per run; tests of the page turn it back on (report_page).
os.environ["DTRAIN_REPORT"] = "0"

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cuda_visibility
from helpers import PROBED, cli_in_process, final_weights, tiny_config


def pytest_configure(config: pytest.Config) -> None:
    """CUDA hidden before collection and before any fixture of any scope runs (see cuda_visibility); by
    pytest-xdist's controller only from the workers it starts."""
    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    cuda_visibility.hide(in_process=not controller)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most multi-process tests (marked ``slow``) first: `make test` hands whole files to two
    pytest processes in this order (``--no-loadscope-reorder``), and a long file started last would leave
    one process working alone at the end."""
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    weight: dict[str, tuple[int, int]] = {}
    for item in items:
        slow, count = weight.get(file_of(item), (0, 0))
        weight[file_of(item)] = (slow + (item.get_closest_marker("slow") is not None), count + 1)
    items.sort(key=lambda item: tuple(-n for n in weight[file_of(item)]))  # stable: file order kept


class ReferenceRuns:
    """The tiny trial with its default config (probed), on N slots, trained on first use and kept for the run.
    ``root`` may be shared by `make test`'s two pytest processes: a lock file per slot count lets the first to
    ask train it, and the other wait for it and read it (tests only read these runs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[int, Path] = {}

    def run_dir(self, slots: int) -> Path:
        if slots not in self._dirs:
            folder = self.root / f"slots{slots}"
            with (self.root / f"slots{slots}.lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not (folder / "trained").exists():  # none yet, or one that failed: trained afresh
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                    result = cli_in_process("run", str(tiny_config(folder, **PROBED)), "--slots", str(slots),
                                            "--run-dir", str(folder / "r"), "--quiet")
                    assert result.code == 0, result.stderr
                    (folder / "trained").touch()
            self._dirs[slots] = folder / "r"
        return self._dirs[slots]

    def weights(self, slots: int) -> dict:
        return final_weights(self.run_dir(slots))


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, worker_id):
    if worker_id == "master":  # one pytest process
        return ReferenceRuns(tmp_path_factory.mktemp("reference"))
    # pytest-xdist: the workers' temporary folders share this session's parent (xdist's advice for session data).
    shared = tmp_path_factory.getbasetemp().parent / "reference"
    shared.mkdir(exist_ok=True)
    return ReferenceRuns(shared)


@pytest.fixture
def report_page(monkeypatch):
    """Runs in this test write report.html at their end, as they do outside the test suite."""
    monkeypatch.setenv("DTRAIN_REPORT", "1")


@pytest.fixture(autouse=True)
def cuda_only_where_marked_gpu(request, monkeypatch):
    """A test marked ``gpu`` sees the machine's CUDA again (it is hidden from everything else from
    pytest_configure on: :mod:`cuda_visibility`). Fixtures of other scopes still see none."""
    if request.node.get_closest_marker("gpu") is not None:
        cuda_visibility.reveal(monkeypatch)


# Tests slower than this are named at the end of the run: each should be split or made cheaper.
SLOW_TEST_SECONDS = 30.0


@pytest.hookimpl(trylast=True)  # after pytest's own summary (--durations): the last lines of the run
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Seconds per test file (setup, call and teardown summed; with pytest-xdist, each file's own process's
    time) for the slowest files, and every test over SLOW_TEST_SECONDS: where the suite's time goes."""
    per_file: dict[str, float] = {}
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            name = report.nodeid.split("::")[0]
            per_file[name] = per_file.get(name, 0.0) + report.duration
            per_test[report.nodeid] = per_test.get(report.nodeid, 0.0) + report.duration
    if not per_file:
        return
    slowest = sorted(per_file.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", f"seconds per test file (slowest {len(slowest)} of {len(per_file)})")
    for name, seconds in slowest:
        terminalreporter.write_line(f"{seconds:7.1f}s  {name}")
    over = sorted(((s, n) for n, s in per_test.items() if s > SLOW_TEST_SECONDS), reverse=True)
    for seconds, name in over:
        terminalreporter.write_line(f"over {SLOW_TEST_SECONDS:.0f}s: {seconds:.1f}s  {name}")


@pytest.fixture
def world_of_one(tmp_path: Path):
    """A Gloo process group of this process alone (a file rendezvous in the test's folder), for the tests of
    what needs a group but not several processes."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
