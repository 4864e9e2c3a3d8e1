"""Host time the script profiler's hooks add to one step of an unmodified training loop, in one process.

    .venv/bin/python bench/script_hooks.py [--rounds 21] [--steps 2000] [--hidden 16]

One process, one thread, a world of one (no DDP: the hooks on the loader's ``__next__``, ``loss.backward()`` and
the optimizer's step are what every step pays; DDP's own timers are DDP's). The same loop (a DataLoader over
tensors in memory, a tiny MLP, SGD) runs in rounds that alternate between the hooks installed
(:func:`dtrain.profiling.script.hooks.install`) and not, so both see the same machine within seconds; each
round's figure is its mean seconds per step, and each pair gives the difference (hooked - plain) in
microseconds. The model is tiny so that the step is mostly host time: the difference is the hooks' own cost,
not something a bigger model would hide. The table gives the medians and the spread of the paired differences.
Goal (issue 72): at most 50 microseconds a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.profiling.script import hooks


def loop(loader: DataLoader, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> float:
    """Mean seconds per step of the plain loop a torchrun script runs."""
    done, start = 0, time.perf_counter()
    while done < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="pairs of rounds (hooked, plain), order alternating")
    parser.add_argument("--steps", type=int, default=2000, help="steps per round")
    parser.add_argument("--hidden", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loop(loader, model, opt, args.steps)  # warm-up, plain
    profiler = hooks.ScriptProfiler()
    plain, hooked, added = [], [], []
    for k in range(args.rounds):
        pair = {}
        for with_hooks in ((True, False) if k % 2 == 0 else (False, True)):
            if with_hooks:
                hooks.install(profiler)
            try:
                pair[with_hooks] = loop(loader, model, opt, args.steps)
            finally:
                if with_hooks:
                    hooks.uninstall()
        hooked.append(pair[True])
        plain.append(pair[False])
        added.append(1e6 * (pair[True] - pair[False]))
        print(f"  round {k}: plain {1e6 * pair[False]:.1f} us, hooked {1e6 * pair[True]:.1f} us, "
              f"added {added[-1]:+.1f} us", flush=True)
    q = statistics.quantiles(added, n=4)
    print(f"\n| step, plain (median us) | step, hooked (median us) | added per step (median of {args.rounds} pairs, "
          "us) | quartiles of the pairs (us) |")
    print("|---|---|---|---|")
    print(f"| {1e6 * statistics.median(plain):.1f} | {1e6 * statistics.median(hooked):.1f} | "
          f"{statistics.median(added):+.1f} | {q[0]:+.1f} to {q[2]:+.1f} |")


if __name__ == "__main__":
    main()
