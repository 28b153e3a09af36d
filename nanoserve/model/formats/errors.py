"""The one error type model loading raises for a file it cannot use."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A weight or config file exists but cannot be used; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        # One line, whatever the library it quotes wrote (torch's shape mismatches span several).
        problem = " ".join(line.strip() for line in str(problem).splitlines() if line.strip())
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
