"""`python -m experiments.vs_vllm` end to end on the CPU, with the fake OpenAI server standing in for
both servers (vLLM's and pdserve's commands are templates): every workload runs against each, the
table has one row a workload with both servers' figures and their ratios, and bad flags are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_openai_server.py")


def model_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    vocab = {f"t{i}": i for i in range(200)} | {"[UNK]": 200}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_both_servers_every_workload_and_the_ratios(tmp_path):
    d = model_dir(tmp_path)
    out = tmp_path / "table.md"
    vllm = f"{sys.executable} {FAKE} --port {{port}} --ttft 0.004"
    ours = f"{sys.executable} {FAKE} --port {{port}} --ttft 0.002"
    proc = subprocess.run([sys.executable, "-m", "experiments.vs_vllm", "--shape", "tiny", "--model-dir", str(d),
                           "--vllm", vllm, "--pdserve", ours, "--batches", "1,2", "--decode-in", "8", "--decode-out",
                           "4", "--rates", "20", "--requests", "3", "--served-in", "16", "--served-out", "4",
                           "--seed", "7", "--out", str(out), "--startup-timeout-s", "60"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| decode") or " req/s |" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["decode batch 1, 8/4", "decode batch 2, 8/4", "16/4 at 20 req/s"]
    summaries = json.loads((tmp_path / "table" / "summaries.json").read_text())
    assert [s["num_ok"] for s in summaries["vllm"]] == [1, 2, 3]
    assert [s["num_ok"] for s in summaries["pdserve"]] == [1, 2, 3]
    ttft_ratio = float(rows[-1].split("|")[7].split("/")[0])
    assert ttft_ratio < 1.0  # the stand-in for pdserve answers its first token sooner


@pytest.mark.parametrize("extra, needle", [(["--model-dir", "/nonexistent"], "no config.json"),
                                           (["--batches", "0"], "must be positive")])
def test_bad_flags_are_named(tmp_path, extra, needle):
    argv = ["--shape", "tiny", "--model-dir", str(model_dir(tmp_path)), "--vllm", "x", "--seed", "1",
            "--out", str(tmp_path / "t.md"), *extra]
    proc = subprocess.run([sys.executable, "-m", "experiments.vs_vllm", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
