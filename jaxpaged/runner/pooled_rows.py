"""runner="pooling": the f32 vector each pooling request gets, from its step's hidden states, on the host.

pooling_type (vLLM's PoolerConfig): LAST, the prompt's last token's hidden state (a sample row's); MEAN, the
mean over every prompt token; CLS, the first token's. All are final-normed as the LM head would read them
(models/norms.norm: RMSNorm, or a mean-centred LayerNorm, with a bias or not), then through a classifier's
`score` head where the model has one. MEAN and CLS read every token's hidden state: a request's chunks add
theirs up on the request (`Request.pool_state`), begun again from its first token when it is recomputed; an
engine pooling them keeps no prefix cache (a cached token's hidden state is not computed)."""

import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PooledRows:
    def __init__(self, runner, pooling_type: str):
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}")
        self.runner = runner
        self.pooling_type = pooling_type
        self._host_weights = {}   # name -> (the device's weight, its f32 host copy): the final norm and the head

    @property
    def every_token(self) -> bool:
        """Whether the vectors read every token's hidden state (MEAN, CLS), not only the sample rows'."""
        return self.pooling_type != "LAST"

    def vectors(self, hidden: np.ndarray, inputs) -> dict[str, np.ndarray]:
        """request id -> its vector, for the requests whose prompt ends in this step (InputBatch `inputs`);
        `hidden`: the sample rows' hidden states (LAST) or every token's (MEAN, CLS)."""
        if not self.every_token:
            pooled = self.head(self.normed(hidden[inputs.rows]))
            return {request.request_id: vector for request, vector in zip(inputs.requests, pooled)}
        for request, flat, count, start in inputs.prompt_chunks:
            rows = self.normed(hidden[flat:flat + count])
            if start == 0:   # (again from the first token: a recomputed request)
                request.pool_state = (rows[0].copy(), 0) if self.pooling_type == "CLS" else (0.0, 0)
            total, seen = request.pool_state
            if self.pooling_type == "MEAN":
                request.pool_state = total + rows.sum(axis=0), seen + count
        out = {}
        for request in inputs.requests:
            total, seen = request.pool_state
            out[request.request_id] = self.head((total / seen if self.pooling_type == "MEAN" else total)[None])[0]
        return out

    def normed(self, hidden: np.ndarray) -> np.ndarray:
        """f32 hidden states through the model's final norm (compute_logits' first step)."""
        cfg = self.runner.model_config
        x = hidden.astype(np.float32)
        if cfg.layer_norm:
            x = x - np.mean(x, axis=-1, keepdims=True)
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(cfg.rms_norm_eps))
        x = x * (self._host_weight("final_norm") + np.float32(cfg.norm_offset))
        if cfg.norm_bias:
            x = x + self._host_weight("final_norm_bias")
        return x

    def head(self, x: np.ndarray) -> np.ndarray:
        """A classifier's logits of pooled rows (its `score` head); an embedding model's rows as they are."""
        return x @ self._host_weight("classifier").T if self.runner.model_config.num_labels else x

    def _host_weight(self, name: str) -> np.ndarray:
        """A top-level weight's f32 host copy, fetched once per weights (new ones: update_weights, wake_up)."""
        weight = self.runner.state[name].get_value()
        if self._host_weights.get(name, (None,))[0] is not weight:
            from jaxpaged.runner.model_runner import _to_host
            self._host_weights[name] = (weight, _to_host(weight).astype(np.float32))
        return self._host_weights[name][1]
