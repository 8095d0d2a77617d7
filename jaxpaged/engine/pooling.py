"""runner="pooling" in the engine: a pooling request runs as a one-token request whose step brings back
its last prompt token's final-normed hidden state, or a classifier's logits of it (ModelRunner.fetch),
and its output is that vector (PoolingRequestOutput) once finished as the request's task asks; the token
sampled beside it is dropped.

Tasks, as vLLM's: an embedding model (a *ForCausalLM or bare *Model) "embed"s; a sequence classifier
(*ForSequenceClassification: reward models, cross-encoder rerankers) "classify"s, and "score"s pairs when
it has one label. Every memory and scheduling feature applies as to any prompt: chunked prefill (the
vector comes with the last chunk), prefix caching (a prompt's last token is always computed), preemption,
priorities, data parallelism. An engine runs one kind of request: generate or pool, as vLLM's `runner`.
"""

import dataclasses

import numpy as np

from jaxpaged.pooling_params import PoolerConfig, PoolingParams, classifier_activations, finish_embedding
from jaxpaged.outputs import PoolingOutput, PoolingRequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


class Pooling:
    def __init__(self, pooler_config, model_source: str | None, hf_config, model_config):
        self.pooler = PoolerConfig.of(pooler_config, model_source)
        self.hidden_size = model_config.hidden_size
        self.architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
        self.matryoshka = bool(getattr(hf_config, "is_matryoshka", False)
                               or getattr(hf_config, "matryoshka_dimensions", None))
        self.num_labels = model_config.num_labels
        if self.num_labels:   # a classifier: its classes' names, and its logits' activations per task
            id2label = getattr(hf_config, "id2label", None) or {}
            self.labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(self.num_labels)]
            self.activations = classifier_activations(hf_config)
            self.tasks = ("classify", "score") if self.num_labels == 1 else ("classify",)
        else:
            self.tasks = ("embed",)

    def request_params(self, params: SamplingParams | None, pooling_params) -> tuple[SamplingParams, PoolingParams]:
        """The one-token SamplingParams a pooling request runs with, and its PoolingParams (checked, with
        its task: the model's own when it names none)."""
        if params is not None:
            raise ValueError("this engine runs runner='pooling': it pools prompts (LLM.embed, LLM.classify, "
                             "LLM.encode), it does not generate; make an engine with runner='generate' to sample")
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        task = pooling_params.task or self.tasks[0]
        if task not in self.tasks:
            raise ValueError(f"task={task!r}: {self.architecture} does not {task}; supported tasks of this model: "
                             f"{', '.join(self.tasks)}")
        pooling_params = dataclasses.replace(pooling_params, task=task)
        pooling_params.verify(self.hidden_size, self.matryoshka)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              truncate_prompt_tokens=pooling_params.truncate_prompt_tokens,
                              output_kind=RequestOutputKind.FINAL_ONLY), pooling_params

    def output(self, state, vector) -> PoolingRequestOutput:
        """A finished pooling request's output (state: its RequestState, with `pooling_params`)."""
        first = state.sequences[0].request
        return PoolingRequestOutput(state.request_id, PoolingOutput(self.finish(vector, state.pooling_params)),
                                    state.prompt_token_ids, True, max(first.num_cached_tokens, 0))

    def finish(self, vector, params: PoolingParams) -> np.ndarray:
        """The pooled row as the request's task asks: an embedding (dimensions, normalized), or a
        classifier's logits through its activation (probabilities, a score) unless use_activation=False."""
        if params.task == "embed":
            return finish_embedding(vector, params, self.pooler)
        logits = np.asarray(vector, np.float32)
        return logits if params.use_activation is False else self.activations[params.task](logits).astype(np.float32)


def no_pooling_params(pooling_params) -> None:
    if pooling_params is not None:
        raise ValueError("pooling_params need an engine made with runner='pooling' (LLM(model, runner='pooling')); "
                         "this one generates")
