"""Tiny Hugging Face safetensors models, shared with tests/engine."""

from tests.engine.conftest import hf_models  # noqa: F401
