"""`pdserve up` settings (flags, YAML, defaults), pool specs, and one-line CLI errors (exit 2)."""

from __future__ import annotations

import pytest

from pdserve.launcher.cli import build_parser, main
from pdserve.launcher.cluster.config import UpConfig, load_up_config, read_config_file, router_mode
from pdserve.launcher.cluster.ray_workers import assigned_cuda_index
from pdserve.launcher.cluster.up import pool_specs
from pdserve.engine_args import ENGINE_DEFAULTS


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), err
    for needle in needles:
        assert needle in lines[0], err


def test_defaults():
    c = UpConfig()
    assert (c.model, c.mode, c.prefill, c.decode, c.policy, c.host, c.port) == (
        "smollm2", "disaggregated", 1, 1, "round-robin", "127.0.0.1", 8000)
    assert c.pool_sizes() == {"prefill": 1, "decode": 1}
    assert c.address is None and c.kv_backend == "ucx" and c.kv_deadline_s == 10.0
    assert c.model_name == "smollm2"


def test_engine_defaults_are_shared_with_generate():
    generate = build_parser().parse_args(["generate", "--prompt", "x"])
    assert {k: getattr(generate, k) for k in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
    assert UpConfig().engine_values() == ENGINE_DEFAULTS


def test_up_flags_not_given_stay_unset_so_the_file_applies(tmp_path):
    args = build_parser().parse_args(["up", "--prefill", "3"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level", "config")}
    assert given == {"prefill": 3}


def test_file_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: random:smollm2-135m\nmax-model-len: 256\nprefill: 2\ndecode: 3\n"
                    "prefill_resources: {node_a: 1}\nresources: {gpu_pool: 1}\nport: 9000\n")
    c = load_up_config({"decode": 1, "port": 9100}, str(path))
    assert (c.model, c.max_model_len, c.prefill, c.decode, c.port) == ("random:smollm2-135m", 256, 2, 1, 9100)
    assert c.pool_resources("prefill") == {"gpu_pool": 1.0, "node_a": 1.0}
    assert c.pool_resources("decode") == {"gpu_pool": 1.0}


def test_colocated_sizes():
    assert UpConfig(mode="colocated", prefill=1, decode=2).pool_sizes() == {"mixed": 3}
    assert UpConfig(mode="colocated", replicas=4).pool_sizes() == {"mixed": 4}


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "split"}, "--mode: must be one of disaggregated, colocated, hybrid"),
    ({"prefill": 0}, "--prefill: must be >= 1 in --mode disaggregated"),
    ({"replicas": 2}, "--replicas: applies only to --mode colocated"),
    ({"mode": "colocated", "replicas": 0}, "--replicas: must be >= 1"),
    ({"policy": "fastest"}, "--policy: unknown placement policy 'fastest'; choose one of "),
    ({"port": 0}, "--port: must be in 1..65535"),
    ({"kv_backend": "fake"}, "--kv-backend: 'fake' moves KV only inside one process"),
    ({"kv_backend": "nccl"}, "--kv-backend: must be one of fake, nixl, ucx, got 'nccl'"),
    ({"kv_deadline_s": 0.0}, "--kv-deadline-s: must be > 0"),
    ({"placement_strategy": "pack"}, "--placement-strategy: must be one of PACK"),
    ({"prefill_resources": {"node_a": -1}}, "--prefill-resources: amount of 'node_a' must be a number >= 0"),
    ({"resources": {"GPU": 1}}, "--resources: 'GPU' is set by --worker-cpus/--worker-gpus"),
    ({"cluster_name": "a:b"}, "--cluster-name: must be non-empty without ':'"),
    ({"ray_object_store_mb": 10}, "--ray-object-store-mb: must be >= 75"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError) as info:
        UpConfig(**kwargs)
    assert str(info.value).startswith(message)


def test_policy_choices_come_from_the_routers_registry():
    from pdserve.router.placement.registry import POLICIES

    with pytest.raises(ValueError) as info:
        UpConfig(policy="fastest")
    assert str(info.value).endswith(", ".join(sorted(POLICIES)))
    for name in POLICIES:
        assert UpConfig(policy=name).policy == name


