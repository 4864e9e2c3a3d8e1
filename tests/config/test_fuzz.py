"""Seeded fuzz of the example configs through ``dtrain check``, in-process (no workers start).

Every mutation must end in one of two ways, within a second: exit 2 with exactly one line on stderr and
no traceback, or exit 0 with a resolved config that is valid by every rule below. A hang (an alarm
after HANG_SECONDS) or any exception is a failure. Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import shutil
import signal
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT, cli_in_process, copy_trial

from dtrain import cli
from dtrain.config import safeyaml
from dtrain.config.bounds import MAX_NAME_CHARS, MAX_SEED, MAX_TIMEOUT_SECONDS
from dtrain.config.schema import config_from_dict
from dtrain.launcher import preflight

SEED = 20240611
MUTATIONS = 330
MAX_SECONDS = 1.0
HANG_SECONDS = 10.0

TINY = {"name": "tiny", "entrypoint": "tiny:TinyTrial",
        "hyperparameters": {"global_batch_size": 16, "train_size": 256, "val_size": 61},
        "resources": {"slots_per_trial": 2, "collective_timeout_seconds": 30},
        "max_length": {"batches": 24}, "scheduling_unit": 8, "seed": 3}

RETYPES: list[Any] = [True, False, "64", "abc", "", None, [], {}, [1, 2], {"a": 1}, 1.5, -1, 0, "1e3", 3]
EXTREMES: list[Any] = [2**64, 2**63, 2**63 - 1, -(2**63), 10**30, 1e308, -1e308, 1e-9, 5e-324, math.inf, -math.inf,
                       math.nan, 0, -0.0, 10_000, 10**6, 999_999_999_999, 2, 17, 4097]
WEIRD_TEXT = ["ü", "名前", "🚀🚀", "\u202eevil", "a\u200bb", "e\u0301", "Ω" * 300, "\ufeffx", "a\x00b", "\x07",
              "x\ny", "\t", "a" * 5000, "../../../x", "/abs/path", ".hidden", "a/b", "-rf", "x" * (MAX_NAME_CHARS + 1)]
STORAGE = ["../..", "a/../../b", "/proc/dtrain-x", "/dev/null/x", "x\x00y", "a" * 300, "", ".", "sub/dir",
           "{tmp}/abs-ckpt", "{tmp}/file-not-dir/x"]
SLOTS = ["0", "-1", "10000", "4097", "abc", "1e3", "2", "17", "３", "1" * 5000, "1"]
SETS = ["resources.slots_per_trial=true", "seed=.nan", "=x", "a..b=1", "seed=1e-3", "hyperparameters.lr=1e-3",
        "data_loader.num_workers=1000000", "data_loader.num_workers=3", "checkpoint_storage.path=/proc/x", "x.y.z=1",
        "a." * 20 + "b=1", "name=a\x00b", "hyperparameters.deep=" + "[" * 40 + "]" * 40, "seed=" + "9" * 5000,
        "hyperparameters.bomb=" + "[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
        "&c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]]",
        "resources.collective_timeout_seconds=.inf", "optimizations.tensor_fusion_threshold=1e308", "seed=-1",
        "max_length={batches: 0}", "resources={slots_per_trial: 2, slots_per_trial: 3}", "name=ok-name"]


@dataclass
class Outcome:
    label: str
    code: Any
    seconds: float
    stdout: str = ""
    stderr: str = ""
    base: str = ""
    touched: set[str] = field(default_factory=set)


class _Hang(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Hang()


# ------------------------------------------------------------------------------------------ mutations


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    found = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.append((*prefix, key))
            found.extend(_paths(value, (*prefix, key)))
    return found


def _set(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        nxt = tree.get(key)
        if not isinstance(nxt, dict):
            nxt = tree[key] = {}
        tree = nxt
    tree[path[-1]] = value


def _drop(tree: dict, path: tuple) -> None:
    for key in path[:-1]:
        tree = tree[key]
    del tree[path[-1]]


KNOWN = [
    ("resources", "slots_per_trial"), ("resources", "collective_timeout_seconds"),
    ("resources", "join_timeout_seconds"), ("resources", "network_interface"), ("seed",), ("scheduling_unit",),
    ("max_restarts",), ("name",), ("entrypoint",), ("max_length", "batches"), ("max_length", "epochs"),
    ("hyperparameters", "global_batch_size"), ("optimizations", "tensor_fusion_threshold"),
    ("optimizations", "aggregation_frequency"), ("optimizations", "auto_tune_candidates_mb"),
    ("optimizations", "powersgd", "rank"), ("data_loader", "num_workers"), ("data_loader", "synthetic"),
    ("profiling", "warmup_steps"), ("sync", "local_sgd", "period"), ("sync", "parameter_server", "servers"),
    ("sync", "strategy"), ("checkpoint_storage", "path"), ("checkpoint_storage", "save_trial_latest"),
    ("min_checkpoint_period",), ("backend",), ("code_dir",),
]


def _tree_op(rng: random.Random, tree: dict, tmp: Path, touched: set[str]) -> str:
    op = rng.choice(["drop", "retype", "extreme", "text", "storage", "unknown", "nest"])
    path = rng.choice(_paths(tree)) if op == "drop" else rng.choice(KNOWN + _paths(tree))
    touched.add(".".join(map(str, path)))
    if op == "drop":
        _drop(tree, path)
    elif op == "retype":
        _set(tree, path, rng.choice(RETYPES))
    elif op == "extreme":
        _set(tree, path, rng.choice(EXTREMES))
    elif op == "text":
        _set(tree, path, rng.choice(WEIRD_TEXT))
    elif op == "storage":
        _set(tree, ("checkpoint_storage", "path"), rng.choice(STORAGE).format(tmp=tmp))
        touched.add("checkpoint_storage.path")
    elif op == "unknown":
        _set(tree, (*path[:-1], rng.choice(["slots", "resourcs", "ünï", "a\x00", "1", "global_batch_size"])), 1)
    else:
        depth = rng.choice([3, 31, 40, 150])  # deeper ones: _text_op
        value: Any = 1
        for _ in range(depth):
            value = [value] if rng.random() < 0.5 else {"k": value}
        _set(tree, ("hyperparameters", "nested"), value)
        touched.add("hyperparameters.nested")
    return op


def _text_op(rng: random.Random, text: str) -> tuple[str, str]:
    op = rng.choice(["deep", "bomb", "recursive", "merge", "duplicate", "truncate", "garbage", "tabs", "control",
                     "documents", "anchors-ok"])
    if op == "deep":
        n = rng.choice([20, 33, 1000, 20_000])
        inner = ("[" * n + "]" * n) if rng.random() < 0.5 else ("{a: " * n + "1" + "}" * n)
        return op, text + f"deep_hp: {inner}\n"
    if op == "bomb":
        levels = rng.randint(3, 9)
        lines = ['  l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
        lines += [f"  l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
        return op, text.replace("hyperparameters:\n", "hyperparameters:\n" + "\n".join(lines) + "\n", 1)
    if op == "recursive":
        return op, text.replace("hyperparameters:\n", "hyperparameters:\n  loop: &loop [1, *loop]\n", 1)
    if op == "merge":
        return op, text + "defaults: &d {seed: 4}\n"
    if op == "duplicate":
        lines = text.splitlines()
        top = [ln for ln in lines if ln and not ln.startswith((" ", "-"))]
        nested = [ln for ln in lines if ln.startswith("  ") and ":" in ln]
        pick = rng.choice(nested or top) if rng.random() < 0.5 else rng.choice(top)
        return op, text + ("hyperparameters:\n" + pick + "\n" if pick.startswith(" ") else pick + "\n")
    if op == "truncate":
        return op, text[: rng.randint(0, len(text))]
    if op == "garbage":
        at = rng.randint(0, len(text))
        junk = rng.choice(["{", "]", ": :", "&", "*x", "!!python/object:os.system", "%", "'"])
        return op, text[:at] + junk + text[at:]
    if op == "tabs":
        return op, text.replace("  ", "\t", 1)
    if op == "control":
        at = rng.randint(0, len(text))
        return op, text[:at] + rng.choice(["\x00", "\x1b", "\x7f", "\u2028", "\ufeff"]) + text[at:]
    if op == "documents":
        return op, text + "---\nname: second\n"
    return op, text.replace("hyperparameters:\n", "hyperparameters:\n  shared: &s [1, 2]\n  again: *s\n", 1)


def mutations(tmp: Path, bases: dict[str, dict]) -> list[tuple[str, str, bytes, list[str], set[str]]]:
    """(label, base, file content, extra argv, touched keys) for every seeded mutation."""
    rng = random.Random(SEED)
    out = []
    for i in range(MUTATIONS):
        base = rng.choice(sorted(bases))
        tree = yaml.safe_load(yaml.safe_dump(bases[base]))
        touched: set[str] = set()
        ops = [_tree_op(rng, tree, tmp, touched) for _ in range(rng.randint(0, 3))]
        text = yaml.safe_dump(tree, sort_keys=False, allow_unicode=rng.random() < 0.5)
        if rng.random() < 0.35:
            op, text = _text_op(rng, text)
            ops.append(op)
            touched.add(op)
        data = text.encode("utf-8")
        roll = rng.random()
        if roll < 0.03:
            ops.append("huge")
            data = data + b"# padding\n" * (2_000_000 if rng.random() < 0.5 else 30_000)
        elif roll < 0.06:
            ops.append("not-utf8")
            data = data[:10] + bytes([rng.choice([0xff, 0xc3, 0x80, 0xfe])]) + data[10:]
        argv: list[str] = []
        if rng.random() < 0.25:
            argv += ["--slots", rng.choice(SLOTS)]
            ops.append("--slots")
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            item = rng.choice(SETS)
            argv += ["--set", item]
            ops.append("--set")
            touched.add(item.partition("=")[0])
        out.append((f"#{i} {base}: {'+'.join(ops) or 'unchanged'}", base, data, argv, touched))
    return out


# ------------------------------------------------------------------------------------------- running


def check_in_process(path: Path, argv: list[str]) -> tuple[Any, float, str, str]:
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code: Any = cli.main(["check", str(path), *argv])
            except SystemExit as exc:  # argparse errors
                code = exc.code
    except _Hang:
        code = "hang"
    except BaseException:
        code = "exception"
        err.write(traceback.format_exc())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return code, time.perf_counter() - start, out.getvalue(), err.getvalue()


def _walk_numbers(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _walk_numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _walk_numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def assert_valid(resolved_text: str) -> None:
    """An accepted config must be valid by every rule, re-checked from the printed resolution."""
    raw = safeyaml.load_text("\n".join(ln for ln in resolved_text.splitlines() if not ln.startswith("#")), "out")
    config = config_from_dict(raw)  # re-validates: the printed config reads back as the same config
    assert config.model_dump(mode="json") == raw
    assert all(math.isfinite(n) for n in _walk_numbers(raw))
    assert 0 <= config.seed <= MAX_SEED
    for seconds in (config.resources.collective_timeout_seconds, config.resources.join_timeout_seconds):
        assert 1 <= seconds <= MAX_TIMEOUT_SECONDS
    assert 1 <= len(config.name) <= MAX_NAME_CHARS and "/" not in config.name and "\x00" not in config.name
    storage = Path(config.checkpoint_storage.path)
    assert storage.is_absolute() or ".." not in storage.parts
    assert "\x00" not in config.checkpoint_storage.path
    slots = config.resources.slots_per_trial
    limit = preflight.PROCESSES_PER_CORE * preflight.cores()
    assert slots <= limit and config.data_loader.num_workers * slots <= limit
    gbs = config.hyperparameters["global_batch_size"]
    assert isinstance(gbs, int) and not isinstance(gbs, bool) and gbs >= slots


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Outcome]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    shutil.copy(ROOT / "examples" / "digits" / "model_def.py", tmp / "model_def.py")
    copy_trial(tmp)
    (tmp / "file-not-dir").write_text("a file")
    bases = {"digits": yaml.safe_load((ROOT / "examples" / "digits" / "experiment.yaml").read_text()), "tiny": TINY}
    for name, cfg in bases.items():  # warm-up: first imports of the trial modules are not the validator's time
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        code, _, _, err = check_in_process(tmp / f"{name}.yaml", [])
        assert code == 0, err
    outcomes = []
    for i, (label, base, data, argv, touched) in enumerate(mutations(tmp, bases)):
        path = tmp / f"m{i:03d}.yaml"
        path.write_bytes(data)
        code, seconds, out, err = check_in_process(path, argv)
        path.unlink()
        outcomes.append(Outcome(label, code, seconds, out, err, base, touched))
    return tmp, outcomes


def test_every_mutation_is_refused_in_one_line_or_accepted_valid(corpus: tuple[Path, list[Outcome]]) -> None:
    _, outcomes = corpus
    assert len(outcomes) >= 300
    problems = []
    for o in outcomes:
        if o.code == 2:
            lines = o.stderr.splitlines()
            if not (len(lines) == 1 and o.stderr.endswith("\n") and lines[0].startswith("dtrain: error: ")
                    and "Traceback" not in o.stderr and not o.stdout):
                problems.append(f"{o.label}: not one clean line: {o.stderr[:300]!r}")
        elif o.code == 0:
            try:
                assert_valid(o.stdout)
            except Exception as exc:  # reported with the mutation's label
                problems.append(f"{o.label}: accepted but invalid: {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{o.label}: {o.code}: {o.stderr[-800:]}")
        if o.seconds > MAX_SECONDS:
            problems.append(f"{o.label}: took {o.seconds:.2f}s (limit {MAX_SECONDS}s)")
    counts = Counter("exit 2" if o.code == 2 else "accepted" if o.code == 0 else str(o.code) for o in outcomes)
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(f"\nfuzz: {len(outcomes)} mutations (seed {SEED}): {dict(counts)}; tracebacks "
          f"{sum('Traceback' in o.stderr for o in outcomes)}; hangs {counts.get('hang', 0)}; "
          f"slowest {slowest.seconds * 1000:.0f} ms ({slowest.label}); total "
          f"{sum(o.seconds for o in outcomes):.1f}s")
    assert not problems, "\n".join(problems[:20])
    assert counts["exit 2"] > 100 and counts["accepted"] > 30  # the fuzz exercises both sides


@pytest.mark.slow
def test_accepted_mutations_really_run(corpus: tuple[Path, list[Outcome]], tmp_path: Path) -> None:
    """A sample of accepted mutations of the tiny config trains for real (2 slots, a few batches). Mutations
    of free-form hyperparameters are left out: what the trial does with them is the trial's business."""
    tmp, outcomes = corpus
    runnable = [o for o in outcomes if o.code == 0 and o.base == "tiny" and o.touched
                and not any(t.startswith("hyperparameters") and t != "hyperparameters.global_batch_size"
                            for t in o.touched)]
    sample = runnable[:2]
    assert len(sample) == 2, [o.label for o in outcomes if o.code == 0]
    print(f"\nrunning accepted mutations: {[o.label for o in sample]}")
    for i, o in enumerate(sample):
        raw = safeyaml.load_text("\n".join(ln for ln in o.stdout.splitlines() if not ln.startswith("#")), "out")
        raw["resources"]["slots_per_trial"] = 2
        raw["max_length"] = {"batches": 4}
        raw["checkpoint_storage"]["path"] = "checkpoints"  # not a folder shared by both runs
        (tmp / f"run{i}.yaml").write_text(safeyaml.dump(raw))
        # The launcher in this process (helpers.cli_in_process: real workers, forked from the fork server that
        # lives on), not a new interpreter per run that imports torch twice again; a hang is still bounded
        # (the run's collective timeout and watchdog, then pytest-timeout).
        result = cli_in_process("run", str(tmp / f"run{i}.yaml"), "--quiet", "--run-dir", str(tmp_path / f"r{i}"),
                                cwd=tmp)
        assert result.code == 0, f"{o.label}: {result.stderr[-2000:]}"


