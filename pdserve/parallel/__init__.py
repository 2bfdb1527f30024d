"""Tensor parallelism (Megatron-style) for one engine spread over N ranks.

- `layout`: which heads, MLP columns and vocabulary rows each rank holds, the slice of every
  Hugging Face weight it keeps, and the start-up checks (`check_tensor_parallel`). Pure.
- `comm`: the collectives the model runs (`TPComm`: all-reduce, logits all-gather) over
  `torch.distributed` (NCCL on CUDA, gloo on CPU).
- `local`: starting ranks 1..N-1 as local processes for an engine whose rank 0 is the caller
  (`LocalTPGroup`), and the loop those ranks run (`follower_main`).

Rank 0 drives: it owns the scheduler and the one block manager, prepares each step's inputs
and publishes them on a `StepChannel` before running the model; ranks 1..N-1 receive them,
run the same forward on their shard (same block tables, their own KV heads) and drop the
logits. Only rank 0 samples.
"""

from pdserve.parallel.layout import TPLayout, check_tensor_parallel

__all__ = ["TPLayout", "check_tensor_parallel"]
