"""`pdserve worker` with per-destination KV pacing, until the CLI grows the flag.

    python -m pdserve.emulation.worker --kv-pacing "10.200.0.3=1,default=10" -- <pdserve worker flags>
    python -m pdserve.emulation.worker --kv-pacing file:/path/pacing.txt -- ...   # re-read on change

Parses the flags with pdserve's own `worker` parser and runs the same standalone worker,
with ``kv_options=(("pacer", SPEC),)`` (see pacing_spec). Once `pdserve worker` takes
``--kv-pacing SPEC`` itself (passing it as that kv_option), this module can go.
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(prog="python -m pdserve.emulation.worker")
    pre.add_argument("--kv-pacing", required=True, metavar="SPEC",
                     help="pacing spec (pdserve.emulation.pacing_spec), or file:PATH of a file holding one")
    pre.add_argument("--log-level", default="WARNING")
    split = argv.index("--") if "--" in argv else len(argv)
    ours = pre.parse_args(argv[:split])

    from launcher.cli import _cluster_token, build_parser, engine_config
    from launcher.cluster.standalone import default_worker_id, run_worker
    from pdserve.emulation.pacing_spec import FILE_PREFIX, PACER_OPTION, parse_pacing, read_pacing_file
    from pdserve.worker.server import WorkerConfig

    try:
        if ours.kv_pacing.startswith(FILE_PREFIX):
            read_pacing_file(ours.kv_pacing[len(FILE_PREFIX):])
        else:
            parse_pacing(ours.kv_pacing)
    except ValueError as e:
        pre.error(f"--kv-pacing: {e}")
    args = build_parser().parse_args(["worker", *argv[split + 1:]])
    logging.basicConfig(level=ours.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = WorkerConfig(
        worker_id=args.worker_id or default_worker_id(args.role, args.port), role=args.role,
        engine=engine_config(args, args.role), host=args.host, port=args.port, kv_backend=args.kv_backend,
        kv_host=args.kv_host or args.host, kv_options=((PACER_OPTION, ours.kv_pacing),),
        cluster_token=_cluster_token(args))
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