# ------------------------------------------------------------------- the issue's findings, one by one

BOMB = "".join(f"  l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))
ISSUE_CASES = [
    ("name: " + "a" * 5000 + "\n", [], "name: must be 1 to 100 letters"),
    ('name: "a\\0b"\n', [], "name: must be 1 to 100 letters"),
    ("hyperparameters:\n  deep: " + "[" * 5000 + "]" * 5000 + "\n", [], "nested more than 32 deep"),
    ("hyperparameters:\n  deep: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", [], "nested more than 32 deep"),
    ("hyperparameters:\n  l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB, [],
     "more than 10,000 values (aliases expanded)"),
    ("resources:\n  collective_timeout_seconds: .inf\n", [], "expected a finite number"),
    ("resources:\n  collective_timeout_seconds: 1.0e+308\n", [], "less than or equal to 604800"),
    ("resources:\n  collective_timeout_seconds: 1e-9\n", [], "greater than or equal to 1"),
    (f"seed: {2**64}\n", [], "seed: got 18446744073709551616 (int); expected a value less than or equal to"),
    ("optimizations:\n  tensor_fusion_threshold: .inf\n", [], "expected a finite number"),
    ("checkpoint_storage:\n  path: /proc/dtrain-test\n", [], "is not writable"),
    ('checkpoint_storage:\n  path: "ck\\0pt"\n', [], "holds control characters"),
    ("name: ../../../x\n", [], "name: must be 1 to 100 letters"),
    ("checkpoint_storage:\n  path: ../../..\n", [], "leaves the run directory"),
    ("scheduling_unit: true\n", [], "scheduling_unit: got True (bool); expected a valid integer"),
    ('scheduling_unit: "64"\n', [], "scheduling_unit: got '64' (str); expected a valid integer"),
    ("seed: 1\nseed: 2\n", [], "duplicate key 'seed'"),
    ("", ["--slots", "10000"], "argument --slots: expected a positive integer up to 4,096, got 10,000"),
    ("data_loader:\n  num_workers: 1000000\n", [], "less than or equal to 256"),
    ("data_loader:\n  num_workers: 200\n", [], "loader processes on"),
    ("", ["--set", "resources.slots_per_trial=true"], "got True (bool)"),
]


@pytest.fixture(scope="module")
def imported() -> None:
    """torch and the trial are imported once per process, by whatever runs first: not the validator's time."""
    import dtrain.launcher.runs  # noqa: F401


@pytest.mark.usefixtures("imported")
@pytest.mark.parametrize(("extra", "argv", "fragment"), ISSUE_CASES)
def test_issue_findings_fail_fast_in_one_line(tmp_path: Path, extra: str, argv: list[str], fragment: str) -> None:
    copy_trial(tmp_path)
    base = {k: v for k, v in TINY.items() if f"\n{k}:" not in "\n" + extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base) + extra)
    code, seconds, out, err = check_in_process(path, argv)
    assert code == 2 and err.count("\n") == 1 and fragment in err and not out, err[-2000:]
    assert seconds < MAX_SECONDS


