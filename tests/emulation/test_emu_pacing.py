"""Pacing spec parsing, and the achieved rate of paced KV transfers (within 5%)."""

import statistics
import subprocess
import time

import pytest
import torch

from pdserve import kvtransfer
from pdserve.config import EngineConfig
from pdserve.launcher.emulation.kvprobe import make_caches, measure, num_blocks_for
from pdserve.kvtransfer.pacing_spec import (
    PACER_OPTION,
    PacingSpec,
    PatternPacer,
    build_pacer,
    parse_pacing,
    sender_options,
)


def test_parse_full_spec():
    spec = parse_pacing(" ucx://10.0.0.2:* = 1, 10.0.0.3=25 ,default=100,burst=4MiB")
    assert spec == PacingSpec((("ucx://10.0.0.2:*", 1.0), ("ucx://10.0.0.3:*", 25.0)), 100.0, 4 << 20)
    assert parse_pacing(str(spec)) == spec
    assert parse_pacing("default=10") == PacingSpec((), 10.0)
    assert parse_pacing("burst=64k,ucx://h:5000=2").burst_bytes == 64000


@pytest.mark.parametrize("text, message", [
    ("", "non-empty"),
    ("10.0.0.2", "TARGET=GBPS"),
    ("default=0", "> 0"),
    ("default=fast", "not a number"),
    ("default=inf", "> 0"),
    ("default=1,default=2", "given twice"),
    ("ucx://10.0.0.2=1", "HOST:PORT"),
    ("10.0.0.0/24=1", "bare HOST"),
    ("burst=-1", "burst"),
    ("ucx://h:abc=1", "bad port"),
])
def test_parse_errors_name_the_entry(text, message):
    with pytest.raises(ValueError, match=message):
        parse_pacing(text)


def test_routing_first_match_then_default():
    pacer = build_pacer("ucx://10.0.0.2:5*=1,10.0.0.2=2,default=10")
    assert pacer.bucket_for("ucx://10.0.0.2:5000").rate_gbps == 1.0
    assert pacer.bucket_for("ucx://10.0.0.2:6000").rate_gbps == 2.0
    assert pacer.bucket_for("ucx://10.0.0.9:5000").rate_gbps == 10.0
    # addresses matching one entry share its bucket (one link)
    assert pacer.bucket_for("ucx://10.0.0.2:6001") is pacer.bucket_for("ucx://10.0.0.2:6000")
    assert build_pacer("10.0.0.2=1").bucket_for("ucx://10.0.0.3:1") is None  # no default: not paced


def test_nixl_addresses_are_paced_by_host_and_port():
    """A NIXL receiver's address ends in its agent's name, which a restart changes (as a "#id"
    does a UCX one): an entry names nixl://HOST:PORT and matches whatever agent is there."""
    spec = parse_pacing("nixl://10.0.0.2:7000=1,nixl://10.0.0.3:*=5")
    assert parse_pacing(str(spec)) == spec
    pacer = build_pacer(spec)
    assert pacer.bucket_for("nixl://10.0.0.2:7000/pdserve-recv-1-ab").rate_gbps == 1.0
    assert pacer.bucket_for("nixl://10.0.0.2:7000/pdserve-recv-2-cd") is pacer.bucket_for("nixl://10.0.0.2:7000/x")
    assert pacer.bucket_for("nixl://10.0.0.3:9/a#1").rate_gbps == 5.0
    assert pacer.bucket_for("ucx://10.0.0.2:7000") is None and pacer.bucket_for("nixl://10.0.0.2:7001/a") is None
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_pacing("nixl://10.0.0.2=1")


def test_worker_options():
    opts = sender_options(((PACER_OPTION, "default=3"), ("max_inflight", 8)))
    assert isinstance(opts[PACER_OPTION], PatternPacer) and opts["max_inflight"] == 8
    assert sender_options(()) == {}


def test_worker_server_builds_the_pacer_from_kv_options(monkeypatch):
    """WorkerServer turns a ("pacer", SPEC) kv_option into a pacer for its sender and
    keeps it away from a decode worker's receiver."""
    import pdserve.worker.kv_plane as kv_plane
    import pdserve.worker.server as server

    seen = {}

    class Stub:
        def address(self):
            return "fake://stub"

    def recorder(side):
        return lambda backend, caches, **opts: (seen.setdefault(side, opts), Stub())[1]

    monkeypatch.setattr(kv_plane, "create_sender", recorder("send"))
    monkeypatch.setattr(kv_plane, "create_receiver", recorder("recv"))
    monkeypatch.setattr(kv_plane, "KVPusher", lambda *a: type("P", (), {"on_layer": None})())

    class Engine:  # the smallest engine WorkerServer.__init__ needs
        def __init__(self, config):
            self.config = config
            self.runner = type("R", (), {"kv_caches": make_caches(2)})()
            self.rank_kv_caches = None  # TP=1: the runner's pools are every KV head
            caches = self.runner.kv_caches
            self.model_config = type("M", (), {"num_layers": 30, "name": "stub", "architecture": "llama",
                                               "intermediate_size": 64, "num_heads": caches[0][0].shape[-2],
                                               "num_kv_heads": caches[0][0].shape[-2], "has_dense_layers": True,
                                               "moe": None})()

    monkeypatch.setattr(server, "LLMEngine", Engine)
    monkeypatch.setattr(server, "EngineLoop", lambda engine, name: None)
    for role in ("prefill", "decode"):  # warmup=False: the stub engine has nothing to warm up
        server.WorkerServer(server.WorkerConfig(worker_id=role, role=role, kv_backend="fake",
                                                engine=EngineConfig(warmup=False),
                                                kv_options=((PACER_OPTION, "default=2"),)))
    assert seen["send"][PACER_OPTION].bucket_for("fake://x").rate_gbps == 2.0
    assert PACER_OPTION not in seen["recv"]


