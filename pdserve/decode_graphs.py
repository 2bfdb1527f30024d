"""CUDA graphs of decode-only steps (the steps with prefill rows: pdserve/piecewise_graphs.py).

The decode forward is captured once per padded batch size (1, 2, 4, ... up to
`CacheConfig.cuda_graph_max_batch`, `graph_batch_sizes`), largest first in one memory pool, over
static input buffers: token ids, positions, slots, seq lens, and block tables as wide as the
longest possible sequence. A step copies its inputs into those buffers from pinned host memory
and replays the graph of the next size up; padding rows have slot -1 (no KV write) and seq len 0
(attention reads nothing). The host mirror of the block tables keeps a fixed row stride and is
updated incrementally: a row that held the same request last step only gets its new blocks.

Off CUDA (tests) nothing is captured and a "replay" runs the same static inputs eagerly, so the
padding and the buffers' flow are what runs on a GPU. The runner decides when to capture (the
first decode-only step, or the warm-up) and, under tensor parallelism, publishes each step's
buffer contents (`step_message`) for the other ranks to `load` and replay.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pdserve.models.llama import AttentionMetadata

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_batch_sizes(cap: int) -> list[int]:
    """The padded batch sizes up to `cap` (the configured maximum, or the KV blocks if fewer),
    with `cap` itself as the largest when it is below the last of GRAPH_BATCH_SIZES."""
    sizes = [b for b in GRAPH_BATCH_SIZES if b <= cap]
    if cap < GRAPH_BATCH_SIZES[-1] and cap not in sizes:
        sizes.append(cap)
    return sizes


class DecodeGraphs:
    """The decode graphs of one runner (module docstring): `model` is called as the runner calls
    it, `model(input_ids, meta, kv_caches)`; buffers are made at first use."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, block_size: int, batch_sizes: list[int], max_blocks_per_seq: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.device = device
        self.block_size = block_size
        self.batch_sizes = batch_sizes
        self.max_blocks_per_seq = max_blocks_per_seq
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self._h_views: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.num_replays = 0

    @property
    def ready(self) -> bool:
        """Captured (off CUDA: set up to run eagerly)."""
        return bool(self._graphs)

    # ---- capture ---------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the decode forward for every size in `batch_sizes` (largest first, sharing one
        memory pool). Padding inputs make warm-up and capture write nothing. Off CUDA (tests) only
        the static buffers are set up and "replay" runs eagerly."""
        t0 = time.perf_counter()
        self._ensure_buffers()
        dev = self.device
        if dev.type != "cuda":
            self.run_eagerly()
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for size in reversed(self.batch_sizes):
            input_ids, meta = self._graph_inputs(size)
            # One eager run first: Triton compiles and loads this size's kernels outside capture.
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self.model(input_ids, meta, self.kv_caches)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(input_ids, meta, self.kv_caches)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(dev)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1fs",
                    self.batch_sizes, time.perf_counter() - t0)

    def run_eagerly(self) -> None:
        """Every size "replays" eagerly on the static inputs (off CUDA, or a follower whose rank 0
        forced the graph path in tests)."""
        self._graphs = {size: None for size in self.batch_sizes}

    def _ensure_buffers(self) -> None:
        """The static input buffers of the graph path (pinned host and device), once."""
        if self._h_views is not None:
            return
        dev, max_b = self.device, self.batch_sizes[-1]
        on_cuda = dev.type == "cuda"
        self._h_i64 = torch.zeros((3, max_b), dtype=torch.int64, pin_memory=on_cuda)  # ids, pos, slot
        self._h_i64[2] = -1
        self._h_lens = torch.zeros(max_b, dtype=torch.int32, pin_memory=on_cuda)
        self._h_tables = torch.zeros(max_b * self.max_blocks_per_seq, dtype=torch.int32, pin_memory=on_cuda)
        self._h_views = (self._h_i64.numpy(), self._h_lens.numpy(), self._h_tables.numpy())
        self._d_i64 = self._h_i64.to(dev, copy=True)
        self._d_lens = self._h_lens.to(dev, copy=True)
        self._d_tables = torch.zeros((max_b, self.max_blocks_per_seq), dtype=torch.int32, device=dev)
        self._d_rows = torch.arange(max_b, dtype=torch.long, device=dev)
        # Host mirror of the block tables at a fixed row stride, updated incrementally.
        self._table_mirror = np.zeros((max_b, self.max_blocks_per_seq), dtype=np.int32)
        self._row_owners: list[tuple | None] = [None] * max_b
        self._copied = None
        if on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _graph_inputs(self, size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        return self._d_i64[0, :size], AttentionMetadata(
            positions=self._d_i64[1, :size],
            slot_mapping=self._d_i64[2, :size],
            num_decodes=size,
            decode_block_tables=self._d_tables[:size],
            decode_seq_lens=self._d_lens[:size],
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_seq_lens=None,
            logits_indices=self._d_rows[:size],
        )

    # ---- one step --------------------------------------------------------------------------
    def _update_table_mirror(self, seqs) -> int:
        """Brings the host mirror of the graph's block tables up to date for `seqs` (row i =
        seqs[i]) and returns the widest row. A row that held the same request last step (and
        it was not preempted since) only gets its new blocks: most steps write nothing."""
        mirror, owners = self._table_mirror, self._row_owners
        width = 1
        for i, seq in enumerate(seqs):
            blocks = seq.block_ids
            nb = len(blocks)
            width = max(width, nb)
            owner = owners[i]
            if owner is not None and owner[0] is seq and owner[1] == seq.num_preemptions and owner[2] <= nb:
                if owner[2] < nb:
                    mirror[i, owner[2]:nb] = blocks[owner[2]:]
            else:
                mirror[i, :nb] = blocks
            owners[i] = (seq, seq.num_preemptions, nb)
        for i in range(len(seqs), len(owners)):
            if owners[i] is None:
                break
            owners[i] = None  # drop references to finished requests
        return width

    def fill(self, seqs) -> tuple[int, int, int]:
        """Writes the inputs of a decode step of `seqs` (one new token each) into the pinned host
        buffers, padded to the next graph size; returns (rows, graph size, table width)."""
        n = len(seqs)
        size = next(b for b in self.batch_sizes if b >= n)
        bs = self.block_size
        width = self._update_table_mirror(seqs)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        i64, lens, flat = self._h_views
        pos = [seq.num_computed_tokens for seq in seqs]
        i64[0, :n] = [seq.token_at(p) for seq, p in zip(seqs, pos)]
        i64[1, :n] = pos
        i64[2, :n] = [seq.block_ids[p // bs] * bs + p % bs for seq, p in zip(seqs, pos)]
        lens[:n] = pos
        lens[:n] += 1
        i64[0:2, n:size] = 0
        i64[2, n:size] = -1
        lens[n:size] = 0
        np.copyto(flat[:size * width].reshape(size, width), self._table_mirror[:size, :width])
        return n, size, width

    def step_message(self, n: int, size: int, width: int) -> tuple:
        """The ("graph", ...) step message of the filled buffers, for the other ranks (`load`)."""
        i64, lens, _ = self._h_views
        return ("graph", n, size, width, i64[:, :size].copy(), lens[:size].copy(),
                self._table_mirror[:size, :width].copy())

    def load(self, size: int, width: int, i64: np.ndarray, lens: np.ndarray, tables: np.ndarray) -> None:
        """A follower's `fill`: the host buffers take rank 0's step message."""
        self._ensure_buffers()
        if self._copied is not None:
            self._copied.synchronize()
        h_i64, h_lens, h_flat = self._h_views
        h_i64[:, :size] = i64
        h_lens[:size] = lens
        np.copyto(h_flat[:size * width].reshape(size, width), tables)

    def replay(self, n: int, size: int, width: int, input_tokens: torch.Tensor | None) -> torch.Tensor:
        """Copies the filled host buffers to the device and replays the graph of `size` (off
        CUDA: runs the same static inputs eagerly). `input_tokens`: a device tensor whose first
        `n` rows replace the token ids. Returns the padded logits."""
        self._d_i64.copy_(self._h_i64, non_blocking=True)
        self._d_lens.copy_(self._h_lens, non_blocking=True)
        self._d_tables[:size, :width].copy_(self._h_tables[:size * width].view(size, width),
                                            non_blocking=True)
        if input_tokens is not None:  # after the ids' copy on the same stream: these win
            self._d_i64[0, :n].copy_(input_tokens[:n])
        captured = self._graphs[size]
        if captured is None:  # off CUDA: the same static inputs, run eagerly
            logits = self.model(*self._graph_inputs(size), self.kv_caches)
        else:
            self._copied.record()
            graph, logits = captured
            graph.replay()
        self.num_replays += 1
        return logits
