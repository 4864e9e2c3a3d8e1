"""Workers forked from the fork server: when it is safe, what a forked worker looks like, and that it trains
exactly as a worker started as a new interpreter does."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from helpers import cli_in_process, final_weights, tiny_config

from dtrain.engine.trial import load_trial_class
from dtrain.launcher import forkchild, forkstart


def test_fork_on_a_cpu_build_with_any_thread_count_unless_told_not_to(monkeypatch):
    monkeypatch.delenv(forkstart.START_ENV, raising=False)
    assert forkstart.can_fork() is not torch.backends.cuda.is_built()
    monkeypatch.setenv(forkstart.START_ENV, "exec")
    assert forkstart.can_fork() is False


def test_the_launcher_starts_the_fork_server_early_only_on_a_cpu_build(monkeypatch):
    """Early, its torch imports overlap the launcher's; judged from torch's metadata, not by importing it."""
    started: list[str] = []
    monkeypatch.setattr(forkstart, "start_server", lambda module, here: started.append(module) if here else None)
    monkeypatch.delenv(forkstart.START_ENV, raising=False)
    for version, expected in (("2.13.0+cpu", [forkstart.DTRAIN_WORKER]), ("2.13.0", []), ("2.13.0+cu128", [])):
        started.clear()
        monkeypatch.setattr(forkstart.importlib.metadata, "version", lambda _name, v=version: v)
        forkstart.start_early(forkstart.DTRAIN_WORKER)
        assert started == expected, version
    started.clear()
    monkeypatch.setenv(forkstart.START_ENV, "exec")
    monkeypatch.setattr(forkstart.importlib.metadata, "version", lambda _name: "2.13.0+cpu")
    forkstart.start_early(forkstart.DTRAIN_WORKER)
    assert started == []
    # A worker of torchrun or of srun (one task per slot) trains in place: it starts no workers, so no server.
    monkeypatch.delenv(forkstart.START_ENV)
    slurm_task = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1",
                  "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1",
                  "SLURM_NODEID": "0", "SLURM_JOB_ID": "7"}
    for launcher_env in ({"TORCHELASTIC_RUN_ID": "job"}, slurm_task):
        with monkeypatch.context() as inside:
            for name, value in launcher_env.items():
                inside.setenv(name, value)
            forkstart.start_early(forkstart.DTRAIN_WORKER)
        assert started == [], launcher_env
    forkstart.start_early(forkstart.DTRAIN_WORKER)  # and outside them, it does
    assert started == [forkstart.DTRAIN_WORKER]


def test_a_forked_copy_of_a_launcher_starts_its_own_server_and_leaves_its_parents_alone(monkeypatch):
    """A process forked from one whose fork server runs inherits its record of that server, which is not its
    child: multiprocessing's waitpid on it raised ChildProcessError (seen in the suite), and its exit handler
    would have stopped its parent's server."""
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    parents = os.getppid()  # alive, and not a child of this process
    monkeypatch.setattr(server, "_forkserver_pid", parents)
    monkeypatch.setattr(server, "_forkserver_address", "\0someone-elses")
    monkeypatch.setattr(server, "_forkserver_alive_fd", 10_000)
    monkeypatch.setattr(server, "_preload_modules", server._preload_modules)  # start_server sets these three
    monkeypatch.setattr(forkstart, "_server_env", forkstart._server_env)
    monkeypatch.setattr(forkstart.atexit, "register", lambda _f: None)
    child = subprocess.Popen(["sleep", "30"])  # checked before os.kill is replaced below
    try:
        assert forkstart._is_child(child.pid)
    finally:
        child.kill()
        child.wait()
    killed: list[int] = []
    monkeypatch.setattr(forkstart.os, "kill", lambda pid, sig: killed.append(pid))
    forkstart._stop_server()
    assert killed == []
    started: list[object] = []
    monkeypatch.setattr(server, "ensure_running", lambda: started.append(server._forkserver_pid))
    forkstart.start_server(forkstart.DTRAIN_WORKER)
    assert started == [None] and server._forkserver_address is None  # forgotten, then its own started
    assert forkstart._is_child(os.getpid()) is False and forkstart._is_child(parents) is False


