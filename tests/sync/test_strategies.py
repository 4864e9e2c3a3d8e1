"""Weight-synchronization strategies: equivalence, convergence, replicas, memory, exact resume, failures."""

import json
import time

import pytest
import torch
from helpers import PROBED, ROOT, cli_in_process, final_weights, run_ranks, tiny_config, train
from torch import nn

DIGITS = ROOT / "examples" / "digits" / "experiment.yaml"
NO_PROBES = ("--set", "profiling.probes=false")  # these runs are read for their accuracy alone
SLOTS = {"ddp": 2, "allreduce": 2, "local_sgd": 2, "fsdp": 2, "parameter_server": 3}  # PS: 2 workers + 1 server




CRASH = {"max_length": {"batches": 24}, "min_checkpoint_period": {"batches": 8},
         "sync.local_sgd": {"period": 3, "warmup_steps": 2}}


class StraightRuns:
    """Each strategy's uninterrupted run of the tiny trial (24 batches), trained once per module: the
    equivalence test compares it with one slot, the crash test with its resumed twin."""

    def __init__(self, root):
        self.root = root
        self.dirs = {}

    def __call__(self, strategy):
        if strategy not in self.dirs:
            folder = self.root / strategy
            folder.mkdir()
            cfg = tiny_config(folder, **CRASH, **PROBED, **{"sync.strategy": strategy})
            train(cfg, folder / "straight", "--slots", str(SLOTS[strategy]))
            self.dirs[strategy] = folder / "straight"
        return self.dirs[strategy]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    return StraightRuns(tmp_path_factory.mktemp("straight"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "parameter_server", "fsdp"])
def test_same_weights_as_one_slot(strategy, straight_runs, reference_runs):
    # Checkpoints do not change weights: the reference is plain DDP's (here: plain training) on one slot.
    one, many = reference_runs.weights(1), final_weights(straight_runs(strategy))
    assert one.keys() == many.keys()
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=1e-5, atol=1e-6)
    summary = json.loads((straight_runs(strategy) / "summary.json").read_text())
    # How its replicas talk, for the cost model (it prices DDP's all-reduce only: dtrain.explain.exchange).
    exchange = {"allreduce": "all_reduce", "parameter_server": "server", "fsdp": "sharded"}[strategy]
    assert summary["strategy"] == strategy and summary["exchange"] == exchange
    # The end-of-run probes a change of batch or precision is priced from: a parameter server's workers probe
    # among themselves, the server waiting (they were skipped, and a bigger batch priced as all per-sample).
    profile = json.loads((straight_runs(strategy) / "profile.json").read_text())
    assert profile["batch_scaling"], strategy
    # The first rank alone, the others waiting: not where forward needs every rank (FSDP's all-gathers).
    alone = strategy != "fsdp"
    assert bool(profile.get("solo_probe")) == alone and bool(profile.get("model_steps")) == alone, strategy
    assert bool(profile.get("sharded_exchange")) == (strategy == "fsdp"), strategy
    if strategy == "fsdp":  # its collectives, timed apart from its compute (the weights above are unchanged)
        _assert_sharded_collectives_measured_and_ddp_priced(straight_runs(strategy), profile["sharded_exchange"])


def _assert_sharded_collectives_measured_and_ddp_priced(run, probe):
    from dtrain.explain.doctor import diagnose
    from dtrain.profiling.record import load_run_profile

    # The same forward and backward with the parameters held gathered: no all-gather, no reduce-scatter.
    assert 0 < probe["local_seconds"] < probe["step_seconds"], probe
    # Counted: two units (the Linear layers; the root has no parameters of its own), each all-gathered before
    # forward and before backward and reduce-scattered: 6 collectives a step, three times the float32 parameters.
    assert probe["collectives"] == 6, probe
    assert probe["collective_bytes"] == 3 * 4 * load_run_profile(run).parameters, probe
    row = next(r for r in diagnose(load_run_profile(run)).factors if r.factor == "communication")
    assert row.seconds_per_step > 0 and "the same steps with the parameters held gathered took" in row.why
    # The gathered model fit on every slot: DDP is a change to try, priced by the cost model, with its interval.
    assert (row.key, row.value) == ("sync.strategy", "ddp"), row.why
    low, high = row.predicted_interval
    assert low < row.predicted_speedup < high and row.predicted_speedup > 1, row


