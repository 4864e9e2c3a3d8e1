"""Determined's optimizations: aggregation, compression, tensor fusion and its auto-tuning."""

import json

import pytest
import torch
from helpers import ROOT, cli_in_process, final_weights, run_ranks, tiny_config, train
from torch import nn

from dtrain.config.schema import config_from_dict
from dtrain.errors import ConfigError

DIGITS = ROOT / "examples" / "digits" / "experiment.yaml"




def train_dir(run_dir, config, *args):
    train(config, run_dir, *args)
    return run_dir


@pytest.mark.slow
def test_aggregation_equals_a_bigger_batch_and_syncs_once_per_k(tmp_path):
    cfg = tiny_config(tmp_path)
    aggregated = train_dir(tmp_path / "k4", cfg, "--set", "optimizations.aggregation_frequency=4",
                      "--set", "hyperparameters.global_batch_size=8", "--set", "max_length={batches: 24}")
    big = train_dir(tmp_path / "big", cfg, "--set", "hyperparameters.global_batch_size=32",
               "--set", "max_length={batches: 6}")
    a, b = final_weights(aggregated), final_weights(big)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    pa = json.loads((aggregated / "profile.json").read_text())
    pb = json.loads((big / "profile.json").read_text())
    assert pa["effective_batch_size"] == 32 and pa["aggregation_frequency"] == 4
    # max_length counts batches, as Determined's does: 24 batches at k = 4 are the 6 steps of the big run.
    assert json.loads((aggregated / "summary.json").read_text())["batches"] == 24
    # Per batch, one all-reduce per 4 batches (warm-up steps 3 of 24 shift it by at most one group).
    per_batch = pa["comm"]["buckets_per_step"] / pb["comm"]["buckets_per_step"]
    assert 0.2 <= per_batch <= 0.3, per_batch


