"""Pick an attention implementation by name.

    reference  plain jnp (pallas_kernels/reference.py): ground truth, and the CPU path
    pallas     Pallas GPU kernel (Triton lowering); on CPU it runs in interpret mode (slow: tests)
    triton     a Triton kernel through jax-triton; needs a CUDA GPU
    auto       pallas on a CUDA GPU, reference elsewhere

An unavailable backend is an error, never a silent fallback.
"""

import functools

import jax

BACKENDS = ("auto", "reference", "pallas", "triton")


def resolve_backend(name: str, platform: str | None = None) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    platform = platform or jax.devices()[0].platform
    if name == "auto":
        return "pallas" if platform == "gpu" else "reference"
    if name == "triton":
        if platform != "gpu":
            raise ValueError("attention_backend='triton' needs a CUDA GPU (jax-triton kernels cannot run on "
                             f"{platform}); use 'reference' or 'pallas'")
        try:
            import jax_triton  # noqa: F401
        except ImportError as exc:
            raise ValueError("attention_backend='triton' needs jax-triton: pip install 'jaxpaged[cuda12]'") from exc
    return name


def get_attention(name: str, platform: str | None = None):
    """The attention function for a resolved backend name; same signature as the reference."""
    platform = platform or jax.devices()[0].platform
    if name == "reference":
        from pallas_kernels.reference import ragged_paged_attention_reference
        return ragged_paged_attention_reference
    if name == "pallas":
        from pallas_kernels.pallas_attention import ragged_paged_attention_pallas
        return functools.partial(ragged_paged_attention_pallas, interpret=platform != "gpu")
    if name == "triton":
        from pallas_kernels.triton_attention import ragged_paged_attention_triton
        return ragged_paged_attention_triton
    raise ValueError(f"unknown attention backend {name!r}")
