"""Tokenizer wrapper and per-request incremental detokenizer.

`Tokenizer` wraps a Hugging Face fast tokenizer (built by `transformers` from a model
directory or from GGUF metadata) and exposes what the server needs: encode, decode, chat
templates and token strings for logprobs. Encode and decode go straight to the Rust
`tokenizers` backend; chat templates go through `transformers`.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas by decoding only
a short window of recent ids each step (a prefix offset and a read offset), and holds back
text whose last character is U+FFFD, which means a multi-byte UTF-8 character is still
split across tokens. For byte-level BPE tokenizers (GPT-2 style: Llama 3, SmolLM2, Qwen2)
every token is a fixed byte string, so the detokenizer appends its bytes from a table built
once per tokenizer and decodes only the bytes not yet emitted: no call into the tokenizer
per token (about 5 us a token otherwise, which a decode step of 256 requests pays 256
times while the GPU waits).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

from pdserve import environment

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# Ids of the prompt tail kept as left context, so the first generated token decodes with
# the spacing it has inside the sequence.
_PROMPT_CONTEXT_TOKENS = 6


class Tokenizer:
    """A model's tokenizer and chat template.

    `eos_token_ids` are the ids that end generation (the model's, not only the tokenizer's
    own eos token); `vocab_size` counts every id the tokenizer can produce, added tokens
    included.
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = (), source: str = "") -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer  # tokenizers.Tokenizer
        self.source = source
        eos = [int(i) for i in eos_token_ids]
        if not eos and hf_tokenizer.eos_token_id is not None:
            eos = [int(hf_tokenizer.eos_token_id)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        bos = hf_tokenizer.bos_token_id
        self.bos_token_id: int | None = None if bos is None else int(bos)
        self.vocab_size: int = len(hf_tokenizer)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source or type(self._hf).__name__}, vocab_size={self.vocab_size})"

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped `transformers` tokenizer, for features this wrapper does not expose."""
        return self._hf

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        return getattr(self._hf, "chat_template", None) or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes without `clean_up_tokenization_spaces`, so that incremental and full decodes agree."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, id: int) -> str:
        """The text of one token, special tokens included (e.g. for logprobs).

        A token holding part of a multi-byte character decodes to U+FFFD.
        """
        return self._backend.decode([int(id)], skip_special_tokens=False)

    @functools.cached_property
    def byte_table(self) -> tuple[list[bytes], list[bytes]] | None:
        """For a byte-level BPE tokenizer: the bytes of every id, (special tokens skipped,
        special tokens kept); None for any other kind (the detokenizer then decodes windows)."""
        return _byte_level_table(self._backend)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Renders messages with the model's chat template (`tools`: OpenAI function tools, for a
        template that renders them); ValueError if there is none or it rejects them."""
        if not self.has_chat_template:
            where = f"{self.source}: " if self.source else ""
            raise ValueError(f"{where}tokenizer has no chat template")
        try:
            rendered = self._hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja2 TemplateError, raise_exception() in templates, bad messages
            raise ValueError(f"chat template failed: {exc}") from exc
        if not isinstance(rendered, str):  # defensive: some versions return a list for batched input
            raise ValueError(f"chat template returned {type(rendered).__name__}, expected str")
        return rendered


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into newly completed text.

    Each step decodes two short windows, ids[prefix:read] and ids[prefix:], and emits the
    text the new ids add after the first. Text ending in U+FFFD is held back until the
    character completes. Concatenating every `add` result (and `flush`) equals decoding the
    generated ids in the context of the prompt.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        tables = tokenizer.byte_table
        self._bytes = None if tables is None else tables[0 if skip_special_tokens else 1]
        self._pending = b""  # byte-level: bytes of ids not yet emitted (a split character)

    def add(self, token_id: int) -> str:
        table = self._bytes
        if table is not None:
            token_id = int(token_id)
            pending = self._pending + (table[token_id] if 0 <= token_id < len(table) else b"")
            if not pending:
                return ""
            text = pending.decode("utf-8", "replace")
            if text.endswith(_REPLACEMENT_CHAR):
                self._pending = pending
                return ""
            self._pending = b""
            self.text += text
            return text
        self._ids.append(int(token_id))
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        # Slide the window: the ids just read become the left context of the next step.
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits text held back at the end of a stream (e.g. a truly invalid byte sequence)."""
        if self._bytes is not None:
            delta, self._pending = self._pending.decode("utf-8", "replace"), b""
            self.text += delta
            return delta
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


def _byte_level_table(backend: Any) -> tuple[list[bytes], list[bytes]] | None:
    """(bytes per id with special tokens skipped, with them kept) when `backend` is a BPE
    model with the ByteLevel decoder alone; else None. Added tokens decode to their content."""
    try:
        from tokenizers import decoders, models
    except ImportError:  # pragma: no cover - tokenizers comes with transformers
        return None
    if not isinstance(backend.model, models.BPE) or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    unicode_to_byte = {ch: b for b, ch in _bytes_to_unicode().items()}
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    size = max([size] + [i + 1 for i in added])
    keep: list[bytes] = [b""] * size
    skip: list[bytes] = [b""] * size
    for token, i in backend.get_vocab(with_added_tokens=False).items():
        try:
            keep[i] = skip[i] = bytes(unicode_to_byte[ch] for ch in token)
        except KeyError:  # a token that is not byte-level text: not this kind of tokenizer
            return None
    for i, tok in added.items():
        keep[i] = tok.content.encode("utf-8")
        skip[i] = b"" if tok.special else keep[i]
    return skip, keep


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (ByteLevel's mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def load_hf_tokenizer(model_dir: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """A tokenizer from a Hugging Face model directory (tokenizer.json, tokenizer_config.json,
    chat_template.jinja); ValueError naming the directory if it has none."""
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is loaded

    try:
        hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{model_dir}: cannot load tokenizer ({_one_line(exc)})") from exc
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{model_dir}: tokenizer is not a fast (tokenizers) tokenizer; tokenizer.json is required")
    return Tokenizer(hf, eos_token_ids, source=model_dir)


def load_tokenizer_json(path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """A tokenizer from a `tokenizers` JSON file. Next to a tokenizer_config.json (a Hugging Face
    directory), the directory is loaded, with its special tokens and chat template; alone, the
    file gives the vocabulary only (no chat template, no eos token: the model's eos ids apply)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) == "tokenizer.json" and os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        return load_hf_tokenizer(directory, eos_token_ids)
    from transformers import PreTrainedTokenizerFast

    try:
        hf = PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as exc:
        raise ValueError(f"{path}: cannot load tokenizer ({_one_line(exc)})") from exc
    return Tokenizer(hf, eos_token_ids, source=path)


# bump when what is saved changes; the transformers version is in the key too (its conversion)
_TOKENIZER_CACHE_FORMAT = 1
_HASHED_HEAD_BYTES = 16 << 20  # the GGUF's metadata (vocabulary, merges, template) sits at its start


def cache_root() -> str | None:
    """Where pdserve keeps what it derives from a model file (GGUF tokenizers): `$PDSERVE_CACHE_DIR`,
    else `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`; None when `PDSERVE_CACHE_DIR` is set
    empty (no cache). The user's cache, like the HOME it defaults to: read when a tokenizer is
    converted, through pdserve.environment."""
    return environment.cache_root()


def _gguf_tokenizer_cache_dir(path: str) -> str | None:
    """The cache folder of `path`'s converted tokenizer: keyed by the file's size, its first 16 MiB
    (the metadata) and the transformers version, so a changed file or converter misses."""
    root = cache_root()
    if root is None:
        return None
    import hashlib

    import transformers

    digest = hashlib.blake2b(digest_size=16)
    try:
        digest.update(f"{_TOKENIZER_CACHE_FORMAT}|{transformers.__version__}|{os.path.getsize(path)}|".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_HASHED_HEAD_BYTES))
    except OSError:  # unreadable: no cache; the conversion says what is wrong with the file
        return None
    return os.path.join(root, "tokenizers", f"{os.path.basename(path)}-{digest.hexdigest()}")


