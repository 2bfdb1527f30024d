"""What each tensor-parallel rank holds: heads, MLP columns, vocabulary rows, weight slices.

Megatron-style split of a Llama-family model over `size` ranks:

- attention: q/k/v are column-parallel (rank r holds `num_heads / size` query heads and their
  KV heads), o_proj is row-parallel (its input columns), followed by an all-reduce;
- MLP: gate/up column-parallel, down_proj row-parallel, followed by an all-reduce;
- KV heads: `num_kv_heads / size` per rank when they divide; when there are fewer KV heads
  than ranks (`size % num_kv_heads == 0`) each rank holds the one KV head its query heads
  read, replicated on `size / num_kv_heads` ranks (SmolLM2: 9 heads, 3 KV heads, TP=3 gives
  3 query heads and 1 KV head per rank);
- q/k norms: a per-head norm (Qwen3) is replicated; a norm over the whole q or k projection
  (OLMoE) is split with the heads, its mean square summed over the ranks in the forward;
- sparse MLP (mixture of experts): the router is replicated. Tensor parallelism splits every
  expert's width as the dense MLP's (gate/up rows, down columns); expert parallelism
  (`expert_parallel`, `--expert-parallel`) instead gives rank r the whole experts
  [r * E / N, (r + 1) * E / N), and the other experts' weights are not read at all (their
  slice is `NOTHING`). Either way the output is all-reduced;
- embedding and LM head: vocab-parallel. Rank r holds rows [r * V', (r + 1) * V') of a
  vocabulary padded up to `size * V'`; the embedding lookup is masked and all-reduced, the
  logits are all-gathered and cut back to V. Chosen over replication because the embedding
  and LM head are the largest tensors of small models (SmolLM2: 28M of 135M parameters;
  Llama 3.1 8B: 1 GB each in bf16) and a tied head then shares the rank's rows for free.

At size 1 every slice is None (whole tensors): the single-rank engine is unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from pdserve.config import ModelConfig

Index = tuple[slice, ...]

TP_FLAG = "--tensor-parallel-size"
EP_FLAG = "--expert-parallel"
NOTHING: Index = (slice(0, 0),)  # the slice of a weight this rank does not hold (another rank's expert)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def check_tensor_parallel(config: ModelConfig, size: int, *, expert_parallel: bool = False, device_type: str = "cpu",
                          num_gpus: int | None = None) -> None:
    """One-line ValueError naming the flag when `size` cannot split `config` (or, on CUDA,
    when there are fewer GPUs than ranks). `expert_parallel`: the experts are divided among
    the ranks rather than each one's width. Cheap: run it before any process starts."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{TP_FLAG} must be a positive integer, got {size!r}")
    name = config.name or config.architecture
    if config.num_heads % size:
        raise ValueError(f"{TP_FLAG} {size} does not divide the {config.num_heads} attention heads of {name}")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"{TP_FLAG} {size}: the {config.num_kv_heads} KV heads of {name} neither divide "
                         f"by {size} nor divide it")
    if config.has_dense_layers and config.intermediate_size % size:
        raise ValueError(f"{TP_FLAG} {size} does not divide the MLP width {config.intermediate_size} of {name}")
    moe = config.moe
    if expert_parallel and moe is None:
        raise ValueError(f"{EP_FLAG}: {name} has no experts to divide among the ranks")
    if moe is not None and expert_parallel and moe.num_experts % size:
        raise ValueError(f"{EP_FLAG} at {TP_FLAG} {size}: the {moe.num_experts} experts of {name} do not divide "
                         f"by {size}")
    if moe is not None and not expert_parallel and moe.intermediate_size % size:
        raise ValueError(f"{TP_FLAG} {size} does not divide the expert width {moe.intermediate_size} of {name} "
                         f"(or divide the experts among the ranks: {EP_FLAG})")
    if device_type == "cuda" and num_gpus is not None and size > num_gpus:
        raise ValueError(f"{TP_FLAG} {size} needs {size} GPUs, this machine has {num_gpus}")