@pytest.mark.usefixtures("imported")
def test_huge_file_fails_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as f:
        f.truncate(20 * 1024 * 1024)  # sparse: 20 MB of NULs, never read
    code, seconds, _, err = check_in_process(path, [])
    assert code == 2 and "20,971,520 bytes; a config file may be at most 262,144 bytes" in err
    assert seconds < 0.2


def test_check_prints_resolved_config_batch_and_warnings(tmp_path: Path) -> None:
    copy_trial(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(TINY) + "optimizations:\n  tensor_fusion_threshold: 1e1\n")
    code, _, out, err = check_in_process(path, ["--slots", "3", "--set", "hyperparameters.lr=1e-3"])
    assert code == 0 and not err, err
    assert "per-slot batch: 5 (16 global over 3 training slot(s))" in out
    assert "# warning: global_batch_size 16 is not divisible by 3 slots" in out
    raw = safeyaml.load_text(out, "out")
    assert raw["resources"]["slots_per_trial"] == 3 and raw["hyperparameters"]["lr"] == 0.001
    assert raw["optimizations"]["tensor_fusion_threshold"] == 10.0
    assert not list(tmp_path.glob("runs*")) and not (ROOT / "runs" / "tiny").exists()  # nothing created


# ------------------------------------------------------------------- Determined experiment configs

