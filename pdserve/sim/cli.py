"""`pdserve-sim`: simulate a loadgen experiment spec on a described cluster.

    pdserve-sim experiment SPEC --cluster CLUSTER.yaml [--output-dir DIR] [--replay REAL_DIR]
                           [--policy NAME ...] [--dry-run] [--no-progress]
                           [--hardware NAME] [--strict-profile]

A profile older than the engine or from other hardware than the cluster's (pdserve/sim/profile_check.py)
is a warning on stderr naming the command that measures a new one; with --strict-profile it is
an error (exit 2).

Writes what `pdserve-loadgen experiment SPEC` writes (records, summary.csv, plots, report.md)
for a simulated cluster. Exit codes: 0 success; 2 bad input (a flag, a spec, a cluster,
profile, topology or trace file), one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.loadgen.errors import LoadgenError

PROG = "pdserve-sim"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Discrete-event simulation of a pdserve cluster.")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    exp = sub.add_parser("experiment", help="simulate a loadgen experiment spec (YAML)")
    exp.add_argument("spec", help="experiment spec, e.g. experiments/headline.yaml")
    exp.add_argument("--cluster", required=True,
                     help="cluster file (workers, topology, profile; pdserve/sim/config.py)")
    exp.add_argument("--output-dir", help="default: the spec's output_dir with a -sim suffix")
    exp.add_argument("--replay", help="a real run's output dir: replay its records instead of drawing the workload")
    # the flags of `pdserve-loadgen experiment`, so that one command line serves both
    exp.add_argument("--policy", action="append", metavar="NAME",
                     help="simulate only this value of grid.policy (repeatable)")
    exp.add_argument("--dry-run", action="store_true", help="validate the spec and the cluster file and list the runs")
    exp.add_argument("--no-progress", action="store_true", help="accepted for `pdserve-loadgen experiment` "
                     "parity: the simulator draws no progress bar")
    add_profile_check_args(exp)
    return parser


def add_profile_check_args(p: argparse.ArgumentParser) -> None:
    """--hardware and --strict-profile (here and in `pdserve plan`)."""
    p.add_argument("--hardware", default="", metavar="NAME",
                   help="the hardware the profile must come from, as `pdserve profile` names it (e.g. 'NVIDIA "
                        "H200', 'AMD EPYC (1 threads)'); default: the cluster file's hardware:, else this machine's")
    p.add_argument("--strict-profile", action="store_true",
                   help="refuse a profile older than the engine or from other hardware (default: warn)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    from pdserve.loadgen.experiment import only_policies, run_ids
    from pdserve.loadgen.spec import load_spec
    from pdserve.sim.config import load_cluster
    from pdserve.sim.experiment import run_sim_experiment

    try:
        spec = load_spec(args.spec)
        try:
            spec = only_policies(spec, args.policy)
        except ValueError as e:
            raise ValueError(f"--policy: {e}") from None
        try:
            cluster = load_cluster(args.cluster)
        except ValueError as e:
            raise ValueError(f"--cluster: {e}") from None
        from pdserve.sim.profile_check import check_profiles, cluster_profiles

        for line in check_profiles(cluster_profiles(cluster), hardware=args.hardware or cluster.hardware,
                                   strict=args.strict_profile):
            print(f"{PROG}: warning: {line}", file=sys.stderr)
        if args.dry_run:
            print("\n".join(run_ids(spec)))
            return 0
        out = args.output_dir or f"{spec.output_dir.rstrip('/')}-sim"
        rows = run_sim_experiment(spec, cluster, cluster_path=args.cluster, output_dir=out, replay_dir=args.replay)
    except (LoadgenError, ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(rows)} simulated runs; report: {out}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
