"""`random:` shapes of Qwen3 and the mixture-of-experts families: their parameter counts are the
published ones (the model cards' totals), and the per-token KV bytes follow head_dim."""

from __future__ import annotations

import math

import pytest

from pdserve.loaders.layout import expected_weight_shapes
from pdserve.loaders.random_weights import RANDOM_SHAPES


@pytest.mark.parametrize("name, billions", [
    ("qwen3-0.6b", 0.6), ("qwen3-8b", 8.2), ("qwen3-32b", 32.8),
    ("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5), ("olmoe-1b-7b", 6.9),
])
def test_parameter_counts_are_the_published_ones(name, billions):
    total = sum(math.prod(shape) for shape in expected_weight_shapes(RANDOM_SHAPES[name]).values())
    assert total / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize("name, active_billions", [("qwen3-30b-a3b", 3.3), ("olmoe-1b-7b", 1.3),
                                                   ("mixtral-8x7b", 12.9)])
def test_active_parameters_per_token(name, active_billions):
    c = RANDOM_SHAPES[name]
    shapes = expected_weight_shapes(c)
    per_expert = sum(math.prod(s) for n, s in shapes.items() if ".experts.0." in n and ".layers.0." in n)
    experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    total = sum(math.prod(s) for s in shapes.values())
    active = total - experts + per_expert * c.moe.top_k * len(c.moe.layers)
    assert active / 1e9 == pytest.approx(active_billions, rel=0.03)


def test_qwen3_kv_bytes_follow_head_dim():
    c = RANDOM_SHAPES["qwen3-0.6b"]  # 16 heads of 128 on a hidden size of 1024
    assert c.q_size == 2048 != c.hidden_size
    assert c.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2
    moe = RANDOM_SHAPES["qwen3-30b-a3b"]
    assert moe.kv_bytes_per_token(2) == 2 * 48 * 4 * 128 * 2
