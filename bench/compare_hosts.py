"""`dtrain compare` of all five strategies on digits, on one host and across 2 test hosts (root).

    .venv/bin/python bench/compare_hosts.py [--rate 200mbit] [--steps 100]

One host: 2 slots on loopback. Two hosts: network namespaces (scripts/testhosts.py), 1 slot each, each
pinned to its own core, link limited to ``--rate`` with tc tbf. A parameter server uses one of the 2
slots as its server (1 worker + 1 server). Prints both tables.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
CONFIG = ROOT / "examples" / "digits" / "experiment.yaml"
STRATEGIES = "ddp,allreduce,parameter_server,local_sgd,fsdp"


def compare_cmd(steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "dtrain.cli", "compare", str(CONFIG), "--strategies", STRATEGIES,
            "--steps", str(steps), "--slots", "2", "--out", str(out)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    from link import PORT, _run_pair
    from testhosts import TestHosts, unavailable_reason

    with tempfile.TemporaryDirectory(prefix="dtrain-compare-") as tmp:
        local = subprocess.run(compare_cmd(args.steps, Path(tmp) / "local"), cwd=ROOT, capture_output=True,
                               text=True, timeout=900, check=True)
        print("## One host, 2 slots (loopback)\n")
        print(local.stdout[local.stdout.index("dtrain compare: same"):])
        reason = unavailable_reason()
        if reason:
            print(f"two hosts skipped: {reason}")
            return 0
        with TestHosts(2, rate=args.rate, pin_cpus=True) as hosts:
            def argv(i: int) -> list[str]:
                return [*compare_cmd(args.steps, Path(tmp) / "hosts"), "--nnodes", "2", "--node-rank", str(i),
                        "--master", f"{hosts.hostname(0)}:{PORT}"]
            results = _run_pair(hosts, argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=1500)
        out = results[0].stdout
        print(f"## Two hosts x 1 slot, link {args.rate} (tbf)\n")
        print(out[out.index("dtrain compare: same"):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
