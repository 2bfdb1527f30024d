"""pdserve.launcher.workers is the one place that builds a worker: the command line and environment of a
worker process, the `WorkerConfig` of `pdserve worker` and of a Ray actor. Every launcher goes
through it (paced, emulated, Ray pools), and no other module assembles a worker command line."""

from __future__ import annotations

import argparse
import ast
import ipaddress
import os
import re
from pathlib import Path

import pytest

from pdserve.kvtransfer.pacing_spec import PACER_OPTION
from pdserve.launcher.cli import build_parser, engine_config
from pdserve.launcher.workers import WorkerSpec, ray_actor, spec_from_args, worker_argv, worker_config, worker_env
from pdserve.config import EngineConfig
from pdserve.proto.auth import TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32


def parse_back(argv: list[str], env: dict[str, str], monkeypatch) -> argparse.Namespace:
    """What `python -m pdserve.launcher.cli <argv>` parses, under `env`."""
    assert argv[1:3] == ["-m", "pdserve.launcher.cli"]
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args(argv[3:])


def test_the_command_line_reads_back_as_the_same_spec(monkeypatch, tmp_path):
    pacing = tmp_path / "pacing.txt"
    pacing.write_text("default=2\n")
    spec = WorkerSpec(role="mixed", worker_id="w7", host="10.0.0.2", port=5000, kv_backend="fake",
                      kv_host="10.0.0.3", kv_interface="any", moves_kv=True, kv_pacing=f"file:{pacing}",
                      cluster_token=TOKEN, model="random:tiny-llama", device="cpu", engine_args=("--max-num-seqs", "3"),
                      python="py")
    argv, env = worker_argv(spec), worker_env(spec)
    assert argv[:4] == ["py", "-m", "pdserve.launcher.cli", "worker"] and argv[-2:] == ["--max-num-seqs", "3"]
    assert TOKEN not in " ".join(argv) and env == {TOKEN_ENV: TOKEN}  # the token goes by environment only
    args = parse_back(argv, env, monkeypatch)
    back = spec_from_args(args)
    assert back == WorkerSpec(role="mixed", worker_id="w7", host="10.0.0.2", port=5000, kv_backend="fake",
                              kv_host="10.0.0.3", kv_interface="any", moves_kv=True, kv_pacing=f"file:{pacing}",
                              cluster_token=TOKEN)
    engine = engine_config(args, args.role)
    assert (engine.model, engine.device, engine.scheduler.max_num_seqs) == ("random:tiny-llama", "cpu", 3)
    config = worker_config(back, engine)
    assert (config.worker_id, config.role, config.host, config.port, config.kv_host, config.kv_backend) == (
        "w7", "mixed", "10.0.0.2", 5000, "10.0.0.3", "fake")
    assert config.kv_options == ((PACER_OPTION, f"file:{pacing}"),) and config.moves_kv
    assert config.cluster_token == TOKEN and config.kv_interface == "any"


def test_defaults_stay_off_the_command_line(monkeypatch):
    spec = WorkerSpec(role="decode")
    argv = worker_argv(spec)
    assert argv[4:] == ["--role", "decode", "--host", "127.0.0.1", "--port", "0"] and worker_env(spec) == {}
    back = spec_from_args(parse_back(argv, {}, monkeypatch))
    assert back == spec
    config = worker_config(back, EngineConfig())
    assert config.worker_id.startswith("decode-") and config.kv_host == "127.0.0.1" and config.kv_options == ()
    assert config.cluster_token is None and config.kv_interface is None  # None: the KV host


