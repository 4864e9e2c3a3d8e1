"""How ``dtrain launch`` ends a user's script (dtrain.engine.script_main): what the script left unreachable is
freed while the interpreter is whole, so that a Gloo thread dropping a finished collective cannot abort a run
that trained during Python's teardown (pytorch#179291), and the script's own exit code is kept.

A real process: its teardown is what is tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist

    class Held:
        def __del__(self):
            print(f"freed finalizing={sys.is_finalizing()}", flush=True)

    def main():
        dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
        held = Held()
        held.cycle = held  # only the cycle collector frees it
        dist.barrier()
        dist.destroy_process_group()

    main()
    if len(sys.argv) > 2:
        sys.exit(int(sys.argv[2]))
""")


@pytest.mark.parametrize("exit_code", [None, 3])
def test_what_the_script_left_is_freed_before_teardown_and_its_exit_code_kept(tmp_path, exit_code):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [str(tmp_path / "store")] + ([] if exit_code is None else [str(exit_code)])
    env = {**os.environ, "DTRAIN_PROFILE": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "dtrain.engine.script_main", str(script), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == (exit_code or 0), proc.stderr
    assert proc.stdout.splitlines() == ["freed finalizing=False"], (proc.stdout, proc.stderr)
