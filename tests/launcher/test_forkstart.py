"""Workers forked from the launcher: when it is safe, what a forked worker looks like, and that it trains
exactly as a worker started as a new interpreter does."""

import os
import signal
import sys
import threading
import time

import pytest
import torch
from helpers import cli_in_process, final_weights, tiny_config

from dtrain.engine.trial import load_trial_class
from dtrain.launcher import forkstart


def test_fork_only_with_one_thread_per_worker_on_a_cpu_build(monkeypatch):
    monkeypatch.delenv(forkstart.START_ENV, raising=False)
    cpu_build = not torch.backends.cuda.is_built()
    assert forkstart.can_fork(1) is cpu_build
    assert forkstart.can_fork(2) is False  # GNU OpenMP's pool does not survive a fork
    monkeypatch.setenv(forkstart.START_ENV, "exec")
    assert forkstart.can_fork(1) is False


def test_a_forked_child_has_its_own_session_default_signals_and_real_streams():
    read, write = os.pipe()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with forkstart.forking():
            pid = os.fork()
        if pid == 0:  # the child: report, then leave without running pytest's teardown
            try:
                facts = [os.getsid(0) == os.getpid(),
                         signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                         signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                         sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2,
                         sys.stdout.line_buffering and sys.stderr.line_buffering,
                         sys.stdout is not sys.__stdout__]  # fresh objects, not the launcher's
                os.write(write, "".join("1" if f else "0" for f in facts).encode())
            finally:
                os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 16) == b"111111" and status == 0
    os.close(read)
    # Outside forking(), a fork (a DataLoader's worker, say) is left as it is.
    if (pid := os.fork()) == 0:
        os._exit(0 if os.getsid(0) != os.getpid() else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_a_child_forked_while_another_thread_writes_to_a_stream_can_still_print(monkeypatch, tmp_path):
    """The stream's lock may be held by the writing thread at the fork; the child must not wait for it."""
    sink = open(tmp_path / "sink", "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "__stdout__", sink)  # the launcher's stream a thread of it writes to
    monkeypatch.setattr(sys, "stdout", sink)
    writing = threading.Event()

    def write_on() -> None:
        while not writing.is_set():
            sink.write("x" * 200 + "\n")
            sink.flush()

    writer = threading.Thread(target=write_on, daemon=True)
    writer.start()
    hung = 0
    try:
        for _ in range(20):  # with the launcher's own stream object, nearly every child hung
            with forkstart.forking():
                pid = os.fork()
            if pid == 0:
                try:
                    print("started", flush=True)
                finally:
                    os._exit(0)
            deadline = time.monotonic() + 10
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    hung += 1
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
    finally:
        writing.set()
        writer.join()
        sink.close()
    assert hung == 0


def test_a_forked_child_stopped_before_its_main_leaves_its_stack(capfd):
    """The agent stops a child stuck at startup with SIGTERM: its log (fd 2) must say where it was."""
    read, write = os.pipe()
    with forkstart.forking():
        pid = os.fork()
    if pid == 0:
        try:
            def stuck_before_the_worker_main() -> None:
                os.write(write, b"1")
                time.sleep(60)

            stuck_before_the_worker_main()
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"  # the child is in the function now
    os.close(read)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM  # still stopped by the signal
    assert "in stuck_before_the_worker_main" in capfd.readouterr().err


@pytest.mark.slow
def test_forked_and_exec_started_workers_train_the_same_weights(tmp_path, reference_runs, monkeypatch):
    monkeypatch.setenv(forkstart.START_ENV, "exec")  # cli_in_process restores the environment after the run
    result = cli_in_process("run", str(tiny_config(tmp_path)), "--slots", "2", "--run-dir", str(tmp_path / "r"),
                            "--quiet")
    assert result.code == 0, result.stderr
    forked, execd = reference_runs.weights(2), final_weights(tmp_path / "r")
    assert forked.keys() == execd.keys()
    assert all(torch.equal(forked[k], execd[k]) for k in forked)


def test_a_trial_module_is_read_again_from_its_own_folder(tmp_path):
    # One process loads several trials (a test suite, --verify, forked workers): same name, other file.
    for name, value in (("one", 1), ("two", 2), ("two", 30)):  # 30: another size, whatever the clock
        folder = tmp_path / name
        folder.mkdir(exist_ok=True)
        (folder / "samename_trial.py").write_text(
            "from dtrain import PyTorchTrial\n\n"
            f"class T(PyTorchTrial):\n    version = {value}\n    def train_batch(self, *a):\n        return {{}}\n"
            "    def build_training_data(self):\n        return []\n")
        trial = load_trial_class("samename_trial:T", str(folder))
        assert trial.version == value


def test_a_forked_child_does_not_keep_the_run_directory_locked(tmp_path):
    from dtrain.launcher.runlock import lock_run_dir

    lock = lock_run_dir(tmp_path)
    read, write = os.pipe()
    if (pid := os.fork()) == 0:  # a worker that lives on
        os.write(write, b"x")
        signal.pause()
        os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"x"
        # The launcher dies (its descriptor closes, nothing unlocks): the lock must be free at once, which it
        # is only if the child closed its inherited copy at fork.
        lock.forget()
        lock_run_dir(tmp_path).release()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
