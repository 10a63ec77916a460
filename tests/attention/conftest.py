import contextlib

import torch


@contextlib.contextmanager
def no_tile_picks():
    """The native kernels' tile picks (`tuning.TILE_PICKS`) emptied for the block and restored after it: a pick that
    an earlier autotuned test in the same process recorded is launched in place of the autotuner or of the first
    candidate tile, so a test that needs either sees none."""
    from stableflash.attention.triton.tuning import TILE_PICKS

    saved = TILE_PICKS.state_dict()
    TILE_PICKS.clear()
    try:
        yield
    finally:
        TILE_PICKS.clear()
        TILE_PICKS.load_state_dict(saved)


def fresh_seed() -> int:
    """A seed for a test's own generators, drawn from torch's global one, which `tests/conftest.py` seeds afresh for
    each test: `STABLEFLASH_TEST_SEED` replays it."""
    return int(torch.randint(2**31, ()))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def tied_inputs(num_ties: int, T: int = 64, D: int = 32, heads: int = 4, magnitude: float = 4.0, seed: int = 0,
                dtype=torch.bfloat16):
    """Non-causal inputs where every query row has exactly `num_ties` tied maximal scores.

    Keys 0..num_ties-1 are copies of one vector w; each query is a positive multiple of
    w, so those keys score identically and above every random key."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(heads, 1, D, generator=g)
    w = w / w.norm(dim=-1, keepdim=True) * D**0.5
    k = torch.randn(heads, T, D, generator=g) * 0.3
    k[:, :num_ties] = w
    scale = torch.rand(heads, T, 1, generator=g) * magnitude + magnitude
    q = w * scale / D**0.5
    v = -(torch.rand(heads, T, D, generator=g) * 2 + 0.5)  # one sign, as in the seed's V[:, 20]
    return tuple(t.unsqueeze(0).to(dtype) for t in (q, k, v))


def tied_below_zero_inputs(num_ties: int, T: int, D: int, heads: int):
    """Like `tied_inputs`, but every row's `num_ties` tied maximal scores are negative (SFA's m = 0 case): the other
    keys are w scaled by more than 1, and each query a negative multiple of w."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(heads, 1, D, generator=g)
    w = w / w.norm(dim=-1, keepdim=True) * D**0.5
    k = w * (1.05 + torch.rand(heads, T, 1, generator=g) * 0.5)
    k[:, :num_ties] = w
    q = -w * (1 + torch.rand(heads, T, 1, generator=g)) / D**0.5
    v = -(torch.rand(heads, T, D, generator=g) * 2 + 0.5)
    return tuple(t.unsqueeze(0).to(torch.bfloat16) for t in (q, k, v))