@pytest.mark.parametrize("text, message", [
    ("prefil: 2\n", "field 'prefil': unknown key"),
    ("prefill: two\n", "field 'prefill': expected a whole number, got 'two'"),
    ("no_prefix_caching: 1\n", "field 'no_prefix_caching': expected true or false"),
    ("prefill_resources: node_a\n", "field 'prefill_resources': expected a mapping"),
    ("- a\n- b\n", "expected a mapping, got a list"),
    ("prefill: [1\n", "invalid YAML"),
    ("prefill: 1\nprefill-: 2\n", "field 'prefill-': unknown key"),
    ("max-model-len: 2\nmax_model_len: 3\n", "field 'max_model_len': given twice"),
])
def test_bad_files_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_config_file(str(path))
    assert str(info.value).startswith(f"{path}:") and message in str(info.value)


def test_bad_value_from_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: split\n")
    with pytest.raises(ValueError, match=rf"^{path}: --mode: must be one of"):
        load_up_config({}, str(path))
    assert load_up_config({"mode": "colocated"}, str(path)).mode == "colocated"  # the flag wins


def test_pool_specs_cpu_and_gpu():
    c = UpConfig(model="random:tiny-llama", prefill=2, decode=1, prefill_resources={"node_a": 1}, worker_cpus=2)
    cpu = {s.role: s for s in pool_specs(c, gpus_in_cluster=0)}
    assert (cpu["prefill"].size, cpu["decode"].size) == (2, 1)
    assert cpu["prefill"].num_gpus == 0 and cpu["prefill"].engine.device == "cpu"
    assert cpu["prefill"].engine.scheduler.role == "prefill" and cpu["decode"].engine.scheduler.role == "decode"
    assert cpu["prefill"].bundle() == {"CPU": 2.0, "node_a": 1.0} and cpu["decode"].bundle() == {"CPU": 2.0}
    gpu = {s.role: s for s in pool_specs(c, gpus_in_cluster=8)}
    assert gpu["decode"].num_gpus == 1.0 and gpu["decode"].engine.device is None
    assert gpu["decode"].bundle() == {"CPU": 2.0, "GPU": 1.0}
    (mixed,) = pool_specs(UpConfig(mode="colocated", replicas=3, worker_gpus=0.5), gpus_in_cluster=8)
    assert (mixed.role, mixed.size, mixed.num_gpus) == ("mixed", 3, 0.5) and not mixed.moves_kv
    (hybrid,) = pool_specs(UpConfig(mode="hybrid", replicas=2), gpus_in_cluster=2)
    assert (hybrid.role, hybrid.size, hybrid.num_gpus, hybrid.moves_kv) == ("mixed", 2, 1.0, True)


def test_nixl_is_a_cluster_kv_backend():
    assert UpConfig(kv_backend="nixl").kv_backend == "nixl"  # checked by name; NIXL itself loads on the workers


def test_hybrid_mode_routes_as_disaggregated():
    assert UpConfig(mode="hybrid", prefill=1, decode=1).pool_sizes() == {"mixed": 2}
    assert router_mode("hybrid") == "disaggregated" and router_mode("colocated") == "colocated"
    with pytest.raises(ValueError, match="--kv-backend: 'fake'"):
        UpConfig(mode="hybrid", replicas=2, kv_backend="fake")


@pytest.mark.parametrize("gpu_ids, env, index", [
    ([1], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, 1),
    (["5"], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "4,5"}, 1),
    ([1], {}, None),  # Ray masked the devices: the worker's one visible GPU is cuda:0 already
    ([], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, None),
])
def test_assigned_cuda_index(gpu_ids, env, index):
    assert assigned_cuda_index(gpu_ids, env) == index