def _proc(pid: int, name: str) -> str:
    return Path(f"/proc/{pid}/{name}").read_text(errors="replace")


def _sleep_in_worker() -> None:
    time.sleep(60)


def test_workers_fork_from_a_one_thread_server_and_the_supervisor_finds_them_there():
    """The suite's 4-slot resume once lost its last rank before its first line: forked from the launcher
    while the agent's store thread held the C library's resolver lock, it waited forever on its first name
    lookup. The fork server has no other thread whose locks a child could inherit."""
    import multiprocessing

    from dtrain.launcher.supervise import children, is_server

    forkstart.start_server("dtrain.engine.worker")
    with forkstart.forking():
        worker = multiprocessing.get_context("forkserver").Process(target=_sleep_in_worker, daemon=True)
        worker.start()
    try:
        server = int(_proc(worker.pid, "stat").rsplit(")", 1)[1].split()[1])  # its parent
        assert server != os.getpid()
        assert is_server(server) and forkstart.HELPER_MARKS[0] in _proc(server, "cmdline")  # spawned
        assert "Threads:\t1\n" in _proc(server, "status")
        found = children()
        assert worker.pid in found and server not in found  # the server itself is not signalled as a worker
        assert not any(forkstart.HELPER_MARKS[1] in _proc(pid, "cmdline") for pid in found)
    finally:
        worker.kill()
        worker.join()


def test_a_forked_worker_has_the_launchers_environment_its_own_session_default_signals_and_unbuffered_streams(
        monkeypatch):
    """And it leaves the fork server: Python's default start method (its DataLoader workers fork), and no hold
    on the server's "alive" pipe (held, it kept the server and the worker up after the launcher was killed)."""
    import multiprocessing
    import multiprocessing.forkserver

    read, write = os.pipe()
    alive_read, alive_write = os.pipe()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        if (pid := os.fork()) == 0:  # the child: report, then leave without running pytest's teardown
            try:
                # As a fork server's child: the server's environment, and what the agent set for this rank.
                os.environ.update({"RANK": "3", "STALE": "server's"})
                multiprocessing.set_start_method("forkserver", force=True)
                multiprocessing.forkserver._forkserver._forkserver_alive_fd = alive_write
                forkchild.become_worker({"FROM_LAUNCHER": "1", "RANK": "0"}, {"STALE": "server's", "RANK": "0"})
                facts = [os.environ.get("FROM_LAUNCHER") == "1", os.environ.get("RANK") == "3",
                         "STALE" not in os.environ,
                         os.getsid(0) == os.getpid(),
                         signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                         signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                         sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2,
                         sys.stdout.write_through and sys.stderr.write_through,  # as `python -u` opens them
                         multiprocessing.get_start_method(allow_none=True) is None,
                         multiprocessing.forkserver._forkserver._forkserver_alive_fd is None]
                os.close(alive_read)
                with contextlib.suppress(OSError):
                    os.fstat(alive_write)
                    facts.append(False)  # still open
                os.write(write, "".join("1" if f else "0" for f in facts).encode())
            finally:
                os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    os.close(write)
    os.close(alive_write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 16) == b"1" * 10 and status == 0
    os.close(read)
    os.close(alive_read)


def test_a_forked_child_stopped_before_its_main_leaves_its_stack(capfd):
    """The agent stops a child stuck at startup with SIGTERM: its log (fd 2) must say where it was."""
    read, write = os.pipe()
    if (pid := os.fork()) == 0:
        try:
            forkchild.become_worker(dict(os.environ), {})

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


def test_the_fork_server_starts_unprofiled_and_with_one_thread_libraries(monkeypatch):
    """An in-process `dtrain launch` sets DTRAIN_PROFILE before its first worker starts the server: the server
    itself must not start the script's profiling (dtrain-profile.pth) when it imports torch."""
    monkeypatch.setenv(forkstart.PROFILE_ENV, "/some/run")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with forkstart._one_thread_libraries():
        assert forkstart.PROFILE_ENV not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ[forkstart.PROFILE_ENV] == "/some/run" and os.environ["OMP_NUM_THREADS"] == "4"


class _Held:
    """An object that lives until its process exits, with a finalizer to run then."""


