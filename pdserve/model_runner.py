"""The only place that touches devices: weights, the paged KV pools, batch tensors, sampling.

Decode-only steps on CUDA replay CUDA graphs, captured at the first such step (or the warm-up)
once per padded batch size (pdserve/decode_graphs.py); steps with prefill rows, up to
`prefill_graph_max_tokens`, replay piecewise graphs (pdserve/piecewise_graphs.py). Layer hooks on
decode steps, the torch kernel backend and `CacheConfig.enforce_eager` (--no-cuda-graphs) run
eagerly.

Tensor parallelism (`pdserve.parallel`): each rank's runner holds its shard and its KV heads.
Rank 0's runner is given a `StepChannel`: before each forward it publishes the step's host
inputs (`StepInputs`, or a graph step's static-buffer contents), and ranks 1..N-1 run the same
forward on them in `follow`. Every rank runs the same collectives in the same order; only
rank 0's logits are used.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from pdserve import kernels

from pdserve.config import CacheConfig, ModelConfig
from pdserve.decode_graphs import DecodeGraphs, graph_batch_sizes
from pdserve.models.llama import AttentionMetadata, LayerHook, LlamaModel, decode_forward_torch
from pdserve.piecewise_graphs import PiecewiseGraphs
from pdserve.sampler import Sampler, SamplingRow
from pdserve.scheduler import ScheduledBatch
from pdserve.sampling_params import TokenLogprob

if TYPE_CHECKING:
    from pdserve.parallel.comm import TPComm
    from pdserve.parallel.layout import TPLayout

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GIB = 1 << 30


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use cpu or cuda")
    return dev


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


@dataclass
class StepInputs:
    """The host side of one eager step, in `ModelRunner.order` (decodes first): what rank 0
    publishes to the other tensor-parallel ranks. numpy arrays (lists are accepted too): one
    pickle each, and `ModelRunner.device_inputs` packs them into two uploads."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [R] int32, per request, context incl. the new tokens
    cu_q: np.ndarray  # [R + 1] int32 offsets of each request's rows
    tables: np.ndarray  # [R, W] int32, per request, block ids padded with 0 to the widest
    logits_rows: np.ndarray  # [N] int64
    num_decodes: int


_ALIGN = 16  # elements: every packed segment starts at least 16-byte aligned on the device