def _save_tokenizer(hf: Any, directory: str) -> None:
    """Saves into a fresh folder beside `directory`, then renames it into place: a reader sees a
    whole tokenizer or none, and of two processes converting at once the second's rename loses."""
    import shutil
    import tempfile

    parent = os.path.dirname(directory)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    except OSError as exc:
        logger.debug("tokenizer cache not written (%s)", exc)
        return
    try:
        hf.save_pretrained(staging)
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide it from the cache's other users
        os.rename(staging, directory)
    except OSError:  # another process got there first, or the cache is read-only
        shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # a tokenizer that cannot be saved still serves: no cache then
        logger.warning("tokenizer cache not written for %s: %s", directory, _one_line(exc))
        shutil.rmtree(staging, ignore_errors=True)


@functools.lru_cache(maxsize=4)
def _gguf_hf_tokenizer(path: str) -> Any:
    """The converted tokenizer of a GGUF file: from the on-disk cache when it holds this file's
    conversion (a fraction of a second), else converted by `transformers` from the GGUF metadata
    (seconds: it parses the file's metadata again) and saved there for the next process."""
    from transformers import AutoTokenizer

    cached = _gguf_tokenizer_cache_dir(path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except Exception as exc:  # a damaged cache entry: convert again, and replace it
            logger.warning("tokenizer cache %s unreadable (%s); converting %s again", cached, _one_line(exc), path)
            import shutil

            shutil.rmtree(cached, ignore_errors=True)
    where = dict(pretrained_model_name_or_path=os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                 local_files_only=True)
    try:
        hf = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:
        # AutoTokenizer reads the file's model config first, and refuses an arch transformers
        # cannot load as a model (olmoe); the tokenizer itself needs only the tokenizer metadata
        from transformers import PreTrainedTokenizerFast

        try:
            hf = PreTrainedTokenizerFast.from_pretrained(**where)
        except Exception:
            raise ValueError(f"{path}: cannot build tokenizer from GGUF metadata ({_one_line(exc)})") from exc
        logger.debug("%s: tokenizer built without its model config (%s)", path, _one_line(exc))
    if cached is not None:
        _save_tokenizer(hf, cached)
    return hf


def load_gguf_tokenizer(path: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """A tokenizer and chat template from GGUF metadata, converted by `transformers`.

    The conversion takes seconds, so the result is cached per file: in the process, and on disk
    (`cache_root()`) for the next process.
    """
    path = os.path.abspath(path)
    return Tokenizer(_gguf_hf_tokenizer(path), eos_token_ids, source=path)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    if isinstance(exc, ImportError) and "from 'kernels'" in line:
        # transformers >= 5.25 imports the Hugging Face `kernels` package when it is installed;
        # this project's own top-level kernels/ package takes that name
        line += ("; transformers tried to import the Hugging Face `kernels` package, whose name pdserve's "
                 "kernels/ package takes: pip install 'transformers<5.25' (pdserve's pin) or pip uninstall kernels")
    return line
