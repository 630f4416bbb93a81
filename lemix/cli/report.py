"""`lemix report`: regenerate the simulated figures and tables into one directory.

The flags map to a `lemix.report.suite.ReportConfig` preset (full, or
`--quick` for CI) on the engine `lemix sim`'s engine flags choose (default
v2); this module adds what the pure report must not do itself:
the clock (date and wall time on the page), finding the default trace, and
printing progress.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from lemix.cli.engine_args import add_engine_args, engine_flags, engine_knobs
from lemix.profile import default_profile_path, load_profile
from lemix.report.suite import ReportConfig, full_config, quick_config, run_report

# Where the Azure conversation trace sits next to a checkout (never shipped):
# used when present and no --trace is given.
DEFAULT_TRACE = Path("../shared/traces/azure_llm_conv_2023.csv")


def add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="regenerate every simulated figure and table (Pareto frontiers, sweeps, "
        "ablations) into DIR/index.md + PNGs",
    )
    p.add_argument("--out", default="runs/report", metavar="DIR")
    p.add_argument("--quick", action="store_true", help="2 seeds, 30 s windows, fewer points")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help=f"Azure conversation CSV for the trace section (default: {DEFAULT_TRACE} if "
        "it exists; the section is skipped with a note otherwise)",
    )
    p.add_argument("--no-trace", action="store_true", help="skip the trace section")
    add_engine_args(p)  # every run's engine (default v2; the v1 flags re-run v1 tables)
    p.add_argument("--workers", type=int, help="worker processes (default min(2, CPUs))")
    p.add_argument(
        "--loss-from",
        default="runs/bench",
        metavar="DIR",
        help="render the live loss study's results found in DIR/inference_loss*/ "
        "(`make report-loss` writes them; the report does not run it)",
    )
    p.add_argument(
        "--from-runs",
        action="store_true",
        help="simulate nothing: re-render DIR's page and plots from the runs.json files an "
        "earlier report (same preset and trace) wrote there",
    )


def resolve_trace(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(trace path or None, a note to print when the section is skipped)."""
    if args.no_trace:
        return None, "trace section skipped: --no-trace"
    if args.trace:
        if not Path(args.trace).is_file():
            raise ValueError(f"--trace {args.trace}: no such file")
        return args.trace, None
    if DEFAULT_TRACE.is_file():
        return str(DEFAULT_TRACE), None
    return None, f"trace section skipped: no --trace given and no {DEFAULT_TRACE}"


def report_config(args: argparse.Namespace, trace: str | None) -> ReportConfig:
    """The preset `args` picks, its runs on the engine the engine flags give."""
    preset = quick_config if args.quick else full_config
    config = preset(trace, args.workers)
    template = replace(config.template, **engine_knobs(args))
    return replace(config, template=template, engine_flags=engine_flags(args))


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    trace, note = resolve_trace(args)
    config = report_config(args, trace)
    notes = [note] if note else []
    if args.from_runs:
        notes.append(f"Rendered from the runs.json files already in {args.out} (no simulation).")
    if note:
        print(note)
    command = " ".join(["lemix", *map(shlex.quote, argv)])
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    start_s = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - start_s:6.0f} s] {line}", flush=True)

    result = run_report(
        config,
        load_profile(default_profile_path()),
        Path(args.out),
        command=command,
        date=date,
        notes=notes,
        progress=progress,
        runs_from=Path(args.out) if args.from_runs else None,
        loss_root=Path(args.loss_from),
    )
    elapsed_s = time.perf_counter() - start_s
    with result.index_path.open("a") as f:
        f.write(f"\n## Run\n\nWall time: {elapsed_s:.0f} s.\n")
    print(f"{len(result.png_paths)} plots, {len(result.cells)} frontier comparisons")
    print(f"report written in {elapsed_s:.0f} s: {result.index_path}")
    sys.stdout.flush()
    return 0