def _packed(parts: list[np.ndarray], dtype) -> tuple[np.ndarray, list[int]]:
    """`parts` flattened into one array of `dtype`, each at an offset that is a multiple of
    _ALIGN; returns (array, offsets)."""
    offsets, end = [], 0
    for part in parts:
        offsets.append(end)
        end += -(-part.size // _ALIGN) * _ALIGN
    out = np.zeros(max(end, _ALIGN), dtype=dtype)
    for part, at in zip(parts, offsets):
        out[at:at + part.size] = part.reshape(-1)
    return out, offsets


class StepChannel(Protocol):
    """Rank 0's side of the step broadcast. Messages: ("eager", StepInputs, uses decode plan),
    ("graph", n, size, width, ids/positions/slots [3, size], seq lens [size], tables
    [size, width]), ("capture",) (capture the CUDA graphs now) and ("stop",). `publish` raises
    `TPRankError` (pdserve.parallel.local) when a rank is gone."""

    def publish(self, message: tuple) -> None: ...


class StepSource(Protocol):
    """The other ranks' side: the next message, in publish order (EOFError when rank 0 is gone)."""

    def receive(self) -> tuple: ...


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights, cache_config: CacheConfig,
                 device: torch.device, dtype: torch.dtype, seed: int = 0,
                 layout: "TPLayout | None" = None, comm: "TPComm | None" = None,
                 channel: StepChannel | None = None) -> None:
        """`model_config`: the whole model; under tensor parallelism `layout` and `comm` are this
        rank's shard and collectives, and rank 0 gets the `channel` it publishes steps on."""
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.comm = comm
        self.channel = channel
        self.tp_size = comm.size if comm is not None else 1
        if self.tp_size > 1 and cache_config.compile_cpu_decode:
            raise ValueError("--compile (the CPU torch.compile decode) does not support --tensor-parallel-size > 1")
        if model_config.moe is not None and cache_config.compile_cpu_decode:
            raise ValueError("--compile (the CPU torch.compile decode) does not support mixture-of-experts models")
        self.model = LlamaModel(model_config, dtype, device, layout, comm)
        self.model_config = self.model.config  # this rank's shape (the whole model's at TP=1)
        self.model.load_weights(weights)
        self.model.eval()
        if (cache_config.cpu_packed_weights and device.type == "cpu" and dtype == torch.float32
                and kernels.packing_available()):
            self.model.pack_weights()
        self.kv_cache_dtype = kernels.kv_cache_torch_dtype(cache_config.kv_cache_dtype, dtype)
        if self.kv_cache_dtype == kernels.FP8_DTYPE and cache_config.compile_cpu_decode:
            raise ValueError("kv_cache_dtype fp8 does not support compile (the CPU torch.compile decode)")
        if (self.kv_cache_dtype == kernels.FP8_DTYPE and device.type == "cuda"
                and not cache_config.experimental_fp8_kv):
            # its exact-write and SmolLM2 tolerance tests failed on a GPU (docs/results/h200_gpu_tests.txt)
            raise ValueError("kv_cache_dtype fp8 on CUDA is not verified yet (its GPU tests failed on an H200); "
                             "pass --experimental-fp8-kv (CacheConfig.experimental_fp8_kv) to use it anyway, "
                             "or use the default cache dtype")
        self.num_blocks = self._num_blocks(cache_config)
        c = model_config
        shape = self.pool_shape(self.num_blocks)
        # One allocation [layers, 2, *shape]; each layer's K and V pool is a contiguous view of
        # it. The KV transfer then gathers or scatters all layers of a message in one launch
        # (kvtransfer.staging.stacked_pools).
        pools = torch.zeros((c.num_layers, 2, *shape), dtype=self.kv_cache_dtype, device=device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [(pools[i, 0], pools[i, 1])
                                                                   for i in range(c.num_layers)]
        self.sampler = Sampler(device, seed)
        self.torch_path = kernels.kernel_backend(device) == "torch"
        # Whether fresh prompts attend over their own K/V (kernels.prefill_attention_dense); this
        # also checks PDSERVE_PREFILL_ATTENTION at start-up rather than at the first prefill.
        self.dense_prefill = kernels.prefill_dense_applies(
            torch.empty((0, 1, 1), dtype=dtype, device=device), self.kv_caches[0][0])
        logger.info("KV cache: %d blocks of %d tokens, %s (%.1f MiB)", self.num_blocks, self.block_size,
                    self.kv_cache_dtype_name, self.kv_cache_bytes / (1 << 20))
        # CUDA graphs of the decode forward (pdserve/decode_graphs.py), captured at the first
        # decode-only step.
        self.use_cuda_graphs = (device.type == "cuda" and not self.torch_path
                                and not cache_config.enforce_eager)
        max_len = min(model_config.max_position_embeddings, self.num_blocks * self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, device, self.block_size,
                                          graph_batch_sizes(min(cache_config.cuda_graph_max_batch, self.num_blocks)),
                                          max_blocks_per_seq=-(-max_len // self.block_size))
        self.graph_batch_sizes: list[int] = self.decode_graphs.batch_sizes
        # Steps with prefill rows, up to this many tokens, replay piecewise CUDA graphs
        # (pdserve/piecewise_graphs.py; on by default where they can run; 0 = off). Tests set it off
        # CUDA, where the segments run eagerly on the same static buffers.
        self.prefill_graph_max_tokens = (cache_config.prefill_graph_max_tokens if cache_config.prefill_graphs
                                         and self.use_cuda_graphs and self.tp_size == 1 else 0)
        if cache_config.prefill_graphs and not self.prefill_graph_max_tokens and device.type == "cuda":
            logger.info("prefill graphs are off here: they need CUDA graphs on a CUDA device with Triton "
                        "kernels and no tensor parallelism")
        self._piecewise: PiecewiseGraphs | None = None
        # pinned host buffers (and their copy events) for sampled tokens: two, one step in flight
        self._token_bufs: list[torch.Tensor] | None = None
        self._token_events: list | None = None
        self._token_turn = 0
        self.num_decode_only_steps = 0
        # Decode-only steps on the torch path run `decode_forward_torch`, through torch.compile
        # when CacheConfig.compile_cpu_decode is set.
        self._decode_torch = functools.partial(decode_forward_torch, self.model, self.kv_caches)
        self.compiled_decode = self.torch_path and cache_config.compile_cpu_decode
        if self.compiled_decode:
            # no inductor per-call checks of every extern output's size, stride and alignment
            # (their cost: docs/results.md, "Figures behind the code's choices"); the graph's
            # shapes are checked by its guards
            self._decode_torch = torch.compile(self._decode_torch, fullgraph=True, options={
                "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False})
        self.num_compiled_steps = 0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    @property
    def kv_cache_dtype_name(self) -> str:
        return str(self.kv_cache_dtype).removeprefix("torch.")

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One K or V pool: [NB, BS, Hkv, D], or with the FP8 scale rows (pdserve/kernels/kv_quant.py)."""
        c = self.model_config
        if self.kv_cache_dtype == kernels.FP8_DTYPE:
            return kernels.fp8_pool_shape(num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        return (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (FP8 scales included)."""
        rows = self.pool_shape(1)
        per_pool = rows[1] * rows[2] * rows[3] * torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.model_config.num_layers * per_pool

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes a decode step reads per token of context (FP8 scales included)."""
        return self.kv_bytes_per_block / self.block_size

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.kv_bytes_per_block
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_fraction)
        else:
            budget = int(cache.cpu_kv_gib * GIB)
        num = budget // per_block
        if num < 1:
            raise ValueError("KV cache budget too small for a single block; raise the memory budget")
        if self.comm is not None:  # one block manager for all ranks: the blocks every rank holds
            num = self.comm.min_int(num)
        return num

    # ---- one step --------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, layer_hook: LayerHook | None = None,
                input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Runs `batch`; returns float32 logits for the requests that sample this step, in the
        order of `order(batch)`. `input_tokens` (a graph step only, see `uses_graph`): a device
        tensor whose row i is the input token of batch.seqs[i], read on the device instead of
        from the sequence (the previous step's sampled tokens, not yet on the host)."""
        decode_only = self.is_decode_only(batch)
        self.num_decode_only_steps += decode_only
        if layer_hook is None and decode_only and self.uses_graph(len(batch)):
            return self._execute_graph(batch, input_tokens)
        if input_tokens is not None:
            raise AssertionError("input_tokens needs a CUDA-graph decode step")
        inputs = self.host_inputs(batch)
        input_ids, meta = self.device_inputs(inputs)
        planned = layer_hook is None and meta.decode_plan is not None
        if self.channel is not None:
            self.channel.publish(("eager", inputs, planned))
        if planned:
            return self._execute_decode_torch(input_ids, meta)
        if 0 < input_ids.shape[0] <= self.prefill_graph_max_tokens:
            graphs = self.prefill_graphs()
            if self.device.type == "cuda" and not graphs.captured:  # not warmed up: captured now
                graphs.capture()
            return graphs.run(input_ids, meta, layer_hook)
        return self.model(input_ids, meta, self.kv_caches, layer_hook)

    @property
    def num_graph_replays(self) -> int:
        """Decode-only steps that ran through the decode graphs (replayed on CUDA, eagerly
        elsewhere), since the runner started, warm-up included."""
        return self.decode_graphs.num_replays

    @property
    def num_prefill_graph_steps(self) -> int:
        """Steps that ran through the piecewise graphs (replayed on CUDA, their segments eagerly
        elsewhere), since the runner started, warm-up included."""
        return self._piecewise.num_runs if self._piecewise is not None else 0

    def prefill_graphs(self) -> PiecewiseGraphs:
        """The piecewise graphs of steps with prefill rows (made at first use; `capture_prefill_graphs`
        captures them, the warm-up does)."""
        if self._piecewise is None or self._piecewise.max_tokens != self.prefill_graph_max_tokens:
            self._piecewise = PiecewiseGraphs(self.model, self.kv_caches, self.prefill_graph_max_tokens,
                                              rotate_k=self.dense_prefill)
        return self._piecewise

    def capture_prefill_graphs(self) -> float:
        """Captures the piecewise graphs when they are on (`prefill_graph_max_tokens`); returns
        the seconds it took (0 when off, or off CUDA)."""
        if not self.prefill_graph_max_tokens:
            return 0.0
        return self.prefill_graphs().capture()

    @torch.inference_mode()
    def follow(self, source: StepSource) -> int:
        """Tensor-parallel ranks 1..N-1: runs each step rank 0 publishes until ("stop",);
        returns the number of steps run. The logits are dropped (rank 0 samples)."""
        steps = 0
        while True:
            message = source.receive()
            kind = message[0]
            if kind == "stop":
                return steps
            if kind == "capture":
                self.use_cuda_graphs = True  # rank 0 captures (or, off CUDA, forced the graph path)
                self.capture_cuda_graphs()
                continue
            if kind == "eager":
                _, inputs, planned = message
                input_ids, meta = self.device_inputs(inputs)
                if planned:
                    self._execute_decode_torch(input_ids, meta)
                else:
                    self.model(input_ids, meta, self.kv_caches)
            elif kind == "graph":
                _, n, size, width, i64, lens, tables = message
                self.decode_graphs.load(size, width, i64, lens, tables)
                self._launch_graph(n, size, width, None)
            else:
                raise AssertionError(f"unknown step message {kind!r}")
            if self.device.type == "cuda":  # a graph replay returns before the GPU is done
                torch.cuda.current_stream(self.device).synchronize()
            steps += 1

    @torch.inference_mode()
    def _execute_decode_torch(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cos, signed_sin = meta.rope_tables  # type: ignore[misc]
        slots, mask, length = meta.decode_plan  # type: ignore[misc]
        args = (input_ids, cos, signed_sin, meta.slot_mapping, slots.view(-1, length), mask, meta.logits_indices)
        if self.compiled_decode:
            self.num_compiled_steps += 1
            # one graph for every batch > 1 and every context length (the batch, dim 0 of each
            # input, and the context, dim -1 of slots and mask); model dims stay static
            for arg in args:
                if arg is not None and arg.shape[0] > 1:
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
            for arg in (args[4], mask):
                if arg is not None and arg.shape[-1] > 1:
                    torch._dynamo.maybe_mark_dynamic(arg, arg.dim() - 1)
        return self._decode_torch(*args)

    def uses_graph(self, batch_size: int) -> bool:
        """Whether a decode-only step of `batch_size` requests (no layer hook) replays a CUDA
        graph (off CUDA, with graphs forced on in tests: the same static inputs, eagerly)."""
        return bool(self.use_cuda_graphs and self.graph_batch_sizes and batch_size <= self.graph_batch_sizes[-1])

    def sample_async(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple:
        """Samples `rows` on the device (`Sampler.device_only` rows) and starts copying the tokens
        to the host; `tokens_of` waits for them. Returns (device tokens, handle)."""
        tokens = self.sampler.sample_device(logits, rows)
        n = tokens.shape[0]
        if self.device.type != "cuda":
            return tokens, (tokens.clone(), None, n)
        if self._token_bufs is None:  # graph steps only: at most the largest graph's batch
            size = self.graph_batch_sizes[-1]
            self._token_bufs = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._token_events = [torch.cuda.Event() for _ in range(2)]
        i = self._token_turn = 1 - self._token_turn
        buf, event = self._token_bufs[i], self._token_events[i]
        event.synchronize()  # the copy that last used this buffer was read (at most two in flight)
        buf[:n].copy_(tokens, non_blocking=True)
        event.record()
        return tokens, (buf, event, n)

    @staticmethod
    def tokens_of(handle: tuple) -> list[int]:
        """The host list of a `sample_async` result, once its copy is done."""
        buf, event, n = handle
        if event is not None:
            event.synchronize()
        return buf[:n].tolist()

    @staticmethod
    def _split(batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Indices of decodes (one new token, KV before it) and of prefill chunks."""
        decodes, prefills = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            (decodes if n == 1 and seq.num_computed_tokens > 0 else prefills).append(i)
        return decodes, prefills

    @classmethod
    def is_decode_only(cls, batch: ScheduledBatch) -> bool:
        return not cls._split(batch)[1]

    @classmethod
    def order(cls, batch: ScheduledBatch) -> list[int]:
        """Decodes first, then prefill chunks."""
        decodes, prefills = cls._split(batch)
        return decodes + prefills

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        return self.device_inputs(self.host_inputs(batch))

    def host_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs as host arrays (what `device_inputs` uploads). Decode rows (one
        token each) are built as lists, prefill chunks with numpy: an 8k-token chunk's slots
        are one vectorized lookup, not 8k Python iterations."""
        bs = self.block_size
        decodes, prefills = self._split(batch)
        order = decodes + prefills
        num_decodes = len(decodes)
        seqs, counts = batch.seqs, batch.num_new_tokens
        total = sum(counts[i] for i in order)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        seq_lens = np.empty(len(order), dtype=np.int32)
        cu_q = np.zeros(len(order) + 1, dtype=np.int32)
        width = max(len(seqs[i].block_ids) for i in order)
        tables = np.zeros((len(order), width), dtype=np.int32)
        logits_rows: list[int] = []
        if num_decodes:  # rows 0 .. num_decodes-1, one token each
            ids, pos, slot = [], [], []
            for row, i in enumerate(decodes):
                seq = seqs[i]
                p = seq.num_computed_tokens
                table = seq.block_ids
                ids.extend(seq.tokens_slice(p, p + 1))
                pos.append(p)
                slot.append(table[p // bs] * bs + p % bs)
                tables[row, :len(table)] = table
                if batch.samples(i):
                    logits_rows.append(row)
            input_ids[:num_decodes] = ids
            positions[:num_decodes] = pos
            slots[:num_decodes] = slot
            seq_lens[:num_decodes] = positions[:num_decodes] + 1
            cu_q[1:num_decodes + 1] = np.arange(1, num_decodes + 1)
        at = num_decodes
        for row, i in enumerate(prefills, start=num_decodes):
            seq = seqs[i]
            start, n = seq.num_computed_tokens, counts[i]
            table = np.asarray(seq.block_ids, dtype=np.int64)
            tables[row, :table.size] = table
            input_ids[at:at + n] = seq.tokens_slice(start, start + n)
            pos = positions[at:at + n]
            pos[:] = np.arange(start, start + n)
            slots[at:at + n] = table[pos // bs] * bs + pos % bs
            at += n
            seq_lens[row] = start + n
            cu_q[row + 1] = at
            if batch.samples(i):
                logits_rows.append(at - 1)
        return StepInputs(input_ids, positions, slots, seq_lens, cu_q, tables,
                          np.asarray(logits_rows, dtype=np.int64), num_decodes)

    def device_inputs(self, inputs: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        """Uploads a step's inputs: one int64 and one int32 array, each one copy (from pinned
        memory on CUDA, without waiting for the GPU), then views into them."""
        bs = self.block_size
        nd = inputs.num_decodes
        i64 = [np.asarray(a, dtype=np.int64) for a in (inputs.input_ids, inputs.positions, inputs.slots,
                                                         inputs.logits_rows)]
        seq_lens = np.asarray(inputs.seq_lens, dtype=np.int32)
        cu_q = np.asarray(inputs.cu_q, dtype=np.int32)
        num_requests = seq_lens.size
        tables = np.asarray(inputs.tables, dtype=np.int32).reshape(num_requests, -1)
        width = tables.shape[1]
        # Decode and prefill parts are separate segments, not slices of one: every kernel
        # argument starts 16-byte aligned, so Triton never compiles an extra variant for it.
        i32 = [tables[:nd], seq_lens[:nd], tables[nd:], seq_lens[nd:], cu_q[nd:] - cu_q[nd]]
        h64, o64 = _packed(i64, np.int64)
        h32, o32 = _packed(i32, np.int32)
        d64, d32 = self._upload(h64), self._upload(h32)
        ids, positions, slots, logits_rows = (d64[o:o + a.size] for o, a in zip(o64, i64))
        dt, dl, pt, pl, pc = (d32[o:o + a.size] for o, a in zip(o32, i32))
        q_lens = np.diff(cu_q[nd:])  # rows of each prefill sequence
        # every prefill starts at position 0: the dense attention reads the step's own K/V
        dense = self.dense_prefill and q_lens.size > 0 and bool(np.array_equal(seq_lens[nd:], q_lens))
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            num_decodes=nd,
            decode_block_tables=dt.view(nd, width) if nd else None,
            decode_seq_lens=dl if nd else None,
            prefill_block_tables=pt.view(num_requests - nd, width) if nd < num_requests else None,
            prefill_cu_seqlens_q=pc if nd < num_requests else None,
            prefill_seq_lens=pl if nd < num_requests else None,
            logits_indices=logits_rows,
            prefill_dense=dense,
            prefill_max_q_len=int(q_lens.max()) if dense else 0,
        )
        if self.torch_path:
            meta.rope_tables = kernels.rope_tables(meta.positions, self.model.cos_sin)
            if nd == num_requests:
                meta.decode_plan = kernels.decode_gather_plan(meta.decode_block_tables, meta.decode_seq_lens, bs)
        return ids, meta

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        """`host` on the runner's device: on CUDA through a pinned buffer of torch's caching
        host allocator (reused only once its copy is done), on the CPU the array itself."""
        tensor = torch.from_numpy(host)
        if self.device.type == "cpu":
            return tensor
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    # ---- CUDA graphs of decode steps (pdserve/decode_graphs.py) ----------------------------
    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Captures the decode forward for every size in `graph_batch_sizes` (DecodeGraphs.capture).
        Off CUDA (tests) only the static buffers are set up and "replay" runs eagerly."""
        if self.decode_graphs.ready or not self.use_cuda_graphs:
            return
        if self.channel is not None:  # the capture's warm-up and captured collectives run on every rank
            self.channel.publish(("capture",))
        self.decode_graphs.capture()

    @torch.inference_mode()
    def _execute_graph(self, batch: ScheduledBatch, input_tokens: torch.Tensor | None = None) -> torch.Tensor:
        graphs = self.decode_graphs
        if not graphs.ready:
            self.capture_cuda_graphs()
        n, size, width = graphs.fill(batch.seqs)
        if self.channel is not None:
            self.channel.publish(graphs.step_message(n, size, width))
        logits = self._launch_graph(n, size, width, input_tokens)
        sampling = [i for i in range(n) if batch.samples(i)]
        if len(sampling) == n:
            return logits[:n]
        return logits[torch.tensor(sampling, dtype=torch.long, device=self.device)]

    def _launch_graph(self, n: int, size: int, width: int, input_tokens: torch.Tensor | None) -> torch.Tensor:
        """Replays the graph of `size` over the filled buffers (DecodeGraphs.replay), captured
        first if need be. Returns the padded logits."""
        graphs = self.decode_graphs
        if not graphs.ready:
            self.capture_cuda_graphs()
        if not graphs.ready:  # a follower whose rank 0 forced the graph path (tests)
            graphs.run_eagerly()
        return graphs.replay(n, size, width, input_tokens)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        if self.device.type == "cuda":
            # Wait for the forward on an event first (the GIL released, nothing else held): the
            # sampler's host read of the tokens is a copy into pageable memory, and while that
            # copy waited for the forward every other thread of the worker stalled with it (the
            # KV sender's readiness waits and its UCX sends, up to the prefill's end).
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
        return self.sampler(logits, rows)
