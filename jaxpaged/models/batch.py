"""The flat token batch a model forward pass consumes."""

import dataclasses

import jax

from jaxpaged.kernels import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """A mix of sequences, each bringing its new tokens (a decode token or a prompt chunk).

    Tokens of sequence i are input_ids[attn.cu_q_lens[i]:attn.cu_q_lens[i+1]]; padding tokens
    sit after the last sequence with slot -1 (never written).
    """

    input_ids: jax.Array       # i32[num_tokens]
    positions: jax.Array       # i32[num_tokens]  absolute position of each token in its sequence
    slot_mapping: jax.Array    # i32[num_tokens]  pool slot (block_id * block_size + offset) or -1
    logits_indices: jax.Array  # i32[num_logits]  which tokens to return logits for
    attn: AttentionMetadata
    # i32[num_tokens]  the sequence length a length-dependent rope (dynamic NTK, LongRoPE) is chosen for at
    # each token: max(the length its sequence had when its K/V began, the token's kv length), so that a
    # prompt's chunks all use what one forward of the whole prompt would
    rope_lens: jax.Array
    lora_index: jax.Array | None = None   # i32[num_tokens]  each token's LoRA slot (-1: base model); None: no LoRA
    # [num_tokens, hidden]  prompt embeddings: the input of each token whose id is -1 (enable_prompt_embeds;
    # None: every token's input is its row of the embedding table)
    input_embeds: jax.Array | None = None
    # i32[num_tokens, 3]  M-RoPE's (time, height, width) positions (a Qwen2-VL engine that runs images; None:
    # `positions` turn the rope)
    mrope_positions: jax.Array | None = None