# The default strategy's (DDP's) crash and exact resume: tests/engine/test_checkpoint.py.
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["local_sgd", "fsdp", "parameter_server"])
def test_crash_fails_fast_and_resume_is_exact(tmp_path, strategy, straight_runs):
    cfg = tiny_config(tmp_path, **CRASH, **{"sync.strategy": strategy, "hyperparameters.die_at_batch": 11})
    start = time.monotonic()
    crashed = train(cfg, tmp_path / "crashed", "--slots", str(SLOTS[strategy]), ok=False)
    assert crashed.code == 1 and "worker rank 1 failed" in crashed.stderr, crashed.stderr
    assert time.monotonic() - start < 60  # a dead rank stops the job, no hang
    resumed = cli_in_process("run", str(cfg), "--resume", str(tmp_path / "crashed"), "--quiet", "--slots",
                         str(SLOTS[strategy]), "--set", "hyperparameters.die_at_batch=null")
    assert resumed.code == 0, resumed.stderr
    a, b = final_weights(straight_runs(strategy)), final_weights(tmp_path / "crashed")
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _accuracy(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["validation"]["accuracy"]


@pytest.mark.slow
def test_async_parameter_server_converges_within_its_staleness_bound(tmp_path):
    # Asynchrony acts like extra momentum (Mitliagkas et al., 2016): plain SGD here, as advised for async.
    train(DIGITS, tmp_path / "async", "--slots", "3", "--set", "sync.strategy=parameter_server",
         "--set", "sync.parameter_server.mode=async", "--set", "sync.parameter_server.staleness=1",
         "--set", "hyperparameters.momentum=0.0", *NO_PROBES)
    assert _accuracy(tmp_path / "async") >= 0.95
    stats = json.loads((tmp_path / "async" / "ps_stats.rank2.json").read_text())
    assert stats["mode"] == "async" and stats["staleness_bound"] == 1
    assert stats["max_clock_spread"] <= 1
    assert sum(stats["pushes_per_worker"].values()) == stats["updates"] == 2 * 660


@pytest.mark.slow
def test_local_sgd_converges(tmp_path):
    train(DIGITS, tmp_path / "local", "--set", "sync.strategy=local_sgd", *NO_PROBES)
    assert _accuracy(tmp_path / "local") >= 0.95


def _local_sgd_replicas(rank, world):
    from dtrain.config.schema import config_from_dict
    from dtrain.engine.context import TrialContext

    cfg = config_from_dict({"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
                            "max_length": {"batches": 1}, "sync": {"strategy": "local_sgd",
                                                                   "local_sgd": {"period": 3, "warmup_steps": 2}}})
    ctx = TrialContext(cfg)
    model = ctx.wrap_model(nn.Linear(4, 2))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    checked, differed = 0, 0
    for step in range(10):
        torch.manual_seed(100 * rank + step)  # different data on each rank
        ctx.backward(model(torch.randn(4, 4)).pow(2).mean())
        ctx.step_optimizer(opt)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        same = torch.equal(gathered[0], gathered[1])
        if step < 2 or ctx.strategy.averaged_last_step:
            assert same, f"replicas differ right after step {step}, a synchronous or averaging step"
            checked += 1
        differed += not same
    ctx.close()
    return checked, differed


@pytest.mark.slow
def test_local_sgd_replicas_identical_right_after_averaging():
    (checked, differed), _ = run_ranks(_local_sgd_replicas, world_size=2)
    assert checked == 2 + 3 and differed > 0  # warm-up steps 0,1; averaging at 2,5,8; local steps in between


def _fsdp_memory(rank, world):
    import dtrain
    from dtrain.sync.fsdp import FSDPStrategy, local_optimizer_numel

    ctx = dtrain.init()
    # As on a GPU machine running Gloo: torch's default mesh would follow the visible accelerator (a CPU
    # build cannot make a CUDA mesh, so this fails unless the strategy builds the run's own CPU mesh).
    torch._C._get_accelerator = lambda: torch.device("cuda")
    strategy = FSDPStrategy(ctx.device)
    model = strategy.setup_model(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)))
    assert all(p.device.type == "cpu" for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    local = FSDPStrategy.local_numel(model) + local_optimizer_numel(opt)
    ctx.close()
    return local


@pytest.mark.slow
def test_fsdp_keeps_about_one_nth_of_the_state_per_rank():
    full_params = 64 * 256 + 256 + 256 * 64 + 64
    ddp_state = full_params * 3  # parameters + Adam's two moments, whole on every DDP rank
    local = run_ranks(_fsdp_memory, world_size=2)
    for value in local:
        assert 0.45 <= value / ddp_state <= 0.55, value / ddp_state


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"sync.strategy": "gossip"}, "sync.strategy: got 'gossip'"),
    ({"sync.strategy": "parameter_server", "sync.parameter_server": {"servers": 2}}, "no worker left"),
    ({"sync.parameter_server": {"staleness": -1}}, "sync.parameter_server.staleness"),
    ({"sync.local_sgd": {"period": 0}}, "sync.local_sgd.period"),
    ({"sync.strategy": "fsdp", "optimizations.gradient_compression": "fp16"}, "cannot honour"),
    ({"sync.strategy": "allreduce", "optimizations.gradient_compression": "powersgd"}, "cannot honour"),
])
def test_bad_strategy_options(tmp_path, overrides, fragment):
    result = cli_in_process("run", str(tiny_config(tmp_path, **overrides)), "--run-dir", str(tmp_path / "r"))
    assert result.code == 2 and fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_compare_table_and_plot(tmp_path):
    import matplotlib.image

    cfg = tiny_config(tmp_path)
    out = tmp_path / "cmp"
    result = cli_in_process("compare", str(cfg), "--strategies", "ddp,fsdp", "--steps", "10", "--out", str(out))
    assert result.code == 0, result.stderr
    rows = json.loads((out / "compare.json").read_text())
    assert [r["strategy"] for r in rows] == ["ddp", "fsdp"]
    for r in rows:
        assert r["samples_per_second"] > 0 and r["final_loss"] is not None and "mse" in r["validation"]
    assert rows[1]["state_bytes_per_rank"] < rows[0]["state_bytes_per_rank"]  # FSDP shards
    assert rows[0]["comm_bytes_per_step"] > 0 and rows[1]["comm_bytes_per_step"] is None  # FSDP: not measured
    assert matplotlib.image.imread(out / "compare.png").shape[1] > 400
    bad = cli_in_process("compare", str(cfg), "--strategies", "ddp,gossip")
    assert bad.code == 2 and "'gossip' is not a strategy" in bad.stderr


