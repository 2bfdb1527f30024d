"""Piecewise CUDA graphs for the steps that decode graphs do not cover: steps with prefill rows.

A decode-only step replays one CUDA graph (`ModelRunner`'s decode graphs). A step that carries a
prefill chunk runs eagerly: its attention's grid follows the chunk lengths. Eagerly, an 8B step
launches about nine kernels a layer from Python, host time that does not shrink with the step
(docs/experiments.md, the mixed-step profile), while a 512-token step's GPU work is about as
long: small prompts and mixed steps wait on the host.

Here a step of up to `max_tokens` rows is padded to the next capture size and runs as L + 1
graph replays, each layer's attention launched eagerly between them (where vLLM's piecewise
capture splits the model too):

    segment 0       embedding, layer 0 up to attention (input norm, QKV, RoPE and KV write)
    segment i       layer i-1 from o_proj (o_proj, norm, MLP), layer i up to attention
    segment L       layer L-1 from o_proj

The segments read and write static buffers (`PiecewiseGraphs.ids` ... `.residual`) that every size
shares. Padding rows have slot -1 (no KV written) and their outputs are never read. The layer hook sees layer i after
segment i: its KV is in the cache then. Off CUDA (tests) nothing is captured and a replay runs the
segment eagerly on the same buffers, so the padding and the buffers' flow are what runs on a GPU.

Not under tensor parallelism (its followers run every eager step eagerly). On by default where
they can run (`CacheConfig.prefill_graphs`; --no-prefill-graphs turns them off).
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.models.llama import AttentionMetadata, LayerHook, LlamaModel, split_qkv, step_attention

logger = logging.getLogger(__name__)

# Padded step sizes (rows): fine steps where a step is weight-read bound, coarser above.
CAPTURE_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def capture_sizes(max_tokens: int) -> list[int]:
    """The padded sizes up to `max_tokens`, with `max_tokens` itself as the largest."""
    if max_tokens < 1:
        raise ValueError(f"prefill graphs need max_tokens >= 1, got {max_tokens}")
    sizes = [s for s in CAPTURE_SIZES if s < max_tokens]
    return sizes + [max_tokens]


class PiecewiseGraphs:
    @torch.inference_mode()
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_tokens: int, rotate_k: bool) -> None:
        """`rotate_k`: the runner's fresh prompts attend over their own rotated keys
        (`ModelRunner.dense_prefill`), so the segments rotate k in place in the QKV buffer."""
        if model.comm is not None:
            raise ValueError("prefill graphs do not run under tensor parallelism")
        c = model.config
        self.model, self.kv_caches, self.rotate_k = model, kv_caches, rotate_k
        self.sizes = capture_sizes(max_tokens)
        m = self.sizes[-1]
        weight = model.layers[0].input_norm
        dev, dtype = weight.device, weight.dtype
        self.ids = torch.zeros(m, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(m, dtype=torch.int64, device=dev)
        self.slots = torch.full((m,), -1, dtype=torch.int64, device=dev)
        self.qkv = torch.zeros(m, c.q_size + 2 * c.kv_size, dtype=dtype, device=dev)
        self.q = torch.zeros(m, c.num_heads, c.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros(m, c.num_heads, c.head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(m, c.hidden_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(m, c.hidden_size, dtype=dtype, device=dev)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.num_runs = 0

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def covers(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def _segment(self, index: int, size: int) -> None:
        """Segment `index` (module docstring) over the buffers' first `size` rows."""
        layers = self.model.layers
        if index == 0:
            hidden, residual = self.model.embed(self.ids[:size]), None
        else:
            hidden, residual = layers[index - 1].post_attention(self.attn[:size], self.residual[:size])
        if index < len(layers):
            q, _, _, residual = layers[index].pre_attention(
                hidden, residual, self.positions[:size], self.slots[:size], self.kv_caches[index],
                self.model.cos_sin, rotate_k=self.rotate_k, qkv_out=self.qkv[:size])
            self.q[:size].copy_(q)
        else:
            self.hidden[:size].copy_(hidden)
        self.residual[:size].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures every segment of every size (largest first, one memory pool); returns the
        seconds it took. Off CUDA: nothing (replays run eagerly)."""
        dev = self.ids.device
        if self._graphs or dev.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        self.slots.fill_(-1)  # the warm-up runs and the captures write no KV
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        current = torch.cuda.current_stream(dev)
        for size in reversed(self.sizes):
            graphs = []
            for index in range(len(self.model.layers) + 1):
                # an eager run first: Triton compiles this size's kernels outside the capture
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    self._segment(index, size)
                current.wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(index, size)
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        logger.info("captured piecewise CUDA graphs for steps of up to %d tokens (sizes %s) in %.1fs",
                    self.max_tokens, self.sizes, seconds)
        return seconds

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata,
            layer_hook: LayerHook | None = None) -> torch.Tensor:
        """The step's forward (as `LlamaModel.forward`): float32 logits of `meta.logits_indices`."""
        n = input_ids.shape[0]
        if not self.covers(n):
            raise ValueError(f"a step of {n} tokens is outside the prefill graphs (1..{self.max_tokens})")
        size = next(s for s in self.sizes if s >= n)
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        if size > n:
            self.slots[n:size].fill_(-1)
        graphs = self._graphs.get(size)
        model = self.model
        num_layers = len(model.layers)
        fresh_kv = None
        if meta.prefill_dense:  # every layer's rotated k and v land in the same QKV buffer rows
            _, k, v = split_qkv(self.qkv[:n], model.config)
            fresh_kv = (k[meta.num_decodes:], v[meta.num_decodes:])
        for index in range(num_layers + 1):
            if graphs is None:
                self._segment(index, size)
            else:
                graphs[index].replay()
            if index == num_layers:
                break
            if layer_hook is not None:
                layer_hook(index)
            k_cache, v_cache = self.kv_caches[index]
            step_attention(self.q[:n], k_cache, v_cache, meta, model.scale, fresh_kv, out=self.attn[:n])
        self.num_runs += 1
        return model.logits_of(self.hidden[:n], self.residual[:n], meta.logits_indices)
