"""The pusher's plan (pdserve.worker.kv_push): which blocks go after each layer, at which
precision. A chunked prompt pushes each block once per layer; an FP8 transfer sends its first
block (the attention sink's) at full precision and the rest in FP8."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.kvtransfer.layout import FP8_FULL_HEAD_BLOCKS
from pdserve.scheduler import ScheduledBatch
from pdserve.worker.kv_push import Destination, KVPusher

BS, LAYERS = 4, 2


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send_layer(self, address, transfer_id, layer, src, dst, precision="full") -> None:
        self.sent.append((layer, tuple(src), tuple(dst), precision))


def seq(prompt_tokens: int, computed: int) -> SimpleNamespace:
    blocks = -(-prompt_tokens // BS)
    return SimpleNamespace(request_id="r", num_computed_tokens=computed, num_prompt_tokens=prompt_tokens,
                           block_ids=[100 + i for i in range(blocks)])


def step(pusher: KVPusher, s, num_new: int) -> None:
    batch = ScheduledBatch(seqs=[s], num_new_tokens=[num_new])
    for layer in range(LAYERS):
        pusher.on_layer(layer, batch)
    s.num_computed_tokens += num_new


def test_fp8_sends_the_head_block_at_full_precision_across_chunks():
    assert FP8_FULL_HEAD_BLOCKS == 1
    sender = Recorder()
    pusher = KVPusher(sender, BS, LAYERS)
    pusher.add("r", Destination("a", "t", [10, 11, 12, 13], precision="fp8"))
    s = seq(14, 0)
    step(pusher, s, 9)  # blocks 0 and 1 complete
    assert sender.sent == [(0, (100,), (10,), "full"), (0, (101,), (11,), "fp8"),
                           (1, (100,), (10,), "full"), (1, (101,), (11,), "fp8")]
    sender.sent.clear()
    step(pusher, s, 5)  # the rest, the partial last block too: no second head
    assert sender.sent == [(0, (102, 103), (12, 13), "fp8"), (1, (102, 103), (12, 13), "fp8")]


def test_full_precision_is_one_push_and_a_one_block_fp8_transfer_is_all_full():
    sender = Recorder()
    pusher = KVPusher(sender, BS, LAYERS)
    pusher.add("r", Destination("a", "t", [10, 11], precision="full"))
    step(pusher, seq(8, 0), 8)
    assert sender.sent == [(0, (100, 101), (10, 11), "full"), (1, (100, 101), (10, 11), "full")]
    sender = Recorder()
    pusher = KVPusher(sender, BS, LAYERS)
    pusher.add("r", Destination("a", "t", [10], precision="fp8"))
    step(pusher, seq(3, 0), 3)
    assert sender.sent == [(0, (100,), (10,), "full"), (1, (100,), (10,), "full")]


def test_wire_precision_names_what_the_bytes_were():
    from pdserve.kvtransfer import KVLayout
    from pdserve.worker.kv_push import wire_precision

    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    full = 2 * layout.layer_message_bytes(4)
    fp8 = 2 * (layout.layer_message_bytes(1) + layout.layer_message_bytes(3, "fp8"))
    assert wire_precision(layout, "fp8", 4, fp8) == ("fp8", full - fp8)
    assert wire_precision(layout, "fp8", 4, full) == ("full", 0)  # a backend that moved the pool's bytes
    assert wire_precision(layout, "fp8", 1, full // 4) == ("full", 0)  # one block: the head, at full precision
    assert wire_precision(layout, "full", 4, full) == ("full", 0)
