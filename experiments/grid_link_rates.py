"""The SET link rates of a grid spec, as bench_pacing.py arguments (run_gpu_grid.sh's links step).

    python3 -m experiments.grid_link_rates experiments/gpu-grid.yaml    ->  0.1 1 2.5 10 25 100

Each of the spec's bandwidth_gbps, and each times the router command's --slow-factor when it
has --slow pairs; then `--burst B` when the command sets --burst (so the check paces as the run).
"""

from __future__ import annotations

import re
import sys

import yaml


def link_rates(spec: dict) -> list[str]:
    command = spec["server"]["launch"]["command"]
    rates = {float(b) for b in spec["grid"]["bandwidth_gbps"]}
    factor = re.search(r"--slow-factor\s+(\S+)", command)
    if factor and re.search(r"--slow\s", command):
        rates |= {round(r * float(factor[1]), 12) for r in rates}
    out = [f"{r:g}" for r in sorted(rates)]
    burst = re.search(r"--burst\s+(\S+)", command)
    return out + (["--burst", burst[1]] if burst else [])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m experiments.grid_link_rates SPEC.yaml", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            spec = yaml.safe_load(f)
        print(" ".join(link_rates(spec)))
    except (OSError, yaml.YAMLError) as e:
        print(f"grid_link_rates.py: {argv[0]}: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as e:
        print(f"grid_link_rates.py: {argv[0]}: not a grid spec with server.launch.command and "
              f"grid.bandwidth_gbps ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
