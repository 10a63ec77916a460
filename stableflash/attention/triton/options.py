"""`KernelOptions`: the one set of switches a user may change about how the fused kernels launch.

None changes the policy: each chooses between implementations of the native (production FA2) numerics. Those on
by default measured faster where they apply; `atomic_dq`, off by default, gives up determinism for one pass fewer
in the backward. Turn one off to compare, or to rule it out when something looks wrong:

    from stableflash.attention.triton import kernel_options
    with kernel_options(hopper_forward=False):
        out = flash_attention(q, k, v, backend="triton")
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    hopper_forward: bool = True
    """On sm_90, the Gluon forward (`hopper.py`) where `hopper.FORWARD_TILES` has a tile for the call."""
    tma: bool = True
    """At D = 128, let the autotuner also try streaming tiles by TMA (`tuning.TMA_MIN_HEAD_DIM`; not at 256)."""
    group_sum_in_program: bool = True
    """Grouped-query attention's dK/dV: each program sums its key/value head's query heads in fp32 before it stores
    (FA3's way); off, each query head's share is stored in the input dtype and summed over the group afterwards
    (flash-attn 2's way: one more pass over H heads of dK and dV, and other last bits). As `atomic_dq`, the value in
    force when a forward runs chooses its backward."""
    autotune: bool = True
    """Autotune each native launch that has no tile pick yet; off, it takes the kernel's first candidate tile (pointer
    loads), untuned and not recorded: for tests and one-off shapes, where the tuning costs more than it saves."""
    atomic_dq: bool = False
    """The native backward without its dQ kernel: the dK/dV programs add each key tile's share of dQ into fp32 with
    atomics (flash-attn 2's way), so P and dP are computed once rather than twice. Off by default: atomics add in no
    fixed order, so dQ's last bits vary from run to run, and a resumed run is no longer bit-exact. The value in
    force when a forward runs chooses its backward; flash-attn's calls with `deterministic=True` keep it off. The
    same layout was slower than the default as a study (`docs/kernels.md`): fewer products, but one atomic per
    element of dQ."""
    decode_kernel: bool = True
    """Calls of a few query rows per key/value head against a longer cache, with no gradient wanted (decoding): the
    split-KV kernel (`decoding.py`); off, the flash kernels, which give them one query tile per head."""


_current = KernelOptions()


def current() -> KernelOptions:
    return _current


def set_kernel_options(**changes) -> KernelOptions:
    """Change the options for this process; returns the previous ones. A TypeError names an unknown option."""
    global _current
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous


@contextlib.contextmanager
def kernel_options(**changes):
    """The options changed inside the block, restored after it."""
    previous = set_kernel_options(**changes)
    try:
        yield _current
    finally:
        set_kernel_options(**dataclasses.asdict(previous))
