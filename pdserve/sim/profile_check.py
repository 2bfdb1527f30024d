"""Is a profile still true? The engine that measured it and the hardware it ran on, against
the engine installed here and the hardware being planned for.

A profile (router.placement.profiles) is a table of step times; the simulator and the planner
are only as right as it is. Two things make it wrong:

- the engine changed: the profile's `engine.step_version` is older than the engine's for the
  profile's device (pdserve/step_version.py; a file without one predates the stamp: older);
- the hardware differs: the profile's `hardware.name` (a GPU's name, or a CPU's model with the
  torch threads in brackets) is not the target's. The target is what the caller names (the
  cluster file's `hardware:`, the `--hardware` flag), else this machine's device of the
  profile's kind (the CPU model from /proc/cpuinfo, the first GPU from nvidia-smi); thread
  counts are compared only where the target names one.

`profile_problems` returns one line per problem, each ending with the command that measures a
new profile; callers log them as warnings, or refuse (`StaleProfile`) under `--strict-profile`.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from pdserve.step_version import engine_step_version as current_step_version
from pdserve.router.placement.profiles import Profile

_THREADS = re.compile(r"\s*\((\d+) threads?\)\s*$")


class StaleProfile(ValueError):
    """A profile is older than the engine or from other hardware, and `--strict-profile` was given."""


@functools.lru_cache(maxsize=None)
def local_hardware(device: str) -> str:
    """This machine's device of `device`'s kind, as `pdserve profile` names it without the
    thread count ("" when it cannot tell)."""
    if device == "cuda":
        smi = shutil.which("nvidia-smi")
        if not smi:
            return ""
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.splitlines()[0].strip() if out.strip() else ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _split(name: str) -> tuple[str, int | None]:
    m = _THREADS.search(name)
    return (name[:m.start()].strip(), int(m[1])) if m else (name.strip(), None)


def same_hardware(profile_hardware: str, target: str) -> bool:
    """Device names equal (case and spacing aside); thread counts too where both name one."""
    (a, ta), (b, tb) = _split(profile_hardware), _split(target)
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    return norm(a) == norm(b) and (ta is None or tb is None or ta == tb)


def remeasure_command(profile: Profile, out: str = "NEW-PROFILE.json") -> str:
    """The `pdserve profile` command line that measures `profile` again on this engine."""
    cmd = (f"pdserve profile --model {profile.model.split(' ')[0]} --dtype {profile.dtype} "
           f"--device {profile.device} --max-num-batched-tokens {profile.max_num_batched_tokens} "
           f"--block-size {profile.block_size} --out {out}")
    _, threads = _split(profile.hardware)
    return f"OMP_NUM_THREADS={threads} {cmd}" if threads is not None and profile.device == "cpu" else cmd


def profile_problems(profile: Profile, *, path: str = "", hardware: str = "",
                     engine_step_version: int | None = None) -> list[str]:
    """One line per reason `profile` may be wrong here (module docstring); [] when none."""
    name = os.path.relpath(path) if path and not os.path.relpath(path).startswith("..") else (path or "the profile")
    fix = f"measure a new one: {remeasure_command(profile)}"
    problems = []
    if engine_step_version is None:
        engine_step_version = current_step_version(profile.device)
    version = profile.engine_step_version
    if version is None or version < engine_step_version:
        measured = "an engine without a step version" if version is None else f"engine step version {version}"
        problems.append(f"{name}: measured by {measured}, older than this engine's {engine_step_version} "
                        f"on {profile.device} (pdserve/step_version.py): its step times may be wrong; {fix}")
    target = hardware or local_hardware(profile.device)
    if target and not same_hardware(profile.hardware, target):
        said = "the target hardware" if hardware else "this machine"
        problems.append(f"{name}: measured on {profile.hardware!r}, {said} is {target!r}: its step times "
                        f"are another device's; {fix} (or name the target hardware, e.g. --hardware)")
    return problems


def check_profiles(profiles: list[tuple[str, Profile]], *, hardware: str = "", strict: bool = False) -> list[str]:
    """The problems of each (path, profile); raises StaleProfile with them all when `strict`."""
    problems = [line for path, profile in profiles for line in profile_problems(profile, path=path, hardware=hardware)]
    if problems and strict:
        raise StaleProfile("--strict-profile: " + " | ".join(problems))
    return problems


def cluster_profiles(config) -> list[tuple[str, Profile]]:
    """The (path, profile) pairs of a sim.config.ClusterConfig."""
    out = [(config.profile_path, config.profile)]
    if config.decode_profile is not None:
        out.append((config.decode_profile_path, config.decode_profile))
    return out
