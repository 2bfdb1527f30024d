"""pdserve: prefill/decode disaggregated LLM serving."""

from pdserve.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the package must not pull torch
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(name)
