"""Autotuning of the native kernels, and the tile picks a resumed run launches again.

The native kernels are autotuned per (T, head dim, causal, features) over the candidate tiles below; at head dims of
`TMA_MIN_HEAD_DIM` and up, with `KernelOptions.tma`, over each tile twice, with pointer and with TMA loads. The
emulation kernels launch one fixed tile (`emulation_config`): their logical tiles are built from it.

Another tile sums in another order: other last bits. So every pick lands in `TILE_PICKS`, later launches take it
instead of autotuning again (a torch.compile'd one as a fixed tile), and the trainer keeps `state_dict()` in its
checkpoints and calls `load_state_dict()` before the first launch of a resumed run.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from stableflash.attention.triton import native
from stableflash.attention.triton.spec import INTERPRET, PHYSICAL_TILE

TMA_MIN_HEAD_DIM = 128
"""The head dims from which TMA loads are among the candidates: faster there, slower at D = 64
(results/kernel-variants/). Not at `WIDE_HEAD_DIM`, where they were never measured."""
WIDE_HEAD_DIM = 256
"""The head dim whose candidates are its own (`WIDE_*_CONFIGS`): 8 warps and two stages, the tiles whose shared
memory fits an H200's and whose registers spill little there (compiled for sm_90: research/tests)."""


def config(block_m: int, block_n: int, warps: int, stages: int, **extra) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, **extra}, num_warps=warps, num_stages=stages)


# The forward and dQ kernels need BLOCK_M % BLOCK_N == 0, the dK/dV kernel the reverse.
FWD_CONFIGS = [config(128, 64, 4, 3), config(128, 64, 8, 3), config(128, 128, 8, 3), config(128, 128, 8, 2),
               config(64, 64, 4, 3), config(128, 32, 4, 3)]
DKDV_CONFIGS = [config(32, 128, 4, 3), config(32, 128, 4, 5), config(64, 128, 8, 3), config(64, 128, 4, 3),
                config(64, 64, 4, 3), config(32, 64, 4, 3)]
DQ_CONFIGS = [config(128, 32, 4, 3), config(128, 32, 4, 5), config(128, 64, 8, 3), config(128, 64, 4, 3),
              config(64, 64, 4, 3), config(64, 32, 4, 3)]
WIDE_FWD_CONFIGS = [config(64, 64, 8, 2), config(128, 64, 8, 2), config(128, 32, 8, 2)]
WIDE_DKDV_CONFIGS = [config(32, 64, 8, 2), config(64, 64, 8, 2)]
WIDE_DQ_CONFIGS = [config(64, 32, 8, 2), config(128, 32, 8, 2), config(64, 64, 8, 2)]
INTERPRETER_CONFIG = config(64, 64, 4, 2)
DELTA_CONFIG = triton.Config({"BLOCK_M": 64}, num_warps=4, num_stages=1)  # δ alone: one pass over dO and O


def emulation_config(ops_fp32: bool, head_dim: int) -> triton.Config:
    """The one tile of the emulation kernels. fp32 matmul operands double the shared memory: at D = 128 a 64x64
    dK/dV tile asks 246,272 bytes, above an H200's 232,448; at D = 256 a 64x64 tile spills 0.4-2.3 KB even with
    bf16 operands."""
    if head_dim >= WIDE_HEAD_DIM or ops_fp32 and head_dim >= 128:
        return config(PHYSICAL_TILE // 2, PHYSICAL_TILE // 2, 4, 2)
    return config(PHYSICAL_TILE, PHYSICAL_TILE, 4, 2)


def _prune(configs, named_args, **meta):
    """At D = 128, tiles larger than 128x64 need 8 warps (with 4 they spill heavily)."""
    big_d = meta.get("HEAD_DIM", named_args.get("HEAD_DIM")) >= 128
    kept = [c for c in configs if not (big_d and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] > 128 * 64 and c.num_warps < 8)]
    return kept or configs