DETERMINED = ROOT / "tests" / "config" / "determined_yaml" / "const.yaml"
DET_PATHS = [("searcher", "max_length", "records"), ("min_validation_period", "records"), ("searcher", "time_metric"),
             ("searcher", "max_time"), ("searcher", "name"), ("searcher", "divisor"), ("searcher", "mode"),
             ("searcher", "bracket_rungs"), ("searcher", "source_trial_id"), ("reproducibility", "experiment_seed"),
             ("reproducibility",), ("entrypoint",), ("optimizations", "mixed_precision"), ("data",),
             ("optimizations", "gradient_compression"), ("resources", "slots_per_trial"), ("environment",),
             ("checkpoint_storage", "type"), ("checkpoint_storage", "save_trial_latest"), ("searcher",),
             ("hyperparameters", "n_classes"), ("hyperparameters", "global_batch_size"), ("records_per_epoch",)]
DET_VALUES: list[Any] = [*RETYPES, *EXTREMES, "O1", "O2", "batches", "records", "async_halving", "pbt", "standard",
                         [100] * 70, {"type": "const", "val": 2}, {"records": 0}, {"epochs": 0}, ["python3", "x.py"],
                         "python3 -m determined.launch.torch_distributed --trial model_def:MNistTrial", "s3", 2.5]