def test_assigned_cuda_index_not_visible():
    with pytest.raises(RuntimeError, match="does not list"):
        assigned_cuda_index(["7"], {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"})


# ---- the command line: one line, exit status 2, naming the flag or file ------------------

def test_cli_bad_integer(capsys):
    assert_one_line_error(*run_cli(capsys, "up", "--prefill", "x"), "--prefill", "'x'")


def test_cli_bad_json_resources(capsys):
    assert_one_line_error(*run_cli(capsys, "up", "--prefill-resources", "{node_a"), "--prefill-resources", "JSON")


def test_cli_unknown_policy(capsys):
    assert_one_line_error(*run_cli(capsys, "up", "--policy", "nope"), "--policy", "'nope'")


def test_cli_missing_config_file(capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    assert_one_line_error(*run_cli(capsys, "up", "--config", str(missing)), str(missing), "cannot read")


def test_cli_unknown_key_in_config_file(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode: 2\nworkers: 3\n")
    assert_one_line_error(*run_cli(capsys, "up", "--config", str(path)), str(path), "field 'workers': unknown key")


def test_cli_model_without_tokenizer(capsys):
    assert_one_line_error(*run_cli(capsys, "up", "--model", "random:tiny-llama"), "--model", "no tokenizer")


def test_cli_port_in_use(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        assert_one_line_error(*run_cli(capsys, "up", "--model", "random:smollm2-135m", "--port", port),
                              f"--port: cannot listen on 127.0.0.1:{port}")


def test_cli_unreachable_ray_address_fails_fast(capsys):
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there
    t0 = time.monotonic()
    rc, err = run_cli(capsys, "up", "--model", "random:smollm2-135m", "--address", f"127.0.0.1:{port}",
                      "--port", str(port))
    assert_one_line_error(rc, err, "--address: cannot reach Ray at", "Connection refused")
    assert time.monotonic() - t0 < 30  # Ray itself retries for a minute; a loaded 2-core CI host takes 10-15 s


def test_cli_worker_bad_role_and_port(capsys):
    assert_one_line_error(*run_cli(capsys, "worker", "--role", "both"), "--role", "'both'")
    assert_one_line_error(*run_cli(capsys, "worker", "--role", "decode", "--port", "70000"), "--port")


def test_cli_router_bad_entries(capsys):
    assert_one_line_error(*run_cli(capsys, "router", "--worker", "prefill:127.0.0.1:1"), "--worker", "bad worker entry")
    assert_one_line_error(*run_cli(capsys, "router", "--worker", "decode=127.0.0.1:5000"), "--worker",
                          "needs at least one prefill and one decode worker")
    assert_one_line_error(*run_cli(capsys, "router", "--worker", "prefill=h:1", "--worker", "decode=h:2",
                                   "--policy", "x"),
                          "--policy")


def test_generate_still_parses():
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--max-tokens", "3"])
    assert (args.prompt, args.max_tokens, args.model) == ("hi", 3, "smollm2")


def test_pool_specs_share_too_few_gpus():
    # the default on one GPU: the two workers share it, each with its share of the memory
    specs = pool_specs(UpConfig(model="random:tiny-llama"), gpus_in_cluster=1)
    assert [s.num_gpus for s in specs] == [0.5, 0.5]
    assert all(s.engine.cache.gpu_memory_fraction == 0.425 for s in specs)
    three = pool_specs(UpConfig(model="random:tiny-llama", prefill=2, decode=1), gpus_in_cluster=2)
    assert {s.num_gpus for s in three} == {0.66}
    # an explicit share that cannot fit fails at once, naming what fits
    with pytest.raises(ValueError, match=r"--worker-gpus 1: 2 workers need 2 GPU\(s\), the Ray cluster has 1; "
                                         r"use --worker-gpus 0.5, --mode colocated"):
        pool_specs(UpConfig(model="random:tiny-llama", worker_gpus=1.0), gpus_in_cluster=1)
    assert [s.num_gpus for s in pool_specs(UpConfig(model="random:tiny-llama", worker_gpus=0.5), 1)] == [0.5, 0.5]


def test_cli_cluster_token_errors_name_the_flag_or_variable(capsys, tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-token")
    assert_one_line_error(*run_cli(capsys, "worker", "--role", "decode", "--cluster-token-file", missing),
                          "--cluster-token-file: cannot read", "no-such-token")
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "short")
    assert_one_line_error(*run_cli(capsys, "router", "--worker", "decode=127.0.0.1:1"),
                          "$PDSERVE_CLUSTER_TOKEN", "at least 16 characters")


@pytest.mark.parametrize("flag", ["--no-calibration", "--no-local-prefill"])
def test_cli_network_aware_switches_are_network_aware_only(capsys, flag):
    for argv in (("up", flag),
                 ("router", "--worker", "prefill=h:1", "--worker", "decode=h:2", flag)):
        assert_one_line_error(*run_cli(capsys, *argv), flag, "only the network-aware policy")


def test_no_calibration_reaches_the_network_aware_policy(tmp_path):
    from pathlib import Path

    from pdserve.launcher.cluster.serving import RouterSettings, make_router_policy

    profile = str(Path(__file__).resolve().parents[2] / "experiments" / "profile-smollm2-cpu-1thread.json")
    assert UpConfig(policy="network-aware", profile=profile).no_calibration is False
    (tmp_path / "up.yaml").write_text("no_calibration: true\n")
    assert read_config_file(str(tmp_path / "up.yaml"))["no_calibration"] is True
    for calibrate in (True, False):
        settings = RouterSettings(model="smollm2", policy="network-aware", profile=profile, calibrate=calibrate)
        assert make_router_policy(settings).calibrate is calibrate
    (tmp_path / "up.yaml").write_text("no_local_prefill: true\n")
    assert read_config_file(str(tmp_path / "up.yaml"))["no_local_prefill"] is True
    for local in (True, False):
        settings = RouterSettings(model="smollm2", policy="network-aware", profile=profile, local_prefill=local)
        assert make_router_policy(settings).local_prefill is local


def test_pool_specs_size_the_scheduler_for_the_workers_device():
    """Sizes not given: the workers' device defaults (8192/256 with a GPU share, 512/64 on CPU),
    sent to the workers explicitly; given sizes (flag or file) win."""
    c = UpConfig(model="random:tiny-llama")
    sizes = {s.engine.scheduler.max_num_batched_tokens for s in pool_specs(c, gpus_in_cluster=0)}, \
        {s.engine.scheduler.max_num_seqs for s in pool_specs(c, gpus_in_cluster=0)}
    assert sizes == ({512}, {64})
    gpu = pool_specs(c, gpus_in_cluster=2)
    assert {(s.engine.scheduler.max_num_batched_tokens, s.engine.scheduler.max_num_seqs) for s in gpu} == {(8192, 256)}
    given = pool_specs(UpConfig(model="random:tiny-llama", max_num_seqs=32), gpus_in_cluster=2)
    assert {(s.engine.scheduler.max_num_batched_tokens, s.engine.scheduler.max_num_seqs) for s in given} == {(8192, 32)}
    on_cpu = pool_specs(UpConfig(model="random:tiny-llama", device="cpu"), gpus_in_cluster=2)  # --device wins
    assert {s.engine.scheduler.max_num_batched_tokens for s in on_cpu} == {512}
    from pdserve.launcher.cluster.up import engine_sizes

    assert engine_sizes(c, 1.0) == "max_num_batched_tokens=8192 max_num_seqs=256 (defaults for cuda)"
    assert engine_sizes(c, 0.0) == "max_num_batched_tokens=512 max_num_seqs=64 (defaults for cpu)"


def test_engine_switches_from_flags_file_and_environment(tmp_path, monkeypatch):
    """--[no-]overlap-steps, --[no-]cuda-graphs, --[no-]warmup, --experimental-fp8-kv: flags over
    the file over the environment (read once, at the edge) over the defaults; they reach every
    worker's EngineConfig."""
    for var in ("PDSERVE_OVERLAP_STEPS", "PDSERVE_CUDA_GRAPHS", "PDSERVE_WARMUP", "PDSERVE_EXPERIMENTAL_FP8_KV"):
        monkeypatch.delenv(var, raising=False)

    def engines(config):
        return [s.engine for s in pool_specs(config, gpus_in_cluster=0)]

    (default, _) = engines(UpConfig(model="random:tiny-llama"))
    assert (default.overlap_steps, default.warmup, default.cache.enforce_eager, default.cache.experimental_fp8_kv) == (
        True, True, False, False)
    args = build_parser().parse_args(["up", "--no-overlap-steps", "--no-cuda-graphs", "--experimental-fp8-kv"])
    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level", "config")}
    assert given == {"overlap_steps": False, "cuda_graphs": False, "experimental_fp8_kv": True}
    path = tmp_path / "c.yaml"
    path.write_text("model: random:tiny-llama\nwarmup: false\noverlap-steps: true\n")
    for engine in engines(load_up_config(given, str(path))):
        assert (engine.overlap_steps, engine.warmup, engine.cache.enforce_eager, engine.cache.experimental_fp8_kv) == (
            False, False, True, True)
    monkeypatch.setenv("PDSERVE_WARMUP", "0")
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS", "0")
    (env, _) = engines(load_up_config({"cuda_graphs": True}, None))
    assert env.warmup is False and env.cache.enforce_eager is False  # the flag over the variable
    path.write_text("warmup: 0\n")
    with pytest.raises(ValueError, match="field 'warmup': expected true or false"):
        load_up_config({}, str(path))


def test_kv_wire_precision_from_the_file_and_checked(tmp_path):
    from pdserve.launcher.cluster.config import load_up_config

    path = tmp_path / "c.yaml"
    path.write_text("kv-wire-precision: fp8\n")
    assert load_up_config({}, str(path)).kv_wire_precision == "fp8"
    assert load_up_config({"kv_wire_precision": "full"}, str(path)).kv_wire_precision == "full"
    assert load_up_config({}).kv_wire_precision == "auto"
    path.write_text("kv-wire-precision: fp16\n")
    with pytest.raises(ValueError, match="kv-wire-precision"):
        load_up_config({}, str(path))