def _grads_by_compression(rank, world):
    """Each rank's all-reduced gradients of the same model and data, uncompressed, fp16 and bf16: one pair of
    ranks for the three (starting ranks costs more than the three exchanges)."""
    import dtrain
    from dtrain.sync.ddp import DDPStrategy

    ctx = dtrain.init(seed=0)
    grads = {}
    for compression in ("none", "fp16", "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        ddp = DDPStrategy(ctx.device, bucket_cap_mb=25, compression=compression).setup_model(model)
        torch.manual_seed(rank + 1)
        ddp(torch.randn(16, 32)).pow(2).mean().backward()
        grads[compression] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    ctx.close()
    return grads


@pytest.fixture(scope="module")
def compressed_grads():
    return run_ranks(_grads_by_compression, world_size=2)


@pytest.mark.slow
@pytest.mark.parametrize(("compression", "tolerance"), [("fp16", 2e-3), ("bf16", 1.5e-2)])
def test_fp16_and_bf16_gradients_close_to_uncompressed(compressed_grads, compression, tolerance):
    exact = compressed_grads[0]["none"]
    assert torch.equal(exact, compressed_grads[1]["none"])
    compressed = [grads[compression] for grads in compressed_grads]
    assert torch.equal(compressed[0], compressed[1])  # replicas still agree exactly
    relative = (compressed[0] - exact).norm() / exact.norm()
    assert 0 < relative < tolerance, relative


@pytest.mark.slow
def test_powersgd_converges_like_uncompressed_with_many_buckets(tmp_path):
    # Read for accuracy and the exchange's own figures: the end-of-run probes are left off.
    plain = train_dir(tmp_path / "plain", DIGITS, "--set", "max_length={epochs: 20}", "--set", "profiling.probes=false")
    # 0.01 MB buckets: several buckets per step, the layout that deadlocks torch's own powerSGD_hook on Gloo.
    compressed = train_dir(tmp_path / "psgd", DIGITS, "--set", "max_length={epochs: 20}",
                      "--set", "optimizations.gradient_compression=powersgd",
                      "--set", "optimizations.tensor_fusion_threshold=0.01", "--set", "profiling.probes=false")
    acc = {name: json.loads((d / "summary.json").read_text())["validation"]["accuracy"]
           for name, d in (("plain", plain), ("psgd", compressed))}
    assert acc["psgd"] >= 0.95 and abs(acc["psgd"] - acc["plain"]) <= 0.01, acc
    profile = json.loads((compressed / "profile.json").read_text())
    assert profile["comm"]["buckets_per_step"] > 1
    dense = json.loads((plain / "profile.json").read_text())["comm"]["bytes_per_step"]
    assert profile["comm"]["bytes_per_step"] < dense / 4  # rank-2 factors instead of whole matrices


@pytest.mark.slow
def test_resume_with_powersgd_is_bit_identical(tmp_path):
    common = {"hyperparameters.dropout": 0.1, "max_length": {"batches": 24}, "min_checkpoint_period": {"batches": 10},
              "optimizations.gradient_compression": "powersgd", "optimizations.powersgd": {"start_iteration": 3}}
    straight = train_dir(tmp_path / "straight", tiny_config(tmp_path, **common))
    cfg = tiny_config(tmp_path, **common, **{"hyperparameters.crash_at_batch": 15})
    crashed = cli_in_process("run", str(cfg), "--run-dir", str(tmp_path / "crashed"), "--quiet")
    assert crashed.code == 1
    resumed = cli_in_process("run", str(cfg), "--resume", str(tmp_path / "crashed"), "--quiet",
                         "--set", "hyperparameters.crash_at_batch=null")
    assert resumed.code == 0, resumed.stderr
    a, b = final_weights(straight), final_weights(tmp_path / "crashed")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_fusion_auto_tune_measures_keeps_equivalence_and_is_reused(tmp_path, reference_runs):
    tuned_cfg = {"optimizations.auto_tune_tensor_fusion": True,
                 "optimizations.auto_tune_candidates_mb": [0.0001, 0.0003, 1.0],
                 "optimizations.auto_tune_warmup_steps": 1, "optimizations.auto_tune_steps_per_candidate": 3,
                 "min_checkpoint_period": {"batches": 12}}
    tuned = train_dir(tmp_path / "tuned", tiny_config(tmp_path, **tuned_cfg))
    result = json.loads((tuned / "fusion_tuning.json").read_text())
    assert [t["bucket_mb"] for t in result["trials"]] == [0.0001, 0.0003, 1.0]
    assert result["chosen_mb"] in (0.0001, 0.0003, 1.0) and result["tuning_steps"] == 12
    for name, value in reference_runs.weights(1).items():  # re-bucketing never all-reduces a gradient twice
        torch.testing.assert_close(final_weights(tuned)[name], value, rtol=1e-5, atol=1e-6)
    resumed = cli_in_process("run", str(tiny_config(tmp_path, **tuned_cfg)), "--resume", str(tuned),
                         "--set", "max_length={batches: 32}")
    assert resumed.code == 0, resumed.stderr
    assert "reusing" in (tuned / "logs" / "rank0.log").read_text()


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("aggregation_frequency", 0, "optimizations.aggregation_frequency"),
    ("gradient_compression", "zip", "optimizations.gradient_compression"),
    ("powersgd", {"rank": 0}, "optimizations.powersgd.rank"),
    ("tensor_fusion_threshold", -1, "optimizations.tensor_fusion_threshold"),
])
def test_bad_optimization_values(key, value, fragment):
    raw = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8}, "max_length": {"batches": 1},
           "optimizations": {key: value}}
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        config_from_dict(raw)


def test_bad_optimization_value_via_cli(tmp_path):
    result = cli_in_process("run", str(tiny_config(tmp_path)), "--set", "optimizations.powersgd.rank=0")
    assert result.code == 2 and "optimizations.powersgd.rank: got 0" in result.stderr
