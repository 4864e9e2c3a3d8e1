"""CPU threads per slot: one rule for ``dtrain run``, ``dtrain bench``, the doctor and the plan.

Each slot gets ``free cores // local slots`` torch threads (at least one), so N slots never ask for more
threads than the cores they share and one slot is not starved of the cores the others would have used.
*Free* cores are this process's cores minus what other processes kept busy over a short look at
``/proc/stat`` just before the launch: on a machine shared with other jobs, a 2-thread slot on 2 busy
cores waits at every parallel region for a thread that lost its time slice, and runs many times slower
than with one thread (docs/benchmarks.md, "One thread rule"). A user's
``OMP_NUM_THREADS`` (read once, when dtrain starts, before dtrain sets it for its own workers) is
respected by ``dtrain run``, with a warning when it oversubscribes the cores; ``dtrain bench`` overrides it
(and says so), because a fixed thread count per slot starves the 1-slot baseline or oversubscribes N slots,
and bench's ratios would then measure that instead of scaling.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The user's setting, before any dtrain launch in this process exported its own.
USER_THREADS = os.environ.get("OMP_NUM_THREADS")


def cores() -> int:
    """CPU cores this process may use (its affinity mask: a container's or Slurm's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (idle ticks, total ticks) from /proc/stat; empty where there is none."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields[:8]]
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))  # idle + iowait
    return out


def _processes() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, CPU ticks spent so far, user + system, /proc's clock)."""
    table = {}
    try:
        entries = [e for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return table
    for entry in entries:
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def own_tree(table: dict[int, tuple[int, int]]) -> set[int]:
    """This process and its descendants in ``table``."""
    ours, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, (parent, _) in table.items() if parent in ours} - ours
        grew, ours = bool(found), ours | found
    return ours


def _own_ticks() -> int:
    """CPU ticks spent so far by this process and its descendants: dtrain's own work, such as the fork server
    that ``dtrain run`` starts first to import torch while it prepares the launch (0 where /proc cannot tell)."""
    table = _processes()
    return sum(table[pid][1] for pid in own_tree(table) if pid in table)


def free_cores(look_seconds: float = 0.1) -> float:
    """This process's cores that *other* processes left idle over ``look_seconds`` (all of them where
    /proc/stat cannot tell). What this process and its children spend meanwhile (the fork server importing
    torch) is not another process's load: counted as busy, it gave a one-slot run on an idle 2-core machine
    one thread instead of two."""
    mine = _affinity()
    before, own_before = _cpu_times(), _own_ticks()
    time.sleep(look_seconds)
    after, own_after = _cpu_times(), _own_ticks()
    if not before or not after:
        return float(len(mine))
    free, elapsed = 0.0, []
    for cpu in mine:
        if cpu in before and cpu in after and after[cpu][1] > before[cpu][1]:
            free += (after[cpu][0] - before[cpu][0]) / (after[cpu][1] - before[cpu][1])
            elapsed.append(after[cpu][1] - before[cpu][1])
        else:
            free += 1.0
    if elapsed:  # our own ticks, in cores: the ticks over one core's ticks in the same look
        free += max(0, own_after - own_before) / (sum(elapsed) / len(elapsed))
    return min(float(len(mine)), free)


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def rule(local_slots: int, free: float | None = None) -> tuple[int, str | None]:
    """(threads per slot, why fewer than cores // slots or None): free cores shared evenly, at least one."""
    total = cores()
    even = max(1, total // max(1, local_slots))
    free = free_cores() if free is None else free
    usable = min(total, int(free + 0.5))
    threads = max(1, usable // max(1, local_slots))
    if threads < even:
        return threads, (f"{total - free:.1f} of {total} cores busy with other processes at launch: {threads} "
                         f"thread(s) per slot rather than {even}, as threads of one slot that lose their time slice "
                         "stall each other")
    return threads, None


def user_threads() -> int | None:
    """The user's ``OMP_NUM_THREADS`` when it is a positive integer, else None."""
    value = (USER_THREADS or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def for_run(local_slots: int) -> tuple[int, str | None]:
    """(threads per slot, a warning or None) for ``dtrain run``: the user's setting is respected."""
    mine = user_threads()
    if mine is None:
        return rule(local_slots)
    # One thread per slot is the floor: more slots than cores oversubscribe whatever the setting says.
    if mine > 1 and mine * local_slots > cores():
        return mine, (f"OMP_NUM_THREADS={mine} x {local_slots} slot(s) = {mine * local_slots} threads on "
                      f"{cores()} core(s): they oversubscribe the cores (unset it to let dtrain choose)")
    return mine, None


def for_bench(local_slots: int) -> tuple[int, str | None]:
    """(threads per slot, the reason when the user's setting is overridden) for ``dtrain bench``."""
    (threads, why), mine = rule(local_slots), user_threads()
    if mine is not None and mine != threads:
        return threads, (f"OMP_NUM_THREADS={mine} overridden: {local_slots} slot(s) get {threads} thread(s) each, "
                         "the same rule for every slot count, so that the 1-slot baseline is neither starved nor "
                         "the others oversubscribed" + (f"; {why}" if why else ""))
    return threads, why
