"""runner="pooling" in the engine: a pooling request runs as a one-token request whose step brings back
its last prompt token's final-normed hidden state (ModelRunner.fetch), and its output is that vector
(PoolingRequestOutput) once pooled as the request asks; the token sampled beside it is dropped.

Every memory and scheduling feature applies as to any prompt: chunked prefill (the vector comes with
the last chunk), prefix caching (a prompt's last token is always computed), preemption, priorities,
data parallelism. An engine runs one kind of request: generate or pool, as vLLM's `runner`.
"""

from jaxpaged.pooling_params import PoolerConfig, PoolingParams, finish_embedding
from jaxpaged.outputs import PoolingOutput, PoolingRequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


class Pooling:
    def __init__(self, pooler_config, model_source: str | None, hf_config, hidden_size: int):
        self.pooler = PoolerConfig.of(pooler_config, model_source)
        self.hidden_size = hidden_size
        self.matryoshka = bool(getattr(hf_config, "is_matryoshka", False)
                               or getattr(hf_config, "matryoshka_dimensions", None))

    def request_params(self, params: SamplingParams | None, pooling_params) -> tuple[SamplingParams, PoolingParams]:
        """The one-token SamplingParams a pooling request runs with, and its PoolingParams (checked)."""
        if params is not None:
            raise ValueError("this engine runs runner='pooling': it pools prompts (LLM.embed, LLM.encode), it "
                             "does not generate; make an engine with runner='generate' to sample")
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        pooling_params.verify(self.hidden_size, self.matryoshka)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              truncate_prompt_tokens=pooling_params.truncate_prompt_tokens,
                              output_kind=RequestOutputKind.FINAL_ONLY), pooling_params

    def output(self, state, vector) -> PoolingRequestOutput:
        """A finished pooling request's output (state: its RequestState, with `pooling_params`)."""
        first = state.sequences[0].request
        return PoolingRequestOutput(state.request_id, PoolingOutput(finish_embedding(vector, state.pooling_params,
                                                                                     self.pooler)),
                                    state.prompt_token_ids, True, max(first.num_cached_tokens, 0))


def no_pooling_params(pooling_params) -> None:
    if pooling_params is not None:
        raise ValueError("pooling_params need an engine made with runner='pooling' (LLM(model, runner='pooling')); "
                         "this one generates")