def _ps_with_an_idle_server(rank, world, mode):
    import dtrain
    from dtrain.sync.options import ParameterServerOptions
    from dtrain.sync.parameter_server import ParameterServerStrategy

    ctx = dtrain.init(quiet=True)
    strategy = ParameterServerStrategy(ctx.device, ParameterServerOptions(servers=2, mode=mode))
    model = strategy.setup_model(nn.Linear(4, 1, bias=False))  # one parameter: the second server owns none
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = model.weight.detach().clone()
    x = torch.ones(2, 4)
    for _ in range(3):  # the same gradient each step: 2 * x per output
        expected -= 0.1 * 2 * x[0]
    if strategy.is_server:
        strategy.serve(opt, 3, workers_pull=True)
    else:
        for _ in range(3):
            model(x).sum().backward()
            strategy.exchange_gradients(opt)
            opt.zero_grad(set_to_none=True)
        strategy.refresh()
    owns = rank in strategy.server_ranks and strategy._owned(strategy.server_ranks.index(rank))
    result = (strategy.is_server, bool(owns), torch.equal(model.weight.detach(), expected), strategy.stats.updates)
    ctx.close()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_parameter_server_that_owns_nothing_exchanges_nothing(mode):
    worker, owner, idle = run_ranks(_ps_with_an_idle_server, world_size=3, args=(mode,))
    assert worker[2] and owner[2]  # the worker and the owning server hold the updated weight
    assert idle[:2] == (True, False) and idle[3] == 3  # the idle server kept step with every update