def test_a_forked_workers_exit_handlers_run_as_at_a_new_interpreters_exit(tmp_path, monkeypatch):
    """A script's own atexit handlers and exit-time finalizers (and the profiling session's) run when its main
    returns or exits: the fork server's child leaves by os._exit, which skips them. The finalizers it inherited
    from the server (torch's operator libraries) do not (forkchild says why)."""
    (tmp_path / "registers_at_exit.py").write_text(
        "import atexit, sys, weakref\n"
        "class Held: pass\n"
        "HELD = Held()\n"
        "def main(argv):\n"
        "    atexit.register(lambda: open(argv[0], 'w').write('ran'))\n"
        "    weakref.finalize(HELD, lambda: open(argv[0] + '.finalized', 'w').write('ran'))\n"
        "    if argv[1] == 'exit':\n"
        "        sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    inherited = tmp_path / "inherited.finalized"
    held = _Held()
    server_finalizer = weakref.finalize(held, lambda: inherited.write_text("ran"))  # made before the fork
    for how, code in (("return", 0), ("exit", 3)):
        marker = tmp_path / f"{how}.txt"
        if (pid := os.fork()) == 0:
            status = 1
            try:
                forkstart.ForkedMain(forkstart.WorkerModule("registers_at_exit", ()))(str(marker), how)
                status = 0
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else 1
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == code and marker.read_text() == "ran", how
        assert Path(f"{marker}.finalized").read_text() == "ran", how
    assert not inherited.exists()
    assert server_finalizer.detach() is not None  # still pending here: this process's own, not run by the child


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


# A launcher's first lines: it forks its fork server from itself, then a worker from that server.
FORKED_SERVER = """
import contextlib, io, multiprocessing, os, signal, sys, time
from dtrain.launcher import forkstart
from dtrain.launcher.supervise import children

held = open(sys.argv[1], "w")  # the launcher's own descriptor (its run directory's lock, say)
signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher's own handler (dtrain run's: raise Stopped)
# The launcher's Python streams replaced (contextlib's redirect, a script capturing dtrain's output): the
# server's, and so its children's, are still the process's own (torch's agent redirects a rank's by descriptor).
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    forkstart.start_early(forkstart.DTRAIN_WORKER)
server = multiprocessing.forkserver._forkserver._forkserver_pid
with forkstart.forking():
    worker = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()
    streams = multiprocessing.get_context("forkserver").Process(target=exec, args=(
        "import sys; sys.exit(10 * sys.stdout.fileno() + sys.stderr.fileno())",))
    streams.start()
    streams.join()
def proc(pid, name):
    return open(f"/proc/{pid}/{name}").read()
def signals(pid, kind):  # a mask of /proc/PID/status: caught, ignored
    return int(proc(pid, "status").split(kind + ":")[1].split()[0], 16)
parent = int(proc(worker.pid, "stat").rsplit(")", 1)[1].split()[1])
fds = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]
print(server, parent, proc(server, "comm").strip(), sys.argv[1] in fds,
      proc(server, "status").split("Threads:")[1].split()[0], worker.pid in children(), server in children(),
      proc(server, "cmdline") == proc(os.getpid(), "cmdline"), signals(server, "SigCgt") >> (signal.SIGTERM - 1) & 1,
      signals(server, "SigIgn") >> (signal.SIGINT - 1) & 1, streams.exitcode)
worker.kill()
"""


def test_a_launcher_with_one_thread_forks_its_server_from_itself_and_names_it(tmp_path):
    """The server shares the launcher's torch import (one import per launcher, not two). It is what a spawned
    server is: one thread, only its own descriptors, a helper of the launcher's, never one of its workers."""
    from helpers import python_command

    result = python_command("-c", FORKED_SERVER, str(tmp_path / "held"), timeout=120)
    assert result.code == 0, result.stderr
    (server, parent, name, holds, threads, worker_found, server_found, same_cmdline, catches_term, ignores_int,
     streams) = result.stdout.split()
    assert parent == server  # the worker is the forked server's child
    assert name == forkstart.SERVER_NAME[:15] and threads == "1"
    assert holds == "False"  # only the descriptors a spawned server has
    assert (worker_found, server_found) == ("True", "False")
    assert same_cmdline == "True"  # a fork: the launcher's command line, hence the name
    # A new server's signal handlers, not the launcher's: SIGTERM ends it, a terminal's Ctrl-C does not.
    assert (catches_term, ignores_int) == ("0", "1")
    assert streams == "12"  # a child's sys.stdout and sys.stderr: descriptors 1 and 2


# A script under dtrain launch reports what it sees: exactly what `python -m dtrain.engine.script_main` shows it.
SCRIPT_FACTS = """
import json, os, sys, time
import from_the_working_directory

facts = {"name": __name__, "argv": sys.argv[1:], "path": sys.path[:2], "cwd": os.getcwd(),
         "parent": open(f"/proc/{os.getppid()}/comm").read().strip(), "write_through": sys.stdout.write_through,
         "rank": os.environ["RANK"], "found": from_the_working_directory.FOUND}
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json"), "w") as out:
    json.dump(facts, out)
while len(os.listdir(sys.argv[1])) < 2:  # both ranks' facts written
    time.sleep(0.01)
if os.environ["RANK"] == "1":
    raise RuntimeError("planted after the facts")
time.sleep(120)  # rank 0: stopped by the agent once rank 1 failed
"""


def test_a_scripts_workers_fork_and_see_what_an_exec_started_worker_sees(tmp_path):
    """`dtrain launch` forks a script's workers from its fork server (torch imported once, in the launcher):
    __main__, sys.argv, the working directory, `python -m`'s module search path (the script's folder, then the
    working directory, where a module of the user's is found) and unbuffered streams, as an exec'd worker has;
    and a rank's failure reads as an exec'd worker's would."""
    from helpers import dtrain_cli

    scripts, work, out = tmp_path / "scripts", tmp_path / "work", tmp_path / "out"
    for folder in (scripts, work, out):
        folder.mkdir()
    (scripts / "facts.py").write_text(SCRIPT_FACTS)
    (work / "from_the_working_directory.py").write_text("FOUND = True\n")
    result = dtrain_cli("launch", "--slots", "2", "--run-dir", str(tmp_path / "run"), str(scripts / "facts.py"),
                        str(out), "two", cwd=work)
    # The failed rank named in one line; the survivor the agent stopped prints no stack (an exec'd one does not).
    assert result.code == 1 and "worker rank 1 failed: RuntimeError: planted after the facts" in result.stderr
    assert "most recent call first" not in result.stderr, result.stderr
    for rank in ("0", "1"):
        facts = json.loads((out / f"rank{rank}.json").read_text())
        assert facts["parent"] == forkstart.SERVER_NAME[:15], facts  # forked, from the launcher's own server
        assert facts["name"] == "__main__" and facts["argv"] == [str(out), "two"] and facts["rank"] == rank
        assert facts["path"] == [str(scripts), str(work)] and facts["cwd"] == str(work) and facts["found"]
        assert facts["write_through"]


def test_a_script_forks_only_where_its_slot_has_one_thread(monkeypatch):
    """numpy's BLAS pool is sized when numpy is imported: the server imported it with one thread."""
    monkeypatch.delenv(forkstart.START_ENV, raising=False)
    monkeypatch.setattr(forkstart, "start_server", lambda module: None)
    worker = forkstart.WorkerModule(forkstart.SCRIPT_WORKER, ("train.py",), path=("/here",))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert forkstart.how_to_start(worker)[0] is False
    assert forkstart.how_to_start(worker)[2] == ["-u", "-m", forkstart.SCRIPT_WORKER, "train.py"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert forkstart.how_to_start(worker)[0] is forkstart.can_fork()


def test_a_scripts_module_search_path_is_a_new_interpreters(monkeypatch, tmp_path):
    """`python -m` puts the working directory first, then PYTHONPATH and the site's paths, whatever started
    the launcher (the `dtrain` command's own folder, a test runner's folders)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "extra"))
    path = forkstart.script_worker(["train.py"]).path
    assert path is not None and path[:2] == (str(tmp_path), str(tmp_path / "extra"))
    assert str(Path(__file__).parent) not in path