@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `size` over the model `config` (the whole model's shape)."""

    config: ModelConfig
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # the experts divided among the ranks, not each one's width

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size, expert_parallel=self.expert_parallel)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} out of range [0, {self.size})")

    # ---- per-rank sizes --------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first of this rank's KV heads in the whole model's numbering."""
        c = self.config
        if c.num_kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank * c.num_kv_heads // self.size  # replicated: the head its query heads read

    @property
    def kv_replicas(self) -> int:
        """On how many ranks each KV head lives (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.size // self.config.num_kv_heads)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def expert_range(self) -> range:
        """The ids of the experts this rank holds (all of them unless expert-parallel)."""
        moe = self.config.moe
        if moe is None:
            return range(0)
        if not self.expert_parallel:
            return range(moe.num_experts)
        per_rank = moe.num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def moe_intermediate_size(self) -> int:
        """The width of each expert this rank holds (its share under tensor parallelism)."""
        moe = self.config.moe
        if moe is None:
            return 0
        return moe.intermediate_size if self.expert_parallel else moe.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds (end - start < vocab_per_rank on
        the last rank when the vocabulary does not divide: those rows are zero padding)."""
        start = min(self.rank * self.vocab_per_rank, self.config.vocab_size)
        return start, min(start + self.vocab_per_rank, self.config.vocab_size)

    def local_config(self) -> ModelConfig:
        """The shape this rank's layers compute with (vocab_size stays the whole model's)."""
        if self.size == 1:
            return self.config
        moe = self.config.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=self.moe_intermediate_size)
        return dataclasses.replace(self.config, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size, moe=moe)

    # ---- weight slices ---------------------------------------------------------------------
    def shard_index(self, name: str) -> Index | None:
        """The slice of the Hugging Face weight `name` (HF shape: out_features, in_features)
        this rank keeps, as basic indexing (works on a torch tensor and on a safetensors
        slice), or None to keep it whole."""
        if self.size == 1:
            return None
        d = self.config.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_range
            return (slice(start, end),)
        q_rows = slice(self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        kv_rows = slice(self.first_kv_head * d, (self.first_kv_head + self.num_kv_heads) * d)
        if name.endswith((".q_norm.weight", ".k_norm.weight")):  # over a projection: split with its heads
            if self.config.qk_norm != "proj":
                return None
            return (q_rows,) if name.endswith(".q_norm.weight") else (kv_rows,)
        expert = _EXPERT.search(name)
        if expert is not None:
            if self.expert_parallel:
                return None if int(expert.group(1)) in self.expert_range else NOTHING
            ff = self.moe_intermediate_size
            cols = slice(self.rank * ff, (self.rank + 1) * ff)
            return (slice(None), cols) if expert.group(2) == "down_proj" else (cols,)
        if name.endswith(".mlp.gate.weight"):  # the router
            return None
        if ".self_attn." in name:
            proj = name.rsplit(".", 2)[-2]
            if proj == "q_proj":
                return (q_rows,)
            if proj in ("k_proj", "v_proj"):
                return (kv_rows,)
            if proj == "o_proj":
                return (slice(None), q_rows)
        if ".mlp." in name:
            ff = self.intermediate_size
            cols = slice(self.rank * ff, (self.rank + 1) * ff)
            return (slice(None), cols) if name.endswith("down_proj.weight") else (cols,)
        return None  # norms

    def describe(self) -> str:
        experts = ""
        if self.config.moe is not None:
            held = self.expert_range
            experts = f", experts [{held.start}, {held.stop}) of width {self.moe_intermediate_size}"
        return (f"rank {self.rank}/{self.size}: {self.num_heads} query heads, {self.num_kv_heads} KV heads "
                f"(from {self.first_kv_head}), MLP {self.intermediate_size}{experts}, vocab rows {self.vocab_range}")
