"""The `pdserve` command line. Errors are one line on stderr naming the bad flag or file."""

from __future__ import annotations

import argparse
import logging
import sys
import time


class CliError(Exception):
    pass


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        return value
    return parse


def _float(flag: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), a Hugging Face directory, a .gguf file, or random:<name>")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=_positive_int("--max-model-len"), default=None)
    p.add_argument("--kv-cache-gib", type=_float("--kv-cache-gib"), default=0.5,
                   help="KV cache budget on CPU, GiB")
    p.add_argument("--gpu-memory-fraction", type=_float("--gpu-memory-fraction"), default=0.85)
    p.add_argument("--block-size", type=_positive_int("--block-size"), default=16)
    p.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=512)
    p.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=64)
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                kv_cache_gib=args.kv_cache_gib, gpu_memory_fraction=args.gpu_memory_fraction,
                block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching)


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop or ()))
    except ValueError as e:
        flag = str(e).split(" ", 1)[0].replace("_", "-")
        raise CliError(f"--{flag}: {e}") from None
    llm = LLM(**engine_kwargs(args))
    start = time.perf_counter()
    if args.raw or llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        out = llm.generate([args.prompt], params)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    elapsed = time.perf_counter() - start
    print(out.text)
    if args.verbose:
        print(f"[{len(out.token_ids)} tokens in {elapsed:.2f}s, finish_reason={out.finish_reason}, "
              f"token ids={out.token_ids}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregated LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline from one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=64)
    g.add_argument("--temperature", type=_float("--temperature"), default=0.0)
    g.add_argument("--top-p", type=_float("--top-p"), default=1.0)
    g.add_argument("--top-k", type=_positive_int("--top-k"), default=-1)
    g.add_argument("--seed", type=_positive_int("--seed"), default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CliError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