def test_the_kv_planes_variables_travel_in_the_worker_config(monkeypatch, tmp_path):
    """Read where the worker is built (worker_config, in the process that starts it), not in the
    KV plane: the trace, its dump directory, the staging; a bad one is named."""
    from pdserve.kvtransfer.settings import KVSettings

    for name in ("PDSERVE_KV_TRACE", "PDSERVE_KV_TRACE_DIR", "PDSERVE_KV_RECV_SLOTS", "PDSERVE_UCX_PROGRESS_MODE"):
        monkeypatch.delenv(name, raising=False)
    spec = WorkerSpec(role="decode")
    assert worker_config(spec, EngineConfig()).kv_settings == KVSettings()
    monkeypatch.setenv("PDSERVE_KV_TRACE", "1")
    monkeypatch.setenv("PDSERVE_KV_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("PDSERVE_KV_RECV_SLOTS", "3")
    monkeypatch.setenv("PDSERVE_UCX_PROGRESS_MODE", "thread-polling")
    assert worker_config(spec, EngineConfig()).kv_settings == KVSettings(
        recv_slots=3, ucx_progress_mode="thread-polling", trace=True, trace_dir=str(tmp_path))
    monkeypatch.setenv("PDSERVE_KV_RECV_SLOTS", "none")
    with pytest.raises(ValueError, match="PDSERVE_KV_RECV_SLOTS must be an int >= 1, got 'none'"):
        worker_config(spec, EngineConfig())


def test_engine_args_win_over_the_device():
    given = WorkerSpec(role="prefill", device="cuda:1", engine_args=("--device", "cpu"))
    assert "--device" not in worker_argv(given)[:-2]
    argv = worker_argv(WorkerSpec(role="prefill", device="cuda:1"))
    assert argv[argv.index("--device") + 1] == "cuda:1"


def test_visible_devices_go_to_the_environment_in_bus_order():
    env = worker_env(WorkerSpec(role="prefill", visible_devices="0,1", cluster_token=TOKEN))
    assert env == {TOKEN_ENV: TOKEN, "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_worker_command_errors_name_the_flag(capsys, tmp_path):
    from pdserve.launcher.cli import main

    for flags, needle in ((["--kv-pacing", "nonsense"], "--kv-pacing"),
                          (["--kv-pacing", f"file:{tmp_path / 'missing.txt'}"], "--kv-pacing"),
                          (["--role", "decode", "--moves-kv"], "--moves-kv applies to --role mixed")):
        argv = ["worker", *(["--role", "prefill"] if "--role" not in flags else []), *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pdserve: error: ") and needle in err[0], err


def test_pdserve_worker_serves_the_config_of_its_spec(monkeypatch):
    """`pdserve worker` builds its WorkerConfig through worker_config (with the pacer option)."""
    import pdserve.launcher.cluster.standalone as standalone
    from pdserve.launcher.cli import main

    served = []
    monkeypatch.setattr(standalone, "run_worker", lambda config: served.append(config) or 0)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["worker", "--role", "prefill", "--model", "random:tiny-llama", "--port", "5001",
                 "--kv-pacing", "10.0.0.3=1,default=10"]) == 0
    (config,) = served
    assert config.kv_options == ((PACER_OPTION, "10.0.0.3=1,default=10"),)
    assert (config.role, config.port, config.cluster_token, config.engine.model) == (
        "prefill", 5001, TOKEN, "random:tiny-llama")


def test_paced_workers_use_it(tmp_path):
    from pdserve.launcher.paced import plan_workers, worker_spec

    plan = plan_workers(1, 1, ["0", "1"])
    plan[0]["pacing_file"] = "pacing-p0.txt"
    prefill = worker_spec(plan[0], "m", 5000, tmp_path, ["--kv-cache-gib", "0.1"], TOKEN)
    argv = worker_argv(prefill)
    assert argv[1:4] == ["-m", "pdserve.launcher.cli", "worker"]
    assert argv[argv.index("--kv-pacing") + 1] == f"file:{tmp_path / 'pacing-p0.txt'}"
    assert argv[argv.index("--worker-id") + 1] == "p0" and argv[argv.index("--device") + 1] == "cuda:0"
    assert worker_env(prefill) == {TOKEN_ENV: TOKEN, "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert "--kv-pacing" not in worker_argv(worker_spec(plan[1], "m", 5001, tmp_path, [], TOKEN))


def test_emulated_workers_use_it(tmp_path):
    from pdserve.launcher.emulation.cluster import EmulatedDeployment
    from pdserve.launcher.emulation.spec import load_topology

    spec = load_topology(REPO / "pdserve" / "launcher" / "emulation" / "examples" / "2p2d.yaml")
    deployment = EmulatedDeployment(spec, tmp_path, run_id="wspec")
    deployment.cluster.subnet = ipaddress.ip_network("10.251.0.0/24")
    deployment.cluster._created = True  # addresses only; nothing is created
    launch = deployment.worker_spec(2, spec.workers[2])
    assert (launch.role, launch.worker_id, launch.host, launch.port) == ("decode", "d0", "10.251.0.3", 50053)
    assert worker_argv(launch)[1:4] == ["-m", "pdserve.launcher.cli", "worker"]
    assert worker_env(launch) == {TOKEN_ENV: deployment.cluster_token}


def test_ray_pool_workers_use_it():
    engine = EngineConfig(model="random:tiny-llama")
    spec = WorkerSpec(role="mixed", worker_id="pdserve:c:mixed:0", kv_backend="fake", cluster_token=TOKEN,
                      moves_kv=True)
    options, args = ray_actor(spec, engine, namespace="ns", num_cpus=1.0, num_gpus=0.5, resources={"node_a": 1},
                              scheduling_strategy="STRATEGY")
    assert options == dict(name="pdserve:c:mixed:0", namespace="ns", lifetime=None, max_restarts=-1,
                           max_task_retries=0, num_cpus=1.0, num_gpus=0.5, resources={"node_a": 1},
                           runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
                           scheduling_strategy="STRATEGY")
    (config,) = args
    assert (config.worker_id, config.role, config.kv_backend, config.cluster_token, config.moves_kv) == (
        "pdserve:c:mixed:0", "mixed", "fake", TOKEN, True)
    assert config.engine is engine and config.host == config.kv_host == "127.0.0.1"
    cpu_options, _ = ray_actor(spec, engine, namespace="ns", num_cpus=1.0, num_gpus=0, resources={},
                               scheduling_strategy=None)
    assert cpu_options["runtime_env"] is None
    with pytest.raises(ValueError, match="actor name"):
        ray_actor(WorkerSpec(role="mixed"), engine, namespace="ns", num_cpus=1, num_gpus=0, resources={},
                  scheduling_strategy=None)
    pools = (REPO / "pdserve" / "launcher" / "cluster" / "pools.py").read_text()
    assert "ray_actor(" in pools and ".options(**options).remote(*args)" in pools


# ---- no second copy -------------------------------------------------------------------------

SOURCE_DIRS = ("pdserve", "benchmarks", "experiments", "tools", "deploy")
# a shell or YAML line that runs `python -m pdserve.launcher.cli [...] worker` (or a worker module)
SHELL_WORKER = re.compile(r"-m\s+([\w.]+\s.*\bworker\s+--|[\w.]*\bworker\b)")


def _source_files():
    for top in SOURCE_DIRS:
        for directory, dirs, files in os.walk(REPO / top):
            dirs[:] = [d for d in dirs if d not in ("results", "__pycache__")]
            for name in files:
                if name.endswith((".py", ".sh", ".yaml", ".yml")) or name == "Dockerfile":
                    yield Path(directory) / name


def worker_command_lists(source: str, name: str = "<source>") -> list[int]:
    """Lines of list/tuple literals in Python `source` that run a worker with ``-m``: a module
    followed by a "worker" subcommand (``"-m", "pdserve.launcher.cli", "worker"``), or a worker module
    (``"-m", "pdserve.worker.server"``, ``"-m", "x.worker"``)."""
    lines = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, (ast.List, ast.Tuple)):
            continue
        items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
        for i, item in enumerate(items[:-1]):
            module = items[i + 1]
            if item == "-m" and module is not None and (
                    "worker" in items[i + 2:] or re.search(r"(^|\.)worker(\.|$)", module)):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_a_worker_command_line():
    assert worker_command_lists('argv = [sys.executable, "-m", "pdserve.launcher.cli", "worker", *flags]') == [1]
    assert worker_command_lists('argv = [py, "-m", "pdserve.worker.server", "--role", r]') == [1]
    assert worker_command_lists('argv = [py, "-m", "pdserve.emulation.worker", "--kv-pacing", p, "--", *f]') == [1]
    assert worker_command_lists('argv = [py, "-m", "pdserve.launcher.cli", "router", "--worker", w]') == []
    assert worker_command_lists('argv = [py, "-m", "pdserve.launcher.cli", "up", "--port", "1"]') == []
    assert SHELL_WORKER.search('"$py" -m launcher.cli --log-level INFO worker --role prefill')
    assert not SHELL_WORKER.search('"$py" -m launcher.cli up --model "$model"')


def test_no_other_module_assembles_a_worker_command_line():
    found = []
    for path in _source_files():
        rel = path.relative_to(REPO).as_posix()
        if rel == "pdserve/launcher/workers.py":
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".py":
            found += [f"{rel}:{line}" for line in worker_command_lists(text, rel)]
        else:
            found += [f"{rel}: {line.strip()}" for line in text.splitlines() if SHELL_WORKER.search(line)]
    assert not found, "\n".join(found)


def test_only_launcher_workers_constructs_a_worker_config_in_the_launcher():
    """Within the composition root, `WorkerConfig(...)` is built in pdserve/launcher/workers.py alone."""
    found = []
    for path in (REPO / "pdserve" / "launcher").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel == "pdserve/launcher/workers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            if getattr(node.func, "id", getattr(node.func, "attr", None)) == "WorkerConfig":
                found.append(f"{rel}:{node.lineno}")
    assert not found, found
