"""The compiled decode graphs kept on disk, once per machine.

An entry is one bucket's ahead-of-time compiled ``decode_forward`` (torch's ``aot_compile``),
stored as ``<key>.graph`` under the cache directory (``$NANOSERVE_CACHE_DIR``, default
``~/.cache/nanoserve/compile``). The key hashes everything that changes the code the graph
holds: torch's version, nanoserve's own sources, the device, the kernel tier and
``ATEN_CPU_CAPABILITY``, the model's structure (every module's type and plain attributes, every
tensor's name, shape and dtype), the step's buffer shapes and the bucket. The graph's inductor
kernels are compiled into ``inductor/`` beside the entries, so a warm start compiles nothing.

A file is trusted only after its header names the same key and its payload's digest matches:
anything else (truncated, corrupt, foreign) is named in one line, removed and rebuilt. Writes go
to a temporary name and are renamed into place; a lock file per key lets two processes that
want the same entry build it once. The directory is bounded (entries and bytes): the least
recently used entries go first.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_INDUCTOR_ENV = threading.RLock()  # guards the process's TORCHINDUCTOR_CACHE_DIR while it is ours

MAGIC = b"nanoserve-graph\n"
FORMAT = 1
DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_BYTES = 4 << 30


# The first torch release whose aot-compiled functions serialise: 2.10's raise "does not implement
# SerializableCallable" at serialize (seen on its aarch64 wheel); 2.11 and 2.12 are unchecked.
SERIALISING_TORCH = (2, 13)


def torch_serialises_graphs(version: str = torch.__version__) -> bool:
    """Whether this torch can store a compiled graph on disk (else graphs compile in process)."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    return release >= SERIALISING_TORCH


def default_cache_dir() -> Path:
    """``$NANOSERVE_CACHE_DIR``, else ``~/.cache/nanoserve/compile``."""
    configured = os.environ.get("NANOSERVE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "nanoserve" / "compile"


@functools.cache
def source_digest() -> str:
    """A digest of nanoserve's own sources (Python and the kernels): a change to any of them
    can change a traced graph, so it changes every key."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_fingerprint(model: torch.nn.Module) -> str:
    """Every module's type and plain attributes (ints, floats, strings: sizes, eps, kernel
    handles) and every parameter's and buffer's name, shape and dtype: what a traced graph bakes
    in or is specialised on. The weights' values are inputs to the graph and do not count."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        plain = sorted((k, repr(v)) for k, v in vars(module).items()
                       if isinstance(v, (int, float, str, bool, type(None))) and not k.startswith("_"))
        digest.update(f"{name}:{type(module).__qualname__}:{plain}".encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.stride()}".encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class GraphKey:
    """What one entry was built for; ``digest`` names its file."""

    fields: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, **fields: object) -> GraphKey:
        environment = dict(torch=torch.__version__, nanoserve=source_digest(),
                           aten_cpu_capability=os.environ.get("ATEN_CPU_CAPABILITY", ""), format=str(FORMAT))
        return cls(tuple(sorted({**environment, **{k: str(v) for k, v in fields.items()}}.items())))

    @property
    def digest(self) -> str:
        return hashlib.sha256(repr(self.fields).encode()).hexdigest()[:32]

    def describe(self) -> dict[str, str]:
        return dict(self.fields)


class CacheEntryError(ValueError):
    """An entry on disk that must not be loaded (the message names the file and why)."""


class GraphCache:
    """Compiled graphs under ``root``, bounded by ``max_entries`` and ``max_bytes``."""

    def __init__(self, root: str | Path | None = None, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    def path(self, key: GraphKey) -> Path:
        return self.root / f"{key.digest}.graph"

    def has(self, key: GraphKey) -> bool:
        return self.path(key).exists()

    @contextlib.contextmanager
    def inductor_env(self):
        """Inductor's own cache (the graphs' compiled kernels) under this directory while a
        graph is built or loaded, unless the user chose one with TORCHINDUCTOR_CACHE_DIR. One
        build or load at a time in a process (the target's and a draft's loader threads), so
        the variable is never taken away from under another."""
        with _INDUCTOR_ENV:
            if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
                yield
                return
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)
            try:
                yield
            finally:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)

    @contextlib.contextmanager
    def building(self, key: GraphKey):
        """Held while ``key`` is built: a second process wanting it waits here, then finds it built."""
        with open(self.root / f"{key.digest}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def store(self, key: GraphKey, payload: bytes) -> Path:
        """Write the entry atomically (a temporary file renamed into place), then keep the
        directory within its bounds."""
        header = json.dumps(dict(key=key.describe(), sha256=hashlib.sha256(payload).hexdigest(),
                                 size=len(payload))).encode()
        path = self.path(key)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".tmp-", delete=False) as out:
            out.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(out.name, path)
        self.prune(keep=path)
        return path

    def read(self, key: GraphKey) -> bytes:
        """The entry's payload, checked against ``key`` and its digest. Raises CacheEntryError
        naming the file and the fault; FileNotFoundError when there is none."""
        path = self.path(key)
        data = path.read_bytes()
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            raise CacheEntryError(f"{path}: not a nanoserve graph entry")
        at = len(MAGIC) + 4
        length = int.from_bytes(data[len(MAGIC):at], "little")
        try:
            header = json.loads(data[at:at + length])
        except ValueError:
            raise CacheEntryError(f"{path}: unreadable header") from None
        if not isinstance(header, dict) or header.get("key") != key.describe():
            raise CacheEntryError(f"{path}: built for another key (a foreign entry)")
        payload = data[at + length:]
        if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise CacheEntryError(f"{path}: payload truncated or corrupt ({len(payload)} bytes, "
                                  f"header says {header.get('size')})")
        os.utime(path)  # recently used: pruned last
        return payload

    def discard(self, key: GraphKey, why: str) -> None:
        log.warning("nanoserve compile cache: %s; removed, to be rebuilt", why)
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def entries(self) -> list[Path]:
        return list(self.root.glob("*.graph"))

    def prune(self, keep: Path | None = None) -> None:
        """Remove the least recently used entries past ``max_entries`` or ``max_bytes``."""
        entries = []
        for path in self.entries():
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                entries.append((stat.st_mtime, stat.st_size, path))
        entries.sort(reverse=True)
        total = 0
        for count, (_, size, path) in enumerate(entries):
            total += size
            if path != keep and (count >= self.max_entries or total > self.max_bytes):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    (path.with_suffix(".lock")).unlink(missing_ok=True)


def serialize(compiled) -> bytes:
    """An aot-compiled function's bytes (torch's own serialisation)."""
    return type(compiled).serialize(compiled).serialized_data


def deserialize(payload: bytes):
    """An aot-compiled function from its bytes; the caller holds ``inductor_env``. Its guard
    check is off: a graph is built with no guards (graph_build.no_guards; its key is what it
    depends on), and checking none still bound the call's arguments each step (~2% of a
    SmolLM2-135M step)."""
    graph = torch.compiler.load_compiled_function(io.BytesIO(payload))
    graph.disable_guard_check()
    return graph
