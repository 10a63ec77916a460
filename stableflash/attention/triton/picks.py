"""The tiles the autotuner picked, kept so that a resumed run launches the same ones.

With native (`fa2`) numerics the kernels are autotuned in each process, and another tile sums in another order:
other last bits, so a resumed run could drift from an uninterrupted one. The launchers in `ops` record every pick
here and take a pick already here instead of autotuning; the trainer saves `TILE_PICKS.state_dict()` in its
checkpoints and loads it before the first launch. Under torch.compile a pick here is launched as a fixed tile
(inductor does not autotune it again); the trainer makes the picks eagerly before compiling (`Trainer`).

A pick is keyed by what the autotuner's own key holds (the kernel, whether TMA loads are candidates, T, the compile-time
arguments, the input dtype), so a pick is reused exactly where the autotuner would have reused it.
"""

from __future__ import annotations

import triton

PickKey = tuple


class TilePicks:
    """Autotuner picks by launch key; `state_dict()` is plain JSON-like data (lists, strings, numbers)."""

    def __init__(self):
        self._picks: dict[PickKey, triton.Config] = {}

    @staticmethod
    def key(kernel_name: str, candidates: str, T: int, dtype, meta: dict) -> PickKey:
        """`candidates`: which candidate list was tuned ("pointers" or "either": pointers and TMA)."""
        return (kernel_name, candidates, int(T), str(dtype), *sorted(meta.items()))

    def get(self, key: PickKey) -> triton.Config | None:
        return self._picks.get(key)

    def record(self, key: PickKey, config: triton.Config) -> None:
        self._picks[key] = config

    def clear(self) -> None:
        self._picks.clear()

    def __len__(self) -> int:
        return len(self._picks)

    def state_dict(self) -> list[dict]:
        return [{"key": [list(k) if isinstance(k, tuple) else k for k in key], "kwargs": dict(config.kwargs),
                 "num_warps": config.num_warps, "num_stages": config.num_stages}
                for key, config in self._picks.items()]

    def load_state_dict(self, state: list[dict]) -> None:
        """Adds the picks of `state` (a checkpoint's), replacing any made for the same launch in this process."""
        for pick in state:
            key = tuple(tuple(k) if isinstance(k, list) else k for k in pick["key"])
            self._picks[key] = triton.Config(dict(pick["kwargs"]), num_warps=pick["num_warps"],
                                             num_stages=pick["num_stages"])


TILE_PICKS = TilePicks()
