"""`Record`: a dataclass that saves to and loads from JSON (every diagnostic's result type)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TypeVar

R = TypeVar("R", bound="Record")


@dataclasses.dataclass
class Record:
    """Fields must be JSON types (numbers, strings, lists, dicts); tensors are stored as lists."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": type(self).__name__, **self.to_dict()}, indent=1))
        return path

    @classmethod
    def load(cls: type[R], path: str | Path) -> R:
        data = json.loads(Path(path).read_text())
        kind = data.pop("kind", cls.__name__)
        if kind != cls.__name__:
            raise ValueError(f"{path}: holds a {kind}, not a {cls.__name__}")
        return cls(**data)
