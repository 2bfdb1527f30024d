"""A TP worker is one worker: -tp on `pdserve worker` and `pdserve up`, per pool, in the cluster
file, and the start-up checks that fail before Ray starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.launcher.cli import build_parser
from pdserve.launcher.cluster.config import load_up_config
from pdserve.launcher.cluster.pools import PoolSpec
from pdserve.launcher.cluster.up import check_tensor_parallel_pools, gpu_share, pool_specs
from pdserve.launcher.workers import WorkerSpec, ray_actor, spec_from_args, worker_argv, worker_config
from pdserve.config import EngineConfig

MODEL = "random:tiny-llama-tp"  # 6 heads, 6 KV heads, MLP 192


def test_worker_flag_round_trips_through_argv():
    spec = WorkerSpec(role="decode", worker_id="d0", tensor_parallel_size=2)
    argv = worker_argv(spec)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    args = build_parser().parse_args(argv[3:])  # drop python -m pdserve.launcher.cli
    back = spec_from_args(args)
    assert back.tensor_parallel_size == 2
    assert worker_config(back, EngineConfig(model=MODEL)).engine.tensor_parallel_size == 2
    assert "--tensor-parallel-size" not in worker_argv(WorkerSpec(role="decode"))


def test_worker_spec_rejects_zero():
    with pytest.raises(ValueError, match="--tensor-parallel-size must be a positive integer, got 0"):
        WorkerSpec(role="mixed", tensor_parallel_size=0)


def test_ray_actor_asks_for_every_rank():
    spec = WorkerSpec(role="prefill", worker_id="p0", tensor_parallel_size=3)
    options, (config,) = ray_actor(spec, EngineConfig(model=MODEL), namespace="n", num_cpus=1.0, num_gpus=1.0,
                                   resources={}, scheduling_strategy=None)
    assert (options["num_cpus"], options["num_gpus"]) == (3.0, 3.0)
    assert options["runtime_env"] is None  # Ray masks the devices to the worker's three GPUs
    assert config.engine.tensor_parallel_size == 3
    options1, _ = ray_actor(WorkerSpec(role="prefill", worker_id="p1"), EngineConfig(model=MODEL), namespace="n",
                            num_cpus=1.0, num_gpus=1.0, resources={}, scheduling_strategy=None)
    assert options1["num_gpus"] == 1.0 and options1["runtime_env"] is not None


def test_up_per_pool_sizes_and_bundles():
    config = load_up_config({"model": MODEL, "prefill_tp": 2, "decode": 2})
    assert (config.pool_tp("prefill"), config.pool_tp("decode"), config.num_ranks()) == (2, 1, 4)
    specs = {s.role: s for s in pool_specs(config, gpus_in_cluster=4.0)}
    assert specs["prefill"].engine.tensor_parallel_size == 2 and specs["prefill"].tensor_parallel_size == 2
    assert specs["prefill"].bundle() == {"CPU": 2.0, "GPU": 2.0}
    assert specs["decode"].bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert gpu_share(config, 4.0) == 1.0
    with pytest.raises(ValueError, match="4 workers need 4 GPU"):
        gpu_share(load_up_config({"model": MODEL, "tensor_parallel_size": 2, "worker_gpus": 1.0}), 3.0)


def test_up_flags_and_file(tmp_path):
    args = build_parser().parse_args(["up", "--model", MODEL, "-tp", "2", "--decode-tp", "1"])
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "log_level", "config")}
    config = load_up_config(flags)
    assert (config.pool_tp("prefill"), config.pool_tp("decode")) == (2, 1)
    path = tmp_path / "c.yaml"
    path.write_text("model: random:tiny-llama-tp\ndecode-tp: 2\n")
    assert load_up_config({}, str(path)).pool_tp("decode") == 2
    path.write_text("model: random:tiny-llama-tp\nprefill_tp: 0\n")
    with pytest.raises(ValueError, match="c.yaml: --prefill-tp: must be a positive integer"):
        load_up_config({}, str(path))
    with pytest.raises(ValueError, match="--decode-tp: applies to --mode disaggregated"):
        load_up_config({"model": MODEL, "mode": "colocated", "decode_tp": 2})


def test_checks_name_the_pool_flag():
    with pytest.raises(ValueError, match="^--decode-tp 4 does not divide the 6 attention heads"):
        check_tensor_parallel_pools(load_up_config({"model": MODEL, "decode_tp": 4}))
    with pytest.raises(ValueError, match="^--tensor-parallel-size 2 needs 2 GPUs, this machine has 1"):
        check_tensor_parallel_pools(load_up_config({"model": MODEL, "tensor_parallel_size": 2}), num_local_gpus=1)
    check_tensor_parallel_pools(load_up_config({"model": MODEL, "tensor_parallel_size": 3}))


@pytest.mark.parametrize("argv, message", [
    (["-tp", "4"], "--tensor-parallel-size 4 does not divide the 6 attention heads"),
    (["-tp", "0"], "argument -tp/--tensor-parallel-size: must be a positive integer, got 0"),
    (["--prefill-tp", "4"], "--prefill-tp 4 does not divide the 6 attention heads"),
])
def test_up_fails_in_one_line_before_ray(argv, message):
    from pdserve.loaders import default_model_path

    out = subprocess.run([sys.executable, "-m", "pdserve.launcher.cli", "up", "--model", "random:tiny-serve-tp",
                          "--tokenizer", default_model_path(), "--device", "cpu", *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "ray" not in out.stderr.lower()


def test_pool_spec_default_is_one_rank():
    assert PoolSpec(role="mixed", size=1, engine=EngineConfig()).bundle() == {"CPU": 1.0}


def test_placement_counts_a_tp_worker_as_one_unit_of_n_gpus():
    from pdserve.router.placement.base import WorkerSnapshot, least_loaded_key

    big = WorkerSnapshot("d-tp2", "decode", num_running=3, tensor_parallel_size=2)
    small = WorkerSnapshot("d-tp1", "decode", num_running=2)
    assert (big.num_gpus, small.num_gpus) == (2, 1)
    assert min((small, big), key=least_loaded_key) is big  # 1.5 requests per GPU against 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        WorkerSnapshot("x", "decode", tensor_parallel_size=0)


def test_sim_scales_a_tp_workers_step_times(tmp_path):
    from pdserve.sim.worker import TP_SERIAL_FRACTION, StepCosts, tp_step_scale

    assert tp_step_scale(1) == 1.0
    assert tp_step_scale(2) == pytest.approx(TP_SERIAL_FRACTION + (1 - TP_SERIAL_FRACTION) / 2)

    class Flat:
        has_mixed = False

        def prefill_seconds(self, n):
            return 0.001 * n

        def decode_step_seconds(self, batch, context):
            return 0.01

    one, four = StepCosts(Flat()), StepCosts(Flat(), tp=4)
    assert four.decode(8, 100) == pytest.approx(one.decode(8, 100) * tp_step_scale(4))
    assert four.prefill(100) == pytest.approx(one.prefill(100) * tp_step_scale(4))
