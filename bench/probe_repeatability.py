"""How much the link probe's points move from one probe to the next, by the statistic that reads its repeats.

    .venv/bin/python bench/probe_repeatability.py [--probes 8] [--world 2] [--json OUT]

The end-of-run link probe (``dtrain.profiling.commprobe.measure``) times each size ``REPEATS`` times, one
all-reduce after a barrier, and keeps one figure per size. Each probe here is a fresh group of ``--world``
local Gloo ranks (as a run's end or ``dtrain plan --probe`` starts them) running the probe's own loop
(``commprobe.repeat_times``) with every repeat kept; the probes run one after another. Reported per size and
statistic (median, lower quartile as the probe keeps it, least): the figure of each probe and the largest over
the smallest. A statistic whose figure moves by several times between probes moves the fitted latency and rate
with it, and every prediction they price.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtrain.profiling import commprobe

STATISTICS = {"median": statistics.median, "lower quartile (the probe's)": commprobe.lower_quartile, "least": min}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times = commprobe.repeat_times()  # the probe's own loop, every repeat kept
    if rank == 0:
        Path(out).write_text(json.dumps(dict(times)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, default=29640)
    parser.add_argument("--json", type=Path, help="every repeat of every probe")
    args = parser.parse_args()
    probes = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.probes):
            out = Path(tmp) / f"probe{i}.json"
            mp.spawn(_rank, args=(args.world, args.port + i, str(out)), nprocs=args.world)
            probes.append({int(n): t for n, t in json.loads(out.read_text()).items()})
    print(f"{args.probes} probes of {args.world} ranks, {commprobe.REPEATS} repeats a size, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name, stat in STATISTICS.items():
        print(f"\n{name}: ms per all-reduce, each probe; largest over smallest")
        for nbytes in commprobe.SIZES:
            figures = [1e3 * stat(p[nbytes]) for p in probes]
            print(f"  {nbytes // 1024:>6} KB  {' '.join(f'{f:6.2f}' for f in figures)}   "
                  f"{max(figures) / min(figures):.2f}x")
    if args.json:
        args.json.write_text(json.dumps(probes))


if __name__ == "__main__":
    main()
