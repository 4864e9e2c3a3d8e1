"""``dtrain`` command line. Bad input: one line on stderr, exit code 2, no traceback (``--debug`` shows it)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dtrain.errors import UserError
from dtrain.launcher.supervise import Stopped, terminate_as_stop  # light: no torch

if TYPE_CHECKING:
    from dtrain.launcher.runplan import RunPlan

PROG = "dtrain"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for every other bad input
        self.exit(2, f"{PROG}: error: {message}; see '{self.prog} --help'\n")


DEBUG_HELP = "show tracebacks and the agent's own logs (accepted before or after the command)"


def _add_rounds(parser: argparse.ArgumentParser, prefix: str, reference: str) -> None:
    """Rounds of paired runs (``dtrain bench``, ``doctor --verify``): how many, and until how narrow."""
    parser.add_argument("--repeats", type=_positive_int, default=3, help=f"{prefix}rounds (default 3); the median "
                        f"of per-round ratios over {reference} counts")
    parser.add_argument("--max-repeats", type=_positive_int, help=f"{prefix}keep adding rounds, up to this many, "
                        "while a ratio's range is wider than --target-spread (default: --repeats, i.e. off)")
    parser.add_argument("--target-spread", type=float, default=0.10, help=f"{prefix}narrow enough: a range of "
                        "per-round ratios, (high - low) / median, at most this (default 0.10)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Synchronous data-parallel PyTorch training on N slots.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="train an experiment config on N slots")
    run.add_argument("config", type=Path, nargs="?", help="experiment YAML (with --resume: default the run's own "
                     "resolved config, which keeps its --set and --slots)")
    run.add_argument("--slots", type=_slot_count, help="override resources.slots_per_trial")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set hyperparameters.lr=0.1 (repeatable)")
    run.add_argument("--run-dir", type=Path, help="run directory (default runs/<name>-<timestamp>)")
    run.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar or per-report lines")
    _add_node_args(run)

    bench = sub.add_parser("bench", help="measure scaling: the same trial at several slot counts")
    bench.add_argument("config", type=Path, help="experiment YAML")
    bench.add_argument("--slots", default="1,2", help="comma-separated slot counts (default 1,2)")
    bench.add_argument("--synthetic", action="store_true", help="also run with synthetic data (isolates I/O)")
    bench.add_argument("--steps", type=_step_count, default=100, help="training steps per case")
    _add_rounds(bench, "", "the same round's 1-slot run")
    bench.add_argument("--out", type=Path, help="output folder (default runs/bench-<name>-<timestamp>)")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    compare = sub.add_parser("compare", help="a trial under several sync strategies, or two runs, side by side")
    compare.add_argument("config", type=Path, nargs="+", metavar="CONFIG | RUN_A RUN_B", help="experiment YAML, "
                         "or two run directories (e.g. a script before and after an edit)")
    compare.add_argument("--strategies", help="comma-separated sync strategies (default: every registered one)")
    compare.add_argument("--steps", type=_step_count, default=100, help="training steps per strategy")
    compare.add_argument("--slots", type=_slot_count, help="override resources.slots_per_trial")
    compare.add_argument("--out", type=Path, help="output folder (default runs/compare-<name>-<timestamp>)")
    compare.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    compare.add_argument("--json", action="store_true", help="RUN_A RUN_B: the figures as JSON, B / A as speedup")
    _add_node_args(compare)

    search = sub.add_parser("search", help="hyperparameter search: each trial a dtrain run (searcher: section)")
    search.add_argument("config", type=Path, nargs="?", help="experiment YAML with ranges and a searcher section")
    search.add_argument("--slots", type=_slot_count, help="slots the search packs trials onto (default: the "
                        "machine's CPU cores, or its GPUs under NCCL)")
    search.add_argument("--out", type=Path, metavar="SEARCH_DIR", help="search directory (default "
                        "runs/search-<name>-<timestamp>)")
    search.add_argument("--resume", type=Path, metavar="SEARCH_DIR", help="continue an interrupted search")
    search.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set searcher.max_trials=8 (repeatable)")

    check = sub.add_parser("check", help="validate a config, its entrypoint and the trial's data as dtrain run "
                           "would (the trial is built in this process; no worker starts)")
    check.add_argument("config", type=Path, help="experiment YAML")
    check.add_argument("--slots", type=_slot_count, help="override resources.slots_per_trial")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, as for 'dtrain run' (repeatable)")

    doctor = sub.add_parser("doctor", help="explain a run's time cost and what to change")
    doctor.add_argument("run_dir", type=Path, help="a run directory made by 'dtrain run'")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument("--verify", action="store_true", help="measure the top recommendations and bisection "
                        "experiments as short runs beside a baseline; write RUN_DIR/tuned.yaml (with --try: measure "
                        "the tried changes instead, predicted vs measured)")
    doctor.add_argument("--steps", type=_step_count, default=60, help="steps per --verify run (default 60)")
    _add_rounds(doctor, "--verify: ", "the same round's baseline")
    doctor.add_argument("--top", type=_positive_int, default=3, help="--verify: how many recommendations to run")
    doctor.add_argument("--mttf", help="mean hours between failures of one node: advise min_checkpoint_period "
                        "(the period that minimizes the expected time to finish, Young/Daly)")
    doctor.add_argument("--price", help="with --mttf: price per slot-hour, to state the saving in money")
    doctor.add_argument("--try", dest="tries", action="append", default=[], metavar="KEY=VALUE",
                        help="predict one change, spelled as for --set (precision, hyperparameters.global_batch_size, "
                        "resources.slots_per_trial, nodes, optimizations.aggregation_frequency, "
                        "optimizations.gradient_compression, optimizations.tensor_fusion_threshold, "
                        "data_loader.num_workers; sync.strategy=ddp from an fsdp run; repeatable)")
    doctor.add_argument("--link", help="--try: the link between nodes, RATE[,LATENCY][,BURST] as for dtrain plan "
                        "(replaces the measured one for a run across hosts)")
    doctor.add_argument("--explain", action="store_true", help="print the cost model's terms (seconds at the run and, "
                        "with --try, at each change) and each input with where it came from")

    plan = sub.add_parser("plan", help="predict other slot/node counts and the doctor's options from one run")
    plan.add_argument("run_dir", type=Path, nargs="?", help="a run directory made by 'dtrain run' (or --what-if)")
    plan.add_argument("--what-if", help="plan on paper, without a run: params=330M,compute=441ms@256,gpus-per-node=8,"
                      "intra=2400gbit:2us,inter=1600gbit:5us[,global=N|batch=N][,grad-bytes=2][,overhead=MS]"
                      "[,overlap=no] (docs: dtrain.explain.paper)")
    plan.add_argument("--slots", default="1,2,4,8", help="comma-separated slot counts (default 1,2,4,8)")
    plan.add_argument("--nodes", type=_positive_int, default=1, help="also spread each slot count over N nodes")
    plan.add_argument("--link", help="link between nodes: RATE[,LATENCY][,BURST] like 200mbit, 1gbit,0.2ms or "
                      "200mbit,50us,4000b (a token-bucket shaper's burst, bytes), or measured; for a run across "
                      "hosts it replaces the link they measured")
    plan.add_argument("--probe", action="store_true", help="measure the link among local processes again (a run "
                      "with one slot measured none; saved beside the run as comm_probe.json)")
    plan.add_argument("--png", type=Path, help="chart path (default RUN_DIR/plan.png; with --json, only when given)")
    plan.add_argument("--mttf", help="mean hours between failures of one node: time to finish includes expected "
                      "failures and restarts, with the checkpoint period that minimizes it (Young/Daly)")
    plan.add_argument("--price", help="price per slot-hour (e.g. 2.50): the cost to finish each configuration")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--explain", action="store_true", help="print each row's cost-model terms (seconds at the run "
                      "and at the row) and each input with where it came from")

    report = sub.add_parser("report", help="(re)build a run's report.html and print its time table")
    report.add_argument("run_dir", type=Path, help="a run directory made by 'dtrain run'")
    report.add_argument("--quiet", action="store_true", help="print only the report's path")

    from dtrain.launcher import cluster  # light: no torch

    cluster.add_parsers(sub, _positive_int)  # dtrain k8s / dtrain slurm

    launch = sub.add_parser("launch", help="run your own training script on N slots (like torchrun)")
    launch.add_argument("--slots", type=_slot_count, required=True, help="slots of the whole job (with --nnodes: "
                        "split evenly across the nodes)")
    launch.add_argument("--max-restarts", type=int, default=0)
    launch.add_argument("--run-dir", type=Path, default=None, help="where the script's profile goes (default: a new "
                        "directory under runs/, printed); dtrain doctor and dtrain report read it")
    launch.add_argument("script", help="Python training script, unchanged (torch DDP, Lightning, Accelerate, "
                        "or one that calls dtrain.init())")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    _add_node_args(launch, "--slots", "elastic: a node that joins or leaves restarts every worker, as under "
                   "torchrun, so the script must resume from its own checkpoint")
    _global_flags_anywhere(sub)
    return parser


def _global_flags_anywhere(sub: argparse._SubParsersAction) -> None:
    """``--debug`` after the command too (``dtrain run CONFIG --debug``), on every subcommand, wherever it
    was added. SUPPRESS as default: a subcommand that does not see the flag leaves the top-level value."""
    for command in sub.choices.values():
        if not any("--debug" in action.option_strings for action in command._actions):
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def _add_node_args(parser: argparse.ArgumentParser, slots: str = "slots_per_trial", elastic: str = "elastic") -> None:
    nodes = parser.add_argument_group("several machines (run the same command on every node)")
    nodes.add_argument("--nnodes", metavar="N|MIN:MAX", help=f"number of nodes; {slots} is split across them "
                       f"(MIN:MAX: {elastic}; with --rdzv-backend c10d)")
    nodes.add_argument("--node-rank", type=int, metavar="R", help="this node's rank, 0 to N-1 (static rendezvous)")
    nodes.add_argument("--master", metavar="HOST:PORT", help="rendezvous address, hosted by node 0 (static) or the "
                       "node owning HOST (c10d)")
    nodes.add_argument("--rdzv-backend", choices=["static", "c10d"], help="static (default): node ranks given; "
                       "c10d: ranks assigned, nodes may join elastically")
    nodes.add_argument("--rdzv-id", metavar="ID", help="c10d job id, the same on every node (default dtrain-<name>)")


def _positive_int(text: str, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if most is not None and value > most:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {most:,}, got {value:,}")
    return value


def _slot_count(text: str) -> int:
    from dtrain.config.bounds import MAX_SLOTS  # the config's own bound, so flag and key agree

    return _positive_int(text, MAX_SLOTS)


def _step_count(text: str) -> int:
    from dtrain.config.bounds import MAX_STEPS

    return _positive_int(text, MAX_STEPS)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_config_path(getattr(args, "config", None))
        with terminate_as_stop():  # a SIGTERM before any worker runs: one line too, not a silent death
            return _dispatch(args)
    except UserError as exc:
        if args.debug:  # the traceback, then the same line and exit code as without --debug
            import traceback

            traceback.print_exc()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Stopped as exc:  # bench, compare, launch (run says more itself)
        if args.debug:
            raise
        print(f"{PROG}: {args.command} stopped by {exc.signal_name}", file=sys.stderr)
        return exc.exit_code


def _check_config_path(config: Path | None) -> None:
    """A folder given where the experiment YAML goes: say so (the loader would call it missing)."""
    if isinstance(config, Path) and config.is_dir():
        found = sorted(p.name for p in config.iterdir() if p.suffix in (".yaml", ".yml"))
        hint = f" (there: {', '.join(found[:4])})" if found else ""
        raise UserError(f"config {str(config)!r} is a directory; pass the experiment YAML file itself{hint}")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        return cmd_run(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "launch":
        return cmd_launch(args)
    if args.command in ("k8s", "slurm"):
        from dtrain.launcher import cluster

        return cluster.cmd_k8s(args) if args.command == "k8s" else cluster.cmd_slurm(args)
    if args.command == "doctor":
        return cmd_doctor(args)
    if args.command == "plan":
        return cmd_plan(args)
    if args.command == "search":
        return cmd_search(args)
    if args.command == "check":
        return cmd_check(args)
    if args.command == "compare":
        from dtrain.explain.compare import cmd_compare

        return cmd_compare(args)
    if args.command == "bench":
        from dtrain.explain.scaling import bench, parse_slots

        bench(args.config, parse_slots(args.slots), args.synthetic, args.steps, args.out, args.overrides, args.debug,
              args.repeats, args.max_repeats, args.target_spread)
        return 0
    raise AssertionError(args.command)  # argparse only lets known commands through


# ------------------------------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from dtrain.launcher import forkstart

    forkstart.start_early(forkstart.DTRAIN_WORKER)  # its torch imports overlap the two below
    from dtrain.launcher import resume, runs  # keeps `dtrain --help` fast: torch is imported only when needed
    from dtrain.launcher.runplan import NodeArgs

    overrides = list(args.overrides)
    if args.slots is not None:
        overrides.append(f"resources.slots_per_trial={args.slots}")
    try:
        plan = runs.prepare(args.config, overrides, run_dir=args.run_dir, resume=args.resume,
                            nodes=NodeArgs.from_args(args))
    except resume.AlreadyFinished as done:
        print(f"{PROG}: {done}")
        return 0
    try:
        return _run_planned(plan, args)
    finally:  # at once, not when the plan is collected: a process can run again (bench, --verify, the API)
        if plan.lock is not None:
            plan.lock.release()


def _run_planned(plan: RunPlan, args: argparse.Namespace) -> int:
    """Train what ``plan`` says, then print its summary or its one-line failure; the exit code."""
    from dtrain.launcher import resume, runs

    if plan.chief and not args.quiet:  # quiet: the one closing line names it
        print(f"{PROG}: run directory {plan.run_dir}", flush=True)
    start, started = time.perf_counter(), time.time()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        failure = runs.execute(plan, quiet=args.quiet, debug=args.debug)
    except Stopped as stop:
        line = resume.stop_line(plan, stop, started)
        if line is not None:
            print(line, file=sys.stderr)
            return stop.exit_code
        failure = None  # the signal came as the run was finishing: it did finish
    except SignalException as exc:
        # A signal torch's agent saw before dtrain's supervisor did (scancel signals every process of the step): a
        # stop asked for, not a crash, so one line, not torch's traceback. Checkpoints are written atomically.
        if args.debug:
            raise
        why = "interrupted" if exc.sigval == signal.SIGINT else \
            f"stopped by {exc.sigval.name} (scancel, preemption or a time limit?)"
        print(f"{PROG}: {why}; continue from the latest checkpoint with {resume.resume_command(plan)} (or dtrain "
              "slurm --resume to resubmit)", file=sys.stderr)
        return 128 + int(exc.sigval)
    if failure is not None:
        if failure.user_error:
            raise UserError(failure.message)
        if failure.clean_stop:  # every rank stopped at a checkpoint: not an error, but not finished either
            print(f"{PROG}: {failure.headline()}; {resume.resume_advice(plan)}", file=sys.stderr)
            return 1
        print(f"{PROG}: error: {failure.headline()}", file=sys.stderr)
        print(f"{PROG}: full log: {plan.run_dir / 'logs' / f'rank{failure.rank}.log'}; "
              f"{resume.resume_advice(plan)}", file=sys.stderr)
        return 1
    from dtrain.explain.summary import print_run_summary

    if plan.chief:  # one report per job, not one per node or worker
        try:  # what dtrain adds after the training must never turn a trained run into a failed one
            print_run_summary(plan.run_dir, time.perf_counter() - start, quiet=args.quiet)
        except Exception as exc:
            if args.debug:
                raise
            print(f"{PROG}: warning: summarizing the run failed ({type(exc).__name__}: {exc}); it trained and its "
                  f"files are written: 'dtrain report {plan.run_dir}' tries the page again", file=sys.stderr)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dtrain.explain.report import RUN_FILES, write_report
    from dtrain.explain.summary import print_profile

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        raise UserError(f"{str(run_dir)!r} is not a directory; pass a run directory made by 'dtrain run'")
    if not any((run_dir / name).is_file() for name in RUN_FILES):
        raise UserError(f"{str(run_dir)!r} is not a run directory (none of {', '.join(RUN_FILES)}); pass a "
                        "directory made by 'dtrain run'")
    path = write_report(run_dir)
    if not args.quiet:
        print_profile(run_dir)
    print(f"{PROG}: report {path}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    try:
        from dtrain.search.runner import run_search
    except ModuleNotFoundError as exc:
        if exc.name != "optuna":
            raise
        raise UserError("dtrain search needs Optuna; install it with: pip install 'dtrain[search]'") from None

    result = run_search(args.config, args.out, args.resume, args.slots, args.overrides)
    return 0 if result["best"] is not None else 1


def cmd_check(args: argparse.Namespace) -> int:
    """``dtrain check``: validate config, entrypoint and the trial's data as ``dtrain run`` would (the trial is
    built in this process, no worker started), print what a run would use."""
    from dtrain.config.safeyaml import dump
    from dtrain.launcher import runs

    overrides = [*args.overrides, *([f"resources.slots_per_trial={args.slots}"] if args.slots else [])]
    result = runs.check(args.config, overrides)
    print(f"# {args.config}: valid; resolved config:")
    print(dump(result.config.model_dump(mode="json")), end="")
    print(f"# per-slot batch: {result.per_slot_batch} ({result.config.global_batch_size} global over "
          f"{result.training_slots} training slot(s))")
    facts = result.trial_data
    if facts is not None:  # the trial was built in this process (see dtrain.launcher.dryrun)
        validation = (f"{facts.validation_records:,} validation records" if facts.validation_records is not None
                      else "no validation data")
        print(f"# data: {facts.training_records:,} training records, {facts.batches_per_epoch:,} global batch(es) of "
              f"{result.per_slot_batch * result.training_slots} per epoch (max_length: {facts.total_batches:,} "
              f"batches); {validation}")
    for warning in result.warnings:
        print(f"# warning: {warning}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from dtrain.explain import membership_view, scriptverify
    from dtrain.explain.doctor import diagnose, render
    from dtrain.explain.predictor import Predictor
    from dtrain.explain.summary import time_cost_table
    from dtrain.profiling.record import load_run_profile

    if args.verify and scriptverify.is_script_run(args.run_dir):  # run again with changes made from outside
        return scriptverify.cmd(args, lambda line: print(line, file=sys.stderr, flush=True))
    if args.tries and args.verify:
        from dtrain.explain.verify import render_tries, verify_tries

        result = verify_tries(args.run_dir, args.tries, args.steps, args.repeats, debug=args.debug,
                              log=lambda line: print(line, file=sys.stderr, flush=True),
                              max_repeats=args.max_repeats, target_spread=args.target_spread, link=args.link)
        print(json.dumps(result, indent=2) if args.json else render_tries(result), end="\n" if args.json else "")
        return 0
    if args.verify:
        from dtrain.explain.verify import render as render_verify
        from dtrain.explain.verify import verify

        result = verify(args.run_dir, args.steps, args.repeats, args.top, debug=args.debug,
                        log=lambda line: print(line, file=sys.stderr, flush=True), max_repeats=args.max_repeats,
                        target_spread=args.target_spread)
        print(json.dumps(result, indent=2) if args.json else render_verify(result), end="\n" if args.json else "")
        return 0
    profile = load_run_profile(args.run_dir)
    predictor = Predictor(profile)
    diagnosis = diagnose(profile, predictor)
    if args.tries:
        from dtrain.explain.trying import predict_all

        diagnosis.tries = predict_all(args.run_dir, profile, predictor, args.tries, args.link)
    if args.mttf is not None:
        from dtrain.explain.doctor import add_checkpoint_advice
        from dtrain.explain.finish import finish, run_costs
        from dtrain.explain.goodput import parse_mttf_hours, parse_price

        price = parse_price(args.price) if args.price is not None else None
        found = finish(run_costs(args.run_dir, profile), diagnosis.step_seconds, profile.slots, profile.hosts,
                       parse_mttf_hours(args.mttf), price)
        add_checkpoint_advice(diagnosis, found)
    if args.json:
        print(json.dumps(diagnosis.to_json(), indent=2))
    else:
        print(time_cost_table(profile), end="")
        print(render(diagnosis), end="")
        if args.explain:
            from dtrain.explain.trying import explain_doctor

            print(explain_doctor(predictor, diagnosis), end="")
        print(membership_view.doctor_note(args.run_dir), end="")  # an elastic run: which world the figures are
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from dtrain.explain.goodput import parse_mttf_hours, parse_price
    from dtrain.explain.plan import parse_link, plan, plot, render
    from dtrain.explain.plandoc import PlanDocument
    from dtrain.explain.scaling import parse_slots

    if args.what_if is not None:
        from dtrain.explain.paper import plan_on_paper

        if args.run_dir is not None:
            raise UserError("--what-if plans on paper: give it without a run directory")
        doc = PlanDocument.from_json(plan_on_paper(args.what_if, parse_slots(args.slots)))
        png = args.png or (None if args.json else Path("plan-what-if.png"))
    else:
        if args.run_dir is None:
            raise UserError("dtrain plan needs a run directory made by 'dtrain run' (or --what-if SPEC)")
        mttf = parse_mttf_hours(args.mttf) if args.mttf is not None else None
        price = parse_price(args.price) if args.price is not None else None
        doc = plan(args.run_dir, parse_slots(args.slots), args.nodes, parse_link(args.link), probe=args.probe,
                   mttf_hours=mttf, price=price)
        # --json is for scripts: it leaves the chart a person asked for earlier alone unless told where to draw.
        png = args.png or (None if args.json else args.run_dir / "plan.png")
    if png is not None:
        plot(doc, png)
    doc.png, doc.png_set = (str(png) if png is not None else None), True
    print(json.dumps(doc.to_json(), indent=2) if args.json else render(doc) + f"chart: {png}")
    if args.explain and not args.json:
        from dtrain.explain.plandoc import explain_plan

        print(explain_plan(doc), end="")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from dtrain.launcher import forkstart

    forkstart.start_early(forkstart.SCRIPT_WORKER)  # as cmd_run's: the workers fork from it
    from dtrain.explain.report import write_report
    from dtrain.explain.summary import print_run_summary
    from dtrain.launcher.runplan import NodeArgs
    from dtrain.launcher.scriptrun import Reporting, launch_script

    return launch_script(Path(args.script), args.args, args.slots, args.max_restarts, args.run_dir,
                         NodeArgs.from_args(args), getattr(args, "node_rank", None), args.debug,
                         Reporting(print_run_summary, write_report))


if __name__ == "__main__":
    sys.exit(main())
