"""experiments/autoscale_step.py's arguments and the `pdserve up` command it builds, for cpu and
cuda (no GPU needed: the command is parsed by pdserve's own parser and made an UpConfig)."""

from __future__ import annotations

import json
import tarfile

import pytest

from experiments import autoscale_step as step
from pdserve.launcher.cli import build_parser
from pdserve.launcher.cluster.config import load_up_config


def up_config(args, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"autoscale": step.autoscale_settings(args)}))
    cmd = step.up_command(args, str(path))
    assert cmd[:3] == ["-m", "pdserve.launcher.cli", "up"]
    ns = build_parser().parse_args(cmd[2:])
    flags = {k: v for k, v in vars(ns).items() if k not in ("command", "func", "log_level", "config")}
    return cmd, load_up_config(flags, ns.config)


def test_cpu_command(tmp_path):
    cmd, config = up_config(step.parse_args([]), tmp_path)
    assert config.device == "cpu" and config.worker_gpus == 0 and config.worker_cpus == 0.25
    assert config.kv_cache_gib == 0.3 and "--gpu-memory-fraction" not in cmd and "--dtype" not in cmd
    assert config.autoscale.max_workers["decode"] == 3 and config.autoscale.up_load == 4.0


def test_cuda_command(tmp_path):
    args = step.parse_args(["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-fraction", "0.1",
                            "--max-workers", "2", "--worker-gpus", "0.25", "--up-load", "8"])
    cmd, config = up_config(args, tmp_path)
    assert (config.device, config.dtype, config.worker_gpus, config.gpu_memory_fraction) == (
        "cuda", "bfloat16", 0.25, 0.1)
    assert "--kv-cache-gib" not in cmd and "--worker-cpus" not in cmd  # pdserve up's defaults on cuda
    assert config.autoscale.max_workers == {"prefill": 2, "decode": 2, "mixed": 4} and config.autoscale.up_load == 8
    # the default share: 1/(2M), in Ray's two decimals
    assert step.parse_args(["--device", "cuda"]).worker_gpus == 0.16


@pytest.mark.parametrize("argv", [["--device", "cuda", "--worker-gpus", "0.2"],  # 6 workers at max 3: > 1/6
                                  ["--device", "cuda", "--worker-gpus", "0"],
                                  ["--device", "cuda", "--gpu-memory-fraction", "1.5"],
                                  ["--worker-gpus", "0.1"],  # cuda only
                                  ["--gpu-memory-fraction", "0.1"]])
def test_refused(argv):
    with pytest.raises(SystemExit):
        step.parse_args(argv)


def test_pack_takes_what_exists(tmp_path):
    log = tmp_path / "up.log"
    log.write_text("pdserve up: ...")
    out = tmp_path / "step.tar.gz"
    step.pack(str(out), [str(tmp_path / "missing.json"), None, str(log)])
    with tarfile.open(out) as tar:
        assert tar.getnames() == ["up.log"]


def test_hybrid_command(tmp_path):
    cmd, config = up_config(step.parse_args(["--mode", "hybrid", "--max-workers", "2"]), tmp_path)
    assert (config.mode, config.replicas) == ("hybrid", 2) and "--prefill" not in cmd
    assert config.autoscale.min_workers["mixed"] == 2 and config.autoscale.max_workers["mixed"] == 4


def test_changes_and_duties_from_the_decision_counters():
    samples = [{"t": 1.0, "workers": {"mixed": 2}, "draining": {}, "decisions": {}},
               {"t": 3.0, "workers": {"mixed": 2}, "draining": {}, "decisions": {"shift decode shift_to_decode": 1}},
               {"t": 5.0, "workers": {"mixed": 3}, "draining": {},
                "decisions": {"shift decode shift_to_decode": 1, "add mixed slo_miss": 1}},
               {"t": 7.0, "workers": {"mixed": 2}, "draining": {},
                "decisions": {"shift decode shift_to_decode": 1, "add mixed slo_miss": 1,
                              "remove mixed idle": 1}},
               {"t": 9.0, "workers": {"mixed": 2}, "draining": {},
                "decisions": {"shift decode shift_to_decode": 1, "add mixed slo_miss": 1, "remove mixed idle": 1,
                              "shift mixed relax_to_mixed": 1}}]
    assert step.changes(samples) == [{"t": 3.0, "decision": "shift decode shift_to_decode", "n": 1},
                                     {"t": 5.0, "decision": "add mixed slo_miss", "n": 1},
                                     {"t": 7.0, "decision": "remove mixed idle", "n": 1},
                                     {"t": 9.0, "decision": "shift mixed relax_to_mixed", "n": 1}]
    assert [step.specialists(s) for s in samples] == [0, 1, 1, 1, 0]
    assert [step.settled(s) for s in samples] == [True, False, False, False, True]


def test_specialists_from_the_duties_gauge_and_an_idle_specialist_removed():
    # the gauge when the scrape has it
    assert step.specialists({"decisions": {"shift decode shift_to_decode": 2},
                             "duties": {"prefill": 0, "mixed": 2, "decode": 1}}) == 1
    # a record without it: the counters, a removed idle specialist taking one
    sample = {"t": 1.0, "workers": {"mixed": 2}, "draining": {},
              "decisions": {"shift decode shift_to_decode": 2, "add mixed slo_miss": 2,
                            "remove mixed idle_specialist": 2}}
    assert step.specialists(sample) == 0 and step.settled(sample)
    text = ('# TYPE pdserve:autoscale_duties gauge\npdserve:autoscale_duties{duty="decode"} 1.0\n'
            'pdserve:autoscale_duties{duty="mixed"} 2.0\n'
            '# TYPE pdserve:pool_workers gauge\npdserve:pool_workers{pool="mixed",state="spare"} 1.0\n')
    scraped = step.scrape(text)
    assert scraped["duties"] == {"decode": 1.0, "mixed": 2.0} and scraped["spares"] == {"mixed": 1.0}
    assert scraped["draining"] == {}  # a spare is not draining


def test_context_and_engine_budget_reach_pdserve_up(tmp_path):
    args = step.parse_args(["--device", "cuda", "--prompt-tokens", "3072", "--max-tokens", "32",
                            "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--max-num-seqs", "64"])
    cmd, config = up_config(args, tmp_path)
    assert config.max_model_len == 4096
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (1024, 64)
    cmd, _ = up_config(step.parse_args([]), tmp_path)  # the engine's defaults unless asked
    assert "--max-num-batched-tokens" not in cmd and "--max-num-seqs" not in cmd


@pytest.mark.parametrize("argv", [["--prompt-tokens", "500", "--max-tokens", "48"],  # over the default 512
                                  ["--prompt-tokens", "3072", "--max-model-len", "3000"],
                                  ["--prompt-tokens", "0"]])
def test_requests_that_do_not_fit_the_context_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        step.parse_args(argv)
    assert "--" in capsys.readouterr().err


def test_summary_says_how_far_the_client_fell_behind():
    args = step.parse_args(["--phases", "10,10,10"])
    requests = [{"arrival": 1.0 + i, "lag": lag, "ttft": 0.1, "tpot": 0.01, "status": "ok", "end": 2.0 + i}
                for i, lag in enumerate([0.001, 0.002, 0.5, 3.0])]
    summary = step.summarize(requests, [], [], args)
    assert summary["sender_lag_max_s"] == 3.0 and summary["sender_lag_p99_s"] == 3.0
    old = [{k: v for k, v in r.items() if k != "lag"} for r in requests]  # a record from before the field
    assert step.summarize(old, [], [], args)["sender_lag_max_s"] is None
