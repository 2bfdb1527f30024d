"""The only place that touches devices: weights, the paged KV pools, batch tensors, sampling."""

from __future__ import annotations

import logging

import torch

import kernels

from pdserve.config import CacheConfig, ModelConfig
from pdserve.models.llama import AttentionMetadata, LayerHook, LlamaModel
from pdserve.sampler import Sampler, SamplingRow
from pdserve.scheduler import ScheduledBatch
from pdserve.sampling_params import TokenLogprob

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


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights, cache_config: CacheConfig,
                 device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.model = LlamaModel(model_config, dtype, device)
        self.model.load_weights(weights)
        self.model.eval()
        self.num_blocks = self._num_blocks(cache_config)
        c = model_config
        shape = (self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_layers)
        ]
        self.sampler = Sampler(device, seed)
        self.torch_path = kernels.kernel_backend(device) == "torch"
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.block_size,
                    self.kv_cache_bytes / (1 << 20))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = self.model_config.kv_bytes_per_token(torch.tensor([], dtype=self.dtype).element_size())
        per_block *= self.block_size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.gpu_memory_fraction)
        else:
            budget = int(cache.cpu_kv_gib * GIB)
        num = budget // per_block
        if num < 1:
            raise ValueError("KV cache budget too small for a single block; raise the memory budget")
        return num

    # ---- one step --------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Runs `batch`; returns float32 logits for the requests that sample this step, in the
        order of `sampling_indices(batch)`."""
        input_ids, meta = self.prepare(batch)
        return self.model(input_ids, meta, self.kv_caches, layer_hook)

    @staticmethod
    def order(batch: ScheduledBatch) -> list[int]:
        """Decodes (one new token, KV before it) first, then prefill chunks."""
        decodes = [i for i, n in enumerate(batch.num_new_tokens)
                   if n == 1 and batch.seqs[i].num_computed_tokens > 0]
        decode_set = set(decodes)
        return decodes + [i for i in range(len(batch)) if i not in decode_set]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        order = self.order(batch)
        num_decodes = sum(1 for i in order if batch.num_new_tokens[i] == 1
                          and batch.seqs[i].num_computed_tokens > 0)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_q = [0]
        logits_rows: list[int] = []
        for i in order:
            seq = batch.seqs[i]
            start = seq.num_computed_tokens
            n = batch.num_new_tokens[i]
            input_ids.extend(seq.tokens_slice(start, start + n))
            positions.extend(range(start, start + n))
            table = seq.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            seq_lens.append(start + n)
            cu_q.append(cu_q[-1] + n)
            if batch.samples(i):
                logits_rows.append(cu_q[-1] - 1)
        max_blocks = max(len(batch.seqs[i].block_ids) for i in order)
        tables = [batch.seqs[i].block_ids + [0] * (max_blocks - len(batch.seqs[i].block_ids)) for i in order]

        dev = self.device
        i32 = torch.int32
        block_tables = torch.tensor(tables, dtype=i32, device=dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=i32, device=dev)
        nd = num_decodes
        prefill_cu = None
        if nd < len(order):
            base = cu_q[nd]
            prefill_cu = torch.tensor([c - base for c in cu_q[nd:]], dtype=i32, device=dev)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=nd,
            decode_block_tables=block_tables[:nd] if nd else None,
            decode_seq_lens=seq_lens_t[:nd] if nd else None,
            prefill_block_tables=block_tables[nd:] if nd < len(order) else None,
            prefill_cu_seqlens_q=prefill_cu,
            prefill_seq_lens=seq_lens_t[nd:] if nd < len(order) else None,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        if self.torch_path:
            meta.rope_tables = kernels.rope_tables(meta.positions, self.model.cos_sin)
            if nd == len(order):
                meta.decode_plan = kernels.decode_gather_plan(block_tables, seq_lens_t, bs)
        return torch.tensor(input_ids, dtype=torch.long, device=dev), meta

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        return self.sampler(logits, rows)
