"""``python -m pdserve.launcher.emulation``: emulated clusters on one host (needs root).

    up SPEC.yaml [--port P] [--policy NAME] [--link-gbps G] [--method tc|pacing]
                 [--run-id ID] [--log-dir DIR]
        create the namespaces and links, start the workers inside them and the router on
        127.0.0.1:P; foreground until Ctrl-C / SIGTERM or until a process dies, then clean
        up. --link-gbps sets every link (listed and default) to G, for loadgen's
        bandwidth axis: launch command "python -m pdserve.launcher.emulation up SPEC --port {port}
        --policy {policy} --link-gbps {bandwidth_gbps}".
    down [--run ID | --prefix PREFIX]     remove a run's (default: every run's) leftovers
    cleanup [--prefix PREFIX]             the same (default prefix: pds-)
    list [--prefix PREFIX]                namespaces and root interfaces of emulated runs
    check SPEC.yaml                       validate a topology spec, print it

Exit status: 0, 1 on a failure at run time, 2 on bad arguments or a bad spec.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve.launcher.emulation.errors import EmulationError, EmulationSpecError
from pdserve.launcher.emulation.netns import PREFIX, Terminated


def _prefix(args) -> str:
    if getattr(args, "run", None):
        return f"{PREFIX}{args.run}-"
    return args.prefix


def cmd_up(args) -> int:
    from pdserve.launcher.emulation.cluster import EmulatedDeployment
    from pdserve.launcher.emulation.spec import load_topology

    spec = load_topology(args.spec)
    if args.link_gbps is not None:
        spec = spec.with_rate(args.link_gbps)
    if args.method:
        from dataclasses import replace

        spec = replace(spec, method=args.method)
    log_dir = args.log_dir or f"results/emulation/{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        with EmulatedDeployment(spec, log_dir, port=args.port, policy=args.policy, run_id=args.run_id,
                                startup_timeout_s=args.startup_timeout_s) as deployment:
            print(deployment.summary(), flush=True)
            print(f"pdserve emulation: serving at {deployment.url}/v1 (Ctrl-C to stop and clean up)", flush=True)
            while (failure := deployment.failed()) is None:
                time.sleep(0.5)
            print(f"pdserve emulation: {failure}; cleaning up", file=sys.stderr)
            return 1
    except (KeyboardInterrupt, Terminated):
        print("pdserve emulation: stopped; namespaces removed", file=sys.stderr)
        return 0


def cmd_cleanup(args) -> int:
    from pdserve.launcher.emulation.netns import cleanup

    removed = cleanup(_prefix(args))
    print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
    return 0


def cmd_list(args) -> int:
    from pdserve.launcher.emulation.netns import list_links, list_namespaces

    for name in list_namespaces(args.prefix):
        print(f"netns {name}")
    for name in list_links(args.prefix):
        print(f"link  {name}")
    return 0


def cmd_check(args) -> int:
    from pdserve.launcher.emulation.spec import load_topology

    spec = load_topology(args.spec)
    print(f"{spec.path}: {len(spec.nodes)} nodes, {len(spec.workers)} workers, method {spec.method}")
    for (a, b), link in spec.all_links().items():
        print(f"  {a}<->{b}: {link.gbps} Gbit/s, {link.latency_ms:g} ms")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdserve.launcher.emulation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start an emulated cluster with workers and router (foreground)")
    up.add_argument("spec")
    up.add_argument("--port", type=int, default=None, help="router port (default: the spec's, else 8000)")
    up.add_argument("--policy", default=None, help="placement policy (default: the spec's)")
    up.add_argument("--link-gbps", type=float, default=None, help="hold every link at this rate")
    up.add_argument("--method", choices=("tc", "pacing"), default=None, help="override the spec's method")
    up.add_argument("--run-id", default=None, help="names pds-<run-id>-* (default: random)")
    up.add_argument("--log-dir", default=None)
    up.add_argument("--startup-timeout-s", type=float, default=300.0)
    up.set_defaults(func=cmd_up)
    for name, help_text in (("down", "remove an emulated run's leftovers"), ("cleanup", "remove leftovers")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--prefix", default=PREFIX, help=f"names starting with this (default {PREFIX})")
        if name == "down":
            p.add_argument("--run", default=None, help="the run id (pds-<run>-*)")
        p.set_defaults(func=cmd_cleanup)
    ls = sub.add_parser("list", help="list emulation namespaces and interfaces")
    ls.add_argument("--prefix", default=PREFIX)
    ls.set_defaults(func=cmd_list)
    ck = sub.add_parser("check", help="validate a topology spec")
    ck.add_argument("spec")
    ck.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "link_gbps", None) is not None and not args.link_gbps > 0:
        print("pdserve emulation: error: --link-gbps must be > 0", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (EmulationSpecError, ValueError) as e:
        print(f"pdserve emulation: error: {e}", file=sys.stderr)
        return 2
    except EmulationError as e:
        print(f"pdserve emulation: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
