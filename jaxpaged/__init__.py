"""jaxpaged: a JAX LLM inference engine with a paged KV cache, shaped like vLLM."""

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.llm import LLM
from jaxpaged.logits_processor import LogitsContext, LogitsProcessor, LogitsProcessorConfig
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                              PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "BeamSearchParams", "ClassificationRequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EngineArgs", "Logprob", "LogitsContext", "LogitsProcessor",
           "LogitsProcessorConfig", "LoRARequest", "PoolingParams", "PoolingRequestOutput",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "ScoringRequestOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
