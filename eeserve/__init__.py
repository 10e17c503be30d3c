"""eeserve: an inference and serving engine for early-exit LLMs."""

from eeserve.config import EngineConfig
from eeserve.exit_params import ExitParams
from eeserve.llm import LLM
from eeserve.outputs import CompletionOutput, ExitStats, RequestOutput
from eeserve.sampling_params import SamplingParams
from eeserve.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ExitParams",
    "ExitStats",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"
