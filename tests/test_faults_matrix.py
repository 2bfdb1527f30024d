"""experiments/faults.py without a cluster: its device flags (CPU by default, one shared GPU on
request), the slow-link row's placement phases, and the results folder it packs."""

import tarfile

from experiments import faults
from pdserve.loadgen.records import RequestRecord


def test_cpu_defaults():
    args = faults.parse_args(["--only", "kv-loss"])
    assert (args.device, args.dtype, args.worker_gpus, args.gpu_memory_fraction) == ("cpu", None, None, None)
    argv = faults.worker_argv(args, "prefill", 5000)
    assert argv[argv.index("--model") + 1] == "smollm2"
    assert argv[-4:] == ["--kv-cache-gib", "0.25", "--device", "cpu"]
    assert faults.device_flags(args) == ["--device", "cpu"]
    nixl = faults.parse_args(["--only", "kv-loss", "--kv-backend", "nixl"])
    assert faults.device_flags(nixl) == ["--device", "cpu", "--kv-backend", "nixl"]


def test_one_gpu_shared():
    args = faults.parse_args(["--model", "random:llama-3.2-1b", "--device", "cuda", "--dtype", "bfloat16"])
    assert (args.worker_gpus, args.gpu_memory_fraction) == (0.25, 0.1)
    argv = faults.worker_argv(args, "decode", 5001, 6001)
    assert argv[argv.index("--model") + 1] == "random:llama-3.2-1b"
    assert argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--gpu-memory-fraction") + 1] == "0.1"
    explicit = faults.parse_args(["--device", "cuda", "--worker-gpus", "0.5", "--gpu-memory-fraction", "0.2"])
    assert (explicit.worker_gpus, explicit.gpu_memory_fraction) == (0.5, 0.2)


def _record(i, sent_s, placement, p=None, d="decode-0", attempts=1):
    return RequestRecord(index=i, request_id=str(i), scheduled_s=sent_s, sent_s=sent_s, status=200, e2e_s=1.0,
                         server_timing={"placement": placement, "prefill_worker": p, "decode_worker": d,
                                        "attempts": attempts})


def test_placements_by_phase():
    start, fault, learned = 1000.0, 1010.0, 1020.0
    records = [
        _record(0, 1, "disaggregated", "prefill-0"), _record(1, 3, "disaggregated", "prefill-1"),
        _record(2, 5, "local"),
        _record(3, 11, "local", attempts=2),  # first placed on the slow pair, fell back
        _record(4, 13, "disaggregated", "prefill-1"),
        _record(5, 21, "disaggregated", "prefill-1"), _record(6, 23, "local"),
    ]
    got = faults.placements_by_phase(records, start, [("before", fault), ("until", learned), ("after", None)],
                                     ("prefill-0", "decode-0"))
    assert got["before"] == {"prefill-0->decode-0": 1, "prefill-1->decode-0": 1, "local decode-0": 1,
                             "slow_pair_share": 0.33}
    assert got["until"] == {"prefill-0->decode-0 (fell back)": 1, "prefill-1->decode-0": 1, "slow_pair_share": 0.5}
    assert got["after"] == {"prefill-1->decode-0": 1, "local decode-0": 1, "slow_pair_share": 0.0}
    # the first miss never seen: every request after the fault falls in the middle phase
    unknown = faults.placements_by_phase(records, start, [("before", fault), ("until", None), ("after", None)],
                                         ("prefill-0", "decode-0"))
    assert sum(v for k, v in unknown["until"].items() if k != "slow_pair_share") == 4
    assert unknown["after"] == {"slow_pair_share": None}


def test_results_folder_packs(tmp_path):
    out = tmp_path / "faults-gpu"
    (out / "kv-loss").mkdir(parents=True)
    (out / "kv-loss" / "router.log").write_text("serving\n")
    row = {"fault": "kv-loss", "sent": 2, "completed": 2, "failed": {}, "lost": 0, "hung": 0,
           "kv_in_use": {"prefill-0": 0.0, "decode-0": 0.0}, "service_back_s": 0.0, "healthy_again_s": None,
           "note": {"router_recoveries": {}}}
    report = {"command": "python -m experiments.faults --only kv-loss", "machine": "test", "rows": [row],
              "not_run": ["gcs-kill"]}
    tar = tmp_path / "faults-gpu.tar.gz"
    faults.write_results(out, report, str(tar))
    with tarfile.open(tar) as f:
        names = set(f.getnames())
    assert {"faults-gpu/rows.json", "faults-gpu/table.md", "faults-gpu/kv-loss/router.log"} <= names
    table = (out / "table.md").read_text()
    assert "| kv-loss | 2 | 2 | 0 | 0 | 0 | prefill-0: 0, decode-0: 0 | 0.0 | - |" in table
    assert "not run (--time-budget-s): gcs-kill" in table
    assert not (tmp_path / "faults-gpu.tar.gz.part").exists()
