"""The README's examples with the official openai client, run as a user would against a live
router: a prefill and a decode worker in this process (real engines, the embedded SmolLM2, KV
over the in-process backend) behind the real app. What they print must be the model's text
only: no `None`, no usage object, no timing dump."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "http://localhost:8000/v1"
SERVED = "smollm2"  # the model id the README's examples ask for


def openai_examples(text: str) -> list[str]:
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    return [b for b in blocks if re.search(r"^\s*(from openai import|import openai)", b, flags=re.M)]


def check_clean(output: str) -> None:
    """What a README example prints: text, no Python reprs of missing or extension fields."""
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines, "the example printed nothing"
    for bad in ("None", "pdserve_timing", "usage", "CompletionUsage", "prompt_tokens"):
        assert bad not in output, f"the example printed {bad!r}:\n{output}"


@pytest.mark.parametrize("output", ["Paris\nNone\n", "Paris\nParis\nCompletionUsage(completion_tokens=3, "
                                    "prompt_tokens=9, total_tokens=12, pdserve_timing=[{'index': 0}])\n", "\n"])
def test_check_clean_catches_what_the_old_example_printed(output):
    with pytest.raises(AssertionError):
        check_clean(output)


@pytest.fixture(scope="module")
def router_url():
    from pdserve.launcher.cluster.serving import RouterSettings, build_app, load_router_model, make_router_policy
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.worker.server import WorkerConfig, WorkerServer
    from pdserve.router.cluster.directory import StaticDirectory
    from tests.router.conftest import ServerThread

    workers = []
    try:
        for role in ("prefill", "decode"):
            engine = EngineConfig(model=SERVED, device="cpu", cache=CacheConfig(cpu_kv_gib=0.05),
                                  scheduler=SchedulerConfig(role=role))
            worker = WorkerServer(WorkerConfig(f"{role}-0", role, engine, kv_backend="fake"))
            workers.append(worker)
        directory = StaticDirectory.parse([f"{w.config.role}#{w.config.worker_id}={w.start()}" for w in workers])
        settings = RouterSettings(model=SERVED, served_model_name=SERVED)
        model = load_router_model(SERVED, served_model_name=SERVED)
        app, _ = build_app(directory, settings, model, make_router_policy(settings))
        with ServerThread(app) as server:
            yield server.url + "/v1"
    finally:
        for worker in workers:
            worker.stop(0.5)


def test_the_readme_has_openai_examples():
    examples = openai_examples(README.read_text())
    assert examples, "no ```python block with the openai client in README.md"
    assert all(README_URL in code for code in examples), f"every openai example points at {README_URL}"
    assert any("stream=True" in code for code in examples), "the README shows streaming"


@pytest.mark.parametrize("index", range(len(openai_examples(README.read_text()))))
def test_readme_openai_example_prints_clean_text(router_url, index):
    code = openai_examples(README.read_text())[index].replace(README_URL, router_url)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    check_clean(run.stdout)
    # the reply and the stream each print a line of the model's text
    assert len([line for line in run.stdout.splitlines() if line.strip()]) >= 2, run.stdout