class Tunable(NamedTuple):
    """A native kernel with its autotuners: over pointer-load tiles, and over those tiles with and without TMA."""
    name: str
    """The kernel's name in the tile picks' keys (and so in checkpoints): stable across renames of the function."""
    kernel: triton.runtime.JITFunction
    key: tuple[str, ...]
    """The arguments whose values the autotuners tune for separately (with the tensors' dtypes)."""
    pointers: triton.runtime.Autotuner | None
    either: triton.runtime.Autotuner | None
    first: triton.Config
    """The first candidate with pointer loads: the tile launched untuned (`KernelOptions.autotune` off)."""
    wide: Tunable | None = None
    """The same kernel over its candidates at `WIDE_HEAD_DIM` (`at`)."""

    def at(self, head_dim: int) -> Tunable:
        """This kernel's tunable for a head dim: the wide one's candidates at `WIDE_HEAD_DIM`."""
        return self.wide if head_dim >= WIDE_HEAD_DIM and self.wide is not None else self

    @classmethod
    def of(cls, name, kernel, configs, key, restore=(), reset=(), wide_configs=None) -> Tunable:
        first = triton.Config({**configs[0].kwargs, "TMA": False}, num_warps=configs[0].num_warps,
                              num_stages=configs[0].num_stages)
        if INTERPRET:
            return cls(name, kernel, tuple(key), None, None, first)  # one tile for every head dim there

        def tuned(candidates):
            # kernels that add with atomics: the statistics into the caller's running totals (`restore`: autotuning's
            # trial runs leave them as they found them), dQ into a zeroed buffer (`reset`: zeroed again after them)
            return triton.autotune(candidates, key=list(key), prune_configs_by={"early_config_prune": _prune},
                                   restore_value=list(restore), reset_to_zero=list(reset))(kernel)

        def with_tma(c, tma):
            return triton.Config({**c.kwargs, "TMA": tma}, num_warps=c.num_warps, num_stages=c.num_stages)

        wide = cls.of(name, kernel, wide_configs, key, restore, reset) if wide_configs else None
        return cls(name, kernel, tuple(key), tuned([with_tma(c, False) for c in configs]),
                   tuned([with_tma(c, tma) for c in configs for tma in (False, True)]), first, wide)


# Each key names the compile-time switches that change the work per program, so that a masked or grouped launch is
# tuned for itself rather than reusing the plain launch's pick: a band or padding changes which tiles are visited,
# and a grouped dK/dV program does its group's work (a quarter of the programs with 4 query heads per key/value head).
BAND_SWITCHES = ("MASK", "PAD", "SEG")
SHAPE_SWITCHES = (*BAND_SWITCHES, "D_IN", "STRIDE8")  # and a head dim padded inside the kernels (masked loads and
# stores; with strides known to be multiples of 8, wider ones)
NATIVE_FWD = Tunable.of("attn_fwd", native._attn_fwd, FWD_CONFIGS,
                        ("T", "HEAD_DIM", "CAUSAL", "STAB", "STATS", *SHAPE_SWITCHES), restore=("STAT_COUNTS",),
                        wide_configs=WIDE_FWD_CONFIGS)
NATIVE_DQ = Tunable.of("attn_bwd_dq", native._attn_bwd_dq, DQ_CONFIGS, ("T", "HEAD_DIM", "CAUSAL", *SHAPE_SWITCHES),
                       wide_configs=WIDE_DQ_CONFIGS)
NATIVE_DKDV = Tunable.of("attn_bwd_dkdv", native._attn_bwd_dkdv, DKDV_CONFIGS,
                         ("T", "HEAD_DIM", "CAUSAL", *SHAPE_SWITCHES, "GROUP", "ATOMIC_DQ"), reset=("DQ_ACC",),
                         wide_configs=WIDE_DKDV_CONFIGS)


PickKey = tuple


class TilePicks:
    """Autotuner picks by launch; `state_dict()` is plain JSON-like data (lists, strings, numbers)."""

    def __init__(self):
        self._picks: dict[PickKey, triton.Config] = {}

    @staticmethod
    def key(kernel_name: str, candidates: str, T: int, dtype, meta: dict) -> PickKey:
        """What the autotuner's own key holds: the kernel, which candidates were tuned ("pointers" or "either"),
        T, the input dtype and the compile-time arguments; so a pick is reused exactly where the autotuner would."""
        return (kernel_name, candidates, int(T), str(dtype), *sorted(meta.items()))

    def get(self, key: PickKey) -> triton.Config | None:
        return self._picks.get(key)

    def record(self, key: PickKey, config: triton.Config) -> None:
        self._picks[key] = config

    def clear(self) -> None:
        self._picks.clear()

    def __len__(self) -> int:
        return len(self._picks)

    def items(self):
        return self._picks.items()

    def state_dict(self) -> list[dict]:
        return [{"key": [list(k) if isinstance(k, tuple) else k for k in key], "kwargs": dict(config.kwargs),
                 "num_warps": config.num_warps, "num_stages": config.num_stages}
                for key, config in self._picks.items()]

    def load_state_dict(self, state: list[dict]) -> int:
        """Adds the picks of `state` (a checkpoint's), replacing any made for the same launch in this process.
        Returns how many were left out: picks of kernels this version does not launch (older checkpoints')."""
        names = {t.name for t in (NATIVE_FWD, NATIVE_DQ, NATIVE_DKDV)}
        skipped = 0
        for pick in state:
            key = tuple(tuple(k) if isinstance(k, list) else k for k in pick["key"])
            if key[0] not in names:
                skipped += 1
                continue
            self._picks[key] = triton.Config(dict(pick["kwargs"]), num_warps=pick["num_warps"],
                                             num_stages=pick["num_stages"])
        return skipped


TILE_PICKS = TilePicks()
