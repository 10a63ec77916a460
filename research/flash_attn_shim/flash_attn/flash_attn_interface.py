"""The two names flash-attn's tests import from its interface module besides the public functions."""

USE_TRITON_ROCM = False  # the tests' switch for AMD's backend


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The CUDA kernel's key tile, which the tests read only to decode dropout masks (never run here)."""
    raise NotImplementedError("dropout is not supported; the tests that read the key tile are deselected")
