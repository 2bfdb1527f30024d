"""The planner loop over fakes (no Ray): it reads the router's pool and window, adds a worker of
the bound pool, drains the least loaded one and removes it only once empty, and counts every
decision in the metrics. Also the `autoscale` setting of `pdserve up`."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.launcher.autoscale import loop as loop_module
from pdserve.launcher.autoscale.loop import Autoscaler
from pdserve.launcher.autoscale.metrics import AutoscaleMetrics
from pdserve.launcher.autoscale.rule import AutoscaleConfig
from pdserve.launcher.autoscale.window import RequestWindow
from pdserve.launcher.cluster.config import load_up_config
from pdserve.proto import worker_pb2 as pb
from pdserve.router.cluster.directory import WorkerEndpoint
from pdserve.router.cluster.worker_pool import PooledWorker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def worker(name: str, role: str, running: int = 0, inflight: int = 0) -> PooledWorker:
    w = PooledWorker(WorkerEndpoint(name, role, "127.0.0.1:1"), client=None, healthy=True)
    w.stats = pb.StatsResponse(num_running=running, num_blocks=100, num_free_blocks=90)
    w.num_inflight = inflight
    return w


class FakeResizer:
    def __init__(self, backend) -> None:
        self.backend = backend
        self.specs = {"prefill": None, "decode": None}
        self.log: list[str] = []

    def add(self, role: str) -> str:
        name = f"{role}-new"
        self.backend.pool.workers[name] = worker(name, role)
        self.log.append(f"add {name}")
        return name

    def drain(self, name: str) -> None:
        self.log.append(f"drain {name}")

    def undrain(self, name: str) -> None:
        self.log.append(f"undrain {name}")

    def remove(self, name: str) -> None:
        del self.backend.pool.workers[name]
        self.log.append(f"remove {name}")

    def own_group(self, name: str) -> bool:
        return name.endswith("new")


def test_adds_the_bound_pool_then_drains_and_removes_an_idle_worker(monkeypatch):
    monkeypatch.setattr(loop_module, "DRAIN_POLL_S", 0.01)
    clock = Clock()
    backend = SimpleNamespace(pool=SimpleNamespace(workers={
        "p0": worker("p0", "prefill", running=1), "d0": worker("d0", "decode", running=4, inflight=4)}))
    window = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    registry = CollectorRegistry()
    resizer = FakeResizer(backend)
    config = AutoscaleConfig(cooldown_s=10, window_s=30, interval_s=5, down_stable=2, min_requests=3)
    scaler = Autoscaler(config, backend, window, resizer, max_num_seqs=8,
                        metrics=AutoscaleMetrics(registry, ("prefill", "decode")), clock=clock)

    async def scenario() -> list:
        decisions = []
        for _ in range(4):  # TPOT misses: decode-bound
            window.arrive()
            window.finish(0.5, 0.3)
        decisions.append(await scaler.step())
        clock.t += 1  # the worker took a second to start
        await scaler.wait_change()
        assert "decode-new" in backend.pool.workers and resizer.log == ["add decode-new"]
        # the load falls: good requests, nobody busy; after the cooldown and down_stable intervals
        backend.pool.workers["d0"].stats = pb.StatsResponse(num_blocks=100, num_free_blocks=100)
        backend.pool.workers["d0"].num_inflight = 0
        for _ in range(6):
            clock.t += 5
            window.finish(0.2, 0.01)
            decisions.append(await scaler.step())
            if decisions[-1].action == "remove":
                break
        # a request placed on it just before the drain began: the drain waits for it
        backend.pool.workers["decode-new"].num_inflight = 1
        await asyncio.sleep(0.1)
        assert backend.pool.workers["decode-new"].draining and "remove decode-new" not in resizer.log
        backend.pool.workers["decode-new"].num_inflight = 0  # its request ends
        await scaler.wait_change()
        assert (await scaler.step()).code == "cooldown"  # the gauges of the pools after the change
        return decisions

    decisions = asyncio.run(scenario())
    assert (decisions[0].action, decisions[0].pool, decisions[0].code) == ("add", "decode", "tpot_miss")
    assert decisions[1].code == "cooldown" and len(decisions) == 3  # calm counts through the cooldown
    assert (decisions[-1].action, decisions[-1].pool, decisions[-1].code) == ("remove", "decode", "idle")
    assert resizer.log == ["add decode-new", "drain decode-new", "remove decode-new"]  # own group first
    assert registry.get_sample_value("pdserve:autoscale_decisions_total",
                                     {"action": "add", "pool": "decode", "reason": "tpot_miss"}) == 1
    assert registry.get_sample_value("pdserve:autoscale_decisions_total",
                                     {"action": "remove", "pool": "decode", "reason": "idle"}) == 1
    assert registry.get_sample_value("pdserve:pool_workers", {"pool": "decode", "state": "serving"}) == 1
    assert registry.get_sample_value("pdserve:pool_workers", {"pool": "decode", "state": "draining"}) == 0
    assert registry.get_sample_value("pdserve:slo_attainment", {"slo": "both"}) == 1.0


def test_a_rising_load_adds_a_worker_before_any_miss():
    """The loop's load (requests in flight per worker, the router's count or the worker's queue
    and batch, averaged since the last change) reaches the rule: 4 in flight at the decode
    worker, every request within the SLO: it adds a decode worker on load, and the gauges show
    the figures."""
    clock = Clock()
    backend = SimpleNamespace(pool=SimpleNamespace(workers={
        "p0": worker("p0", "prefill", running=0, inflight=0), "d0": worker("d0", "decode", running=4, inflight=1)}))
    window = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    registry = CollectorRegistry()
    resizer = FakeResizer(backend)
    config = AutoscaleConfig(cooldown_s=10, window_s=30, interval_s=5, up_load=3, up_stable=2)
    scaler = Autoscaler(config, backend, window, resizer, max_num_seqs=8,
                        metrics=AutoscaleMetrics(registry, ("prefill", "decode")), clock=clock)

    async def scenario() -> list:
        decisions = []
        for _ in range(3):
            window.arrive()
            window.finish(0.2, 0.01)  # within the SLO
            decisions.append(await scaler.step())
            clock.t += 5
        await scaler.wait_change()
        return decisions

    decisions = asyncio.run(scenario())
    assert [d.code for d in decisions[:2]] == ["steady", "load_rising"]
    assert (decisions[1].action, decisions[1].pool) == ("add", "decode")
    assert "4.0 requests in flight per worker" in decisions[1].reason
    assert resizer.log == ["add decode-new"]
    assert registry.get_sample_value("pdserve:autoscale_decisions_total",
                                     {"action": "add", "pool": "decode", "reason": "load_rising"}) == 1
    assert registry.get_sample_value("pdserve:autoscale_pool_load", {"pool": "decode"}) is not None
    assert registry.get_sample_value("pdserve:autoscale_pool_busy", {"pool": "prefill"}) == 0.0


def test_up_config_autoscale(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("slo-ttft: 2\nautoscale:\n  min: {decode: 1}\n  max: {decode: 4}\n  cooldown: 15\n")
    config = load_up_config({"autoscale": True}, str(path))  # --autoscale keeps the file's settings
    assert (config.autoscale.max_workers["decode"], config.autoscale.cooldown_s) == (4, 15)
    assert load_up_config({}, None).autoscale is None
    assert load_up_config({"autoscale": False, "slo_tpot": 0.1}).autoscale is None
    with pytest.raises(ValueError, match="--autoscale: needs the SLOs"):
        load_up_config({"autoscale": True})
    path.write_text("slo-ttft: 2\nautoscale: 3\n")
    with pytest.raises(ValueError, match=r"cluster.yaml:2: field 'autoscale'"):
        load_up_config({}, str(path))
    path.write_text("slo-ttft: 2\nautoscale: {max: {decode: 0}}\n")
    with pytest.raises(ValueError, match=r"autoscale.max_workers: decode 0 is below"):
        load_up_config({}, str(path))


def test_a_hybrid_pool_shifts_a_worker_duty_instead_of_starting_one():
    clock = Clock()
    backend = SimpleNamespace(pool=SimpleNamespace(workers={
        f"m{i}": worker(f"m{i}", "mixed", running=3, inflight=i) for i in range(3)}))
    window = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    registry = CollectorRegistry()
    resizer = FakeResizer(backend)
    resizer.specs = {"mixed": SimpleNamespace(moves_kv=True)}
    duties: dict[str, str] = {}
    resizer.shift = lambda name, duty: (duties.__setitem__(name, duty), resizer.log.append(f"shift {name} {duty}"))
    config = AutoscaleConfig(cooldown_s=10, window_s=30, interval_s=5, min_requests=3)
    scaler = Autoscaler(config, backend, window, resizer, max_num_seqs=8,
                        metrics=AutoscaleMetrics(registry, ("mixed",)), clock=clock)

    async def scenario() -> list:
        for _ in range(4):  # TPOT misses: prefill chunks slow the decodes
            window.arrive()
            window.finish(0.5, 0.3)
        first = await scaler.step()
        assert scaler.observe().duties == {"decode": 1, "mixed": 2}  # counted by duty at once
        clock.t += 5
        return [first, await scaler.step()]

    decisions = asyncio.run(scenario())
    assert (decisions[0].action, decisions[0].source, decisions[0].pool) == ("shift", "mixed", "decode")
    assert decisions[1].code == "cooldown"
    assert resizer.log == ["shift m0 decode"] and duties == {"m0": "decode"}  # the least loaded; no process added
    assert backend.pool.workers["m0"].role == "decode" and backend.pool.workers["m0"].endpoint.role == "mixed"
    assert registry.get_sample_value("pdserve:autoscale_decisions_total",
                                     {"action": "shift", "pool": "decode", "reason": "shift_to_decode"}) == 1
    # the second decision saw the shift: one decode-duty worker, two mixed
    assert [registry.get_sample_value("pdserve:autoscale_duties", {"duty": d})
            for d in ("prefill", "mixed", "decode")] == [0.0, 2.0, 1.0]
    # a removal of a specialist (idle_specialist: the decision's source is the duty) drains one of that duty
    assert scaler.pick_to_remove("mixed", "decode") == "m0"
    assert scaler.pick_to_remove("mixed", "prefill") is None


def test_a_colocated_pool_has_no_duties():
    backend = SimpleNamespace(pool=SimpleNamespace(workers={"m0": worker("m0", "mixed")}))
    resizer = FakeResizer(backend)
    resizer.specs = {"mixed": SimpleNamespace(moves_kv=False)}
    scaler = Autoscaler(AutoscaleConfig(), backend, RequestWindow(1.0, 0.1), resizer, max_num_seqs=8)
    assert scaler.observe().duties == {}


class SpareResizer(FakeResizer):
    """FakeResizer with warm spares: `prepare_spare` starts one (not in the router's pool), `add`
    takes one first, `park` makes a drained worker one."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self._spares: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.started = 0

    def spares(self, role: str) -> list[str]:
        return list(self._spares[role])

    def prepare_spare(self, role: str, timeout_s: float | None = None) -> str:
        self.started += 1
        name = f"{role}-spare{self.started}"
        self._spares[role].append(name)
        self.log.append(f"spare {name}")
        return name

    def add(self, role: str) -> str:
        if not self._spares[role]:
            return super().add(role)
        name = self._spares[role].pop(0)
        self.backend.pool.workers[name] = worker(name, role)
        self.log.append(f"promote {name}")
        return name

    def park(self, name: str) -> None:
        role = self.backend.pool.workers.pop(name).endpoint.role
        self._spares[role].append(name)
        self.log.append(f"park {name}")


def test_warm_spares_are_started_taken_by_an_addition_replaced_and_parked(monkeypatch):
    monkeypatch.setattr(loop_module, "DRAIN_POLL_S", 0.01)
    clock = Clock()
    backend = SimpleNamespace(pool=SimpleNamespace(workers={
        "p0": worker("p0", "prefill"), "d0": worker("d0", "decode")}))
    window = RequestWindow(slo_ttft=1.0, slo_tpot=0.1, clock=clock)
    registry = CollectorRegistry()
    resizer = SpareResizer(backend)
    # decode: one spare wanted, room for it (max 3); prefill: two wanted, but its max (2) leaves room for one
    config = AutoscaleConfig(spares={"decode": 1, "prefill": 2}, max_workers={"prefill": 2, "decode": 3})
    scaler = Autoscaler(config, backend, window, resizer, max_num_seqs=8,
                        metrics=AutoscaleMetrics(registry, ("prefill", "decode")), clock=clock)

    async def scenario() -> None:
        scaler.replenish_spares()
        await scaler._spares_task
        assert resizer.log == ["spare prefill-spare1", "spare decode-spare2"]
        assert registry.get_sample_value("pdserve:pool_workers", {"pool": "decode", "state": "spare"}) == 1
        scaler.replenish_spares()  # nothing more is wanted
        await scaler._spares_task
        assert resizer.started == 2

        from pdserve.launcher.autoscale.rule import Decision
        await scaler._add(Decision("add", "decode", "tpot_misses", "test"))
        assert resizer.log[2] == "promote decode-spare2" and "decode-spare2" in backend.pool.workers
        await scaler._spares_task  # the spare taken is replaced
        assert resizer.log[3] == "spare decode-spare3"
        await scaler._add(Decision("add", "decode", "tpot_misses", "test"))  # max 3: d0, spare2, spare3
        await scaler._spares_task
        assert resizer.spares("decode") == [] and resizer.started == 3  # no room for another

        backend.pool.workers["decode-spare3"].stats = pb.StatsResponse(num_blocks=100, num_free_blocks=100)
        await scaler.drain_and_remove("decode-spare3")  # the pool wants a spare and has none: parked
        assert resizer.log[-2:] == ["drain decode-spare3", "park decode-spare3"]
        assert resizer.spares("decode") == ["decode-spare3"]
        assert registry.get_sample_value("pdserve:pool_workers", {"pool": "decode", "state": "spare"}) == 1
        await scaler.drain_and_remove("decode-spare2")  # it has one: removed
        assert resizer.log[-2:] == ["drain decode-spare2", "remove decode-spare2"]

    asyncio.run(scenario())


def test_up_load_auto_reads_the_autoscale_profile_and_names_a_bad_one(tmp_path):
    from pdserve.launcher.cluster.up import _autoscale_profile

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({
        "version": 1, "hardware": {"device": "cpu", "name": "test"}, "model": "m", "dtype": "float32",
        "num_layers": 2, "kv_bytes_per_token": 1024, "block_size": 16, "max_num_batched_tokens": 512,
        "prefill": {"tokens": [16, 256], "seconds": [0.01, 0.1]},
        "decode": {"batch_sizes": [1, 64], "contexts": [128], "seconds": [[0.02], [0.3]]}}))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"slo-tpot: 0.1\nautoscale:\n  up_load: auto\n  profile: {profile}\n")
    config = load_up_config({}, str(path))
    assert config.autoscale.up_load == "auto" and config.autoscale.profile == str(profile)
    loaded = _autoscale_profile(config)
    assert list(loaded.decode_batch_sizes) == [1, 64]
    assert _autoscale_profile(load_up_config({"autoscale": True, "slo_tpot": 0.1})) is None  # no profile
    path.write_text(f"slo-tpot: 0.1\nautoscale:\n  up_load: auto\n  profile: {tmp_path / 'missing.json'}\n")
    with pytest.raises(ValueError, match=r"autoscale.profile: .*missing.json"):
        _autoscale_profile(load_up_config({}, str(path)))
    path.write_text("slo-tpot: 0.1\nautoscale:\n  profile: ''\n")
    with pytest.raises(ValueError, match=r"autoscale.profile: must be the path"):
        load_up_config({}, str(path))