def _paced_fake_rate(gbps: float, mb: float) -> float:
    """KV bytes / seconds through the in-process backend (no transport limit) at ``gbps``."""
    blocks = num_blocks_for(mb)
    ids = list(range(blocks))
    src, dst = make_caches(blocks, fill=True), make_caches(blocks)
    rates = []
    with kvtransfer.create_receiver("fake", dst) as receiver, \
            kvtransfer.create_sender("fake", src, pacer=build_pacer(f"default={gbps:g}")) as sender:
        for i in range(3):
            tid = f"t{i}"
            receiver.expect(tid, ids, len(src), 60)
            start = time.perf_counter()
            for layer in range(len(src)):
                sender.send_layer(receiver.address(), tid, layer, ids, ids)
            result = sender.finish(tid, 60)
            rates.append(result.num_bytes * 8 / (time.perf_counter() - start) / 1e9)
            receiver.wait(tid, 60)
            time.sleep(0.01)
    assert torch.equal(dst[5][1][: blocks], src[5][1][: blocks])
    return statistics.median(rates)


def test_token_bucket_holds_10_gbps_schedule():
    """The pacer alone (real clock and sleeps, no copies): 300 MB in 30 messages at 10 Gbit/s."""
    pacer = build_pacer("default=10")
    message = 10_000_000
    start = time.perf_counter()
    for _ in range(30):
        pacer.acquire("ucx://10.0.0.2:1", message)
    elapsed = time.perf_counter() - start
    rate = (30 * message - pacer.spec.burst_bytes) * 8 / elapsed / 1e9  # the burst goes unpaced
    assert abs(rate / 10 - 1) <= 0.05, rate


@pytest.mark.parametrize("gbps, mb", [(1.0, 60), (10.0, 300)])
def test_pacing_rate_within_5_percent_in_process(gbps, mb):
    """Real bytes through the in-process backend (gather, copy, scatter: no transport)."""
    if gbps > 1:
        ceiling = _paced_fake_rate(1000.0, mb)
        if ceiling < 2 * gbps:
            pytest.skip(f"in-process KV copies top out at {ceiling:.2f} Gbit/s on this host; the copies and "
                        f"the paced sleeps share its cores, so {gbps:g} Gbit/s needs >= 2x headroom")
    rate = _paced_fake_rate(gbps, mb)
    assert abs(rate / gbps - 1) <= 0.05, f"paced at {gbps} Gbit/s, achieved {rate:.3f}"


def _ucx_rate(pacing: str | None, mb: float) -> list[float]:
    def spawn(side, argv):
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return measure(spawn, "127.0.0.1", mb, 3, pacing=pacing, timeout_s=60)["send_gbps"]


@pytest.mark.parametrize("gbps", [1.0, 10.0])
def test_pacing_rate_within_5_percent_over_ucx(gbps):
    """Two processes on this host, UCX (shared memory / TCP, whichever UCX picks)."""
    if gbps > 1:
        ceiling = max(_ucx_rate(None, 300))
        if ceiling < 1.5 * gbps:
            pytest.skip(f"UCX between two processes carries only {ceiling:.2f} Gbit/s on this host "
                        f"(CPU-bound); pacing can only slow it, so {gbps:g} Gbit/s is not reachable here")
    rates = _ucx_rate(f"default={gbps:g}", gbps * 1e9 / 8 / 1e6)  # ~1 s per transfer
    assert abs(statistics.median(rates) / gbps - 1) <= 0.05, f"paced at {gbps} Gbit/s, achieved {rates}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_measure_plan_several_rates_in_one_pair_of_processes(tmp_path):
    """benchmarks/bench_pacing.py's path: the unpaced ceiling and two rates measured by one pair
    of kvprobe processes; each rate's transfers start on a drained bucket, so the achieved rate
    (first send_layer to ACK) and the link-bound rate both read the SET rate, not rate + burst."""
    import importlib

    from pdserve.launcher.emulation.kvprobe import measure_plan, parse_plan

    def spawn(side, argv):
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    start = time.monotonic()
    # three transfers a rate: the median then holds against one transfer that found the bucket
    # not quite drained (CI once saw 0.281 and 0.250 Gbit/s at 0.25: a median of two is their mean)
    results = measure_plan(spawn, "127.0.0.1", [(5.0, None), (2.5, "default=0.1"), (6.25, "default=0.25")], 3,
                           timeout_s=60)
    assert time.monotonic() - start < 30
    assert [len(r["send_gbps"]) for r in results] == [3, 3, 3]
    assert results[0]["link_gbps"] == [None, None, None]  # unpaced: no link-bound figure
    for result, gbps in zip(results[1:], (0.1, 0.25)):
        assert statistics.median(result["send_gbps"]) == pytest.approx(gbps, rel=0.05), result
        assert statistics.median(result["link_gbps"]) == pytest.approx(gbps, rel=0.05), result
    with pytest.raises(ValueError, match="--plan"):
        parse_plan('[[0, "default=1"]]')

    bench = importlib.import_module("benchmarks.bench_pacing")
    assert bench.main(["--device", "cpu", "--rates", "0.2", "--transfers", "1", "--seconds", "0.1",
                       "--ceiling-mb", "3"]) == 0