def test_determined_keys_never_give_a_traceback(tmp_path: Path) -> None:
    """Seeded mutations of a Determined config's own keys through dtrain check: one line, or valid."""
    copy_trial(tmp_path)
    (tmp_path / "model_def.py").write_text("from tiny import TinyTrial as MNistTrial  # noqa: F401\n")
    base = safeyaml.load_text(DETERMINED.read_text(), "const.yaml")
    shutil.copy(DETERMINED, tmp_path / "const.yaml")  # warm-up: the trial's first import is not the validator's
    assert check_in_process(tmp_path / "const.yaml", [])[0] == 0
    rng, problems, codes = random.Random(SEED), [], Counter()
    for i in range(120):
        tree = yaml.safe_load(yaml.safe_dump(base))
        ops = []
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(DET_PATHS)
            if rng.random() < 0.2 and path[0] in tree:
                tree.pop(path[0])
            else:
                _set(tree, path, rng.choice(DET_VALUES))
            ops.append(".".join(path))
        path = tmp_path / f"d{i:03d}.yaml"
        path.write_text(yaml.safe_dump(tree, allow_unicode=True))
        code, seconds, out, err = check_in_process(path, [])
        codes[code] += 1
        label = f"#{i} {'+'.join(ops)}"
        if code == 2 and not (err.count("\n") == 1 and err.startswith("dtrain: error: ") and not out):
            problems.append(f"{label}: not one clean line: {err[:300]!r}")
        elif code == 0:
            try:
                assert_valid(out)
            except Exception as exc:  # reported with the mutation's label
                problems.append(f"{label}: accepted but invalid: {type(exc).__name__}: {exc}")
        elif code != 2:
            problems.append(f"{label}: {code}: {err[-800:]}")
        if seconds > MAX_SECONDS:
            problems.append(f"{label}: took {seconds:.2f}s")
    assert not problems, "\n".join(problems[:20])
    assert codes[2] > 20 and codes[0] > 10, codes
