"""The one error type model loading raises for a file it cannot use."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A weight or config file exists but cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
