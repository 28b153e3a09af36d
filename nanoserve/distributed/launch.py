"""Starting the ranks of a tensor-parallel worker and driving them, one plan per step.

Rank 0 holds the engine (scheduler, tokenizer, the server) around a ``DrivingWorker``; every
rank holds a ``Worker`` and nothing else: its shard of the weights and the cache of its K/V
heads, built by the same ``build_worker`` from the same ``WorkerConfig``. Each step rank 0
broadcasts the plan (pickled, over a gloo group of its own) and every rank runs its forward,
prompt scoring included (its LM head gathers over every rank); rank 0's worker alone then
samples, from its own logits: the step's sampling inputs and tokens never leave rank 0. The
forward's collectives run on the compute group (gloo on the CPU, NCCL on CUDA) whose timeout
bounds how long a missing rank can stall a step.

Two launches: on one host ``build_tensor_parallel`` (``build_engine(...,
tensor_parallel_size=N)``) spawns ranks 1..N-1 itself and joins them over a free loopback port;
under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the same call joins the
launched ranks through env://, and on every rank but 0 it serves plans until rank 0 closes,
then exits the process.

Every process leaves cleanly: rank 0's ``close`` (and, for an engine never closed, the
interpreter's exit, through ``_leave_at_exit``) sends Stop, waits for every rank to have left its
loop, then destroys the process groups; every other rank closes its worker and destroys them
before it exits. A process group left to the interpreter's teardown can abort the process
("terminate called without an active exception": a C++ thread of gloo or the store still
joinable when its object goes).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _set_pg_timeout  # torch's setter of a group's bound

from nanoserve.distributed.shard import check_float_model, check_tensor_parallel, parallelize, shard_weights
from nanoserve.model.formats.loader import load_config
from nanoserve.worker.build import WorkerConfig, build_worker
from nanoserve.worker.plan import StepPlan
from nanoserve.worker.sampling import StepSampling
from nanoserve.worker.worker import ForwardOutput, StepOutput, Worker, WorkerStats

logger = logging.getLogger(__name__)

# A worker waits for the next plan as long as the server idles; rank 0's side of the plan
# channel (each process sets its own) and the forward's collectives are bounded.
IDLE_TIMEOUT = timedelta(days=365)
# The rendezvous (and each group's creation) waits this long at least, however tight the
# collectives' bound: a spawned rank imports torch before it joins, which on a loaded host takes
# seconds.
JOIN_TIMEOUT = timedelta(seconds=60)
# How long close() waits for a worker to leave after the stop message before killing it.
JOIN_SECONDS = 10.0


@dataclass(frozen=True)
class Rank:
    """One process of a tensor-parallel engine, its process groups joined."""

    rank: int
    size: int
    group: object  # the forward's collectives
    control: object  # rank 0's messages (gloo)
    startup: object  # the barrier every rank passes once built (gloo, unbounded: loading takes what it takes)

    def ready(self) -> None:
        """Wait for every rank to have built its shard (a rank that died meanwhile fails it)."""
        dist.barrier(group=self.startup)

    def shard(self, model, sources: dict) -> dict:
        return shard_weights(model, self.rank, self.size, sources)

    def parallelize(self, model) -> None:
        parallelize(model, self.rank, self.size, self.group)


@dataclass(frozen=True)
class Stop:
    """Rank 0 is closing: leave the loop."""


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun (or anything setting its
    variables), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def build_tensor_parallel(model, spec: WorkerConfig, size: int, timeout: float) -> DrivingWorker:
    """Rank 0's worker over ``size`` ranks (module docstring: the two launches); ``timeout`` is
    how long, in seconds, a collective may wait for a rank."""
    arch = load_config(model) if isinstance(model, str) else model.config
    check_tensor_parallel(arch, size, spec.weights)  # before any process starts
    if not isinstance(model, str):
        check_float_model(model)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a process group (another tensor-parallel engine "
                           "still open?): close it first")
    launched = torchrun_env()
    if launched is not None:
        rank, world, local_rank = launched
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} ranks")
        spec = _rank_device(spec, local_rank)
        joined = _join(rank, size, "env://", spec.device, timeout)
        if rank > 0:
            raise SystemExit(serve_plans(model, spec, joined))
        try:
            return _driving_worker(model, spec, joined, workers=[])
        except BaseException:
            _leave_process_group()
            raise
    port = free_port()
    if not spec.device.startswith("cuda"):
        # The ranks share this host's cores: each takes its part (the workers get the same count).
        torch.set_num_threads(max(1, min(torch.get_num_threads(), usable_cores() // size)))
    threads = torch.get_num_threads()
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, size):
        process = context.Process(target=_worker_main,
                                  args=(rank, size, port, model, spec, timeout, os.getpid(), threads),
                                  name=f"nanoserve-tp{rank}")
        process.start()
        workers.append(process)
    try:
        spec = _rank_device(spec, 0)
        joined = _join(0, size, f"tcp://127.0.0.1:{port}", spec.device, timeout)
        return _driving_worker(model, spec, joined, workers)
    except BaseException:
        _kill(workers)
        _leave_process_group()
        raise


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(spec: WorkerConfig, local_rank: int) -> WorkerConfig:
    """Each rank on its own GPU (cuda or cuda:k -> cuda:<local rank>); the CPU is shared."""
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return dataclasses.replace(spec, device=f"cuda:{local_rank}")
    return spec


def _join(rank: int, size: int, init_method: str, device: str, timeout_seconds: float) -> Rank:
    cuda = device.startswith("cuda")
    timeout = timedelta(seconds=timeout_seconds)
    # torch.distributed.nn's functions take group.WORLD as a default argument, read when the module
    # is first imported (torch._dynamo imports it, lazily, at the first collective): imported
    # after this join it would hold the world group, its threads and rank 0's store server past
    # destroy_process_group, still running while the interpreter exits (SIGABRT there, now and then).
    import torch.distributed.nn  # noqa: F401
    # Each group's creation is a rendezvous of every rank, under the join's bound (a rank may come
    # seconds late: a spawned one imports torch first); then the group gets its own bound.
    join = max(timeout, JOIN_TIMEOUT)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=join)
    _register_exit()
    control = dist.new_group(backend="gloo", timeout=join)
    startup = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _set_pg_timeout(timeout, dist.group.WORLD)  # the forward's collectives
    _set_pg_timeout(timeout if rank == 0 else IDLE_TIMEOUT, control)
    return Rank(rank, size, dist.group.WORLD, control, startup)


def _worker_main(rank: int, size: int, port: int, model, spec: WorkerConfig, timeout: float, parent: int,
                 threads: int) -> None:
    """A spawned rank's process: join, build its worker, serve plans; leave when rank 0 does."""
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    spec = _rank_device(spec, rank)
    joined = _join(rank, size, f"tcp://127.0.0.1:{port}", spec.device, timeout)
    raise SystemExit(serve_plans(model, spec, joined))


def _exit_with_parent(parent: int) -> None:
    # A rank 0 killed outright cannot stop its workers; they notice it gone and leave.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve_plans(model, spec: WorkerConfig, joined: Rank) -> int:
    """A rank > 0: build its worker, then apply each plan of rank 0 until Stop. Returns the
    process's exit code; either way the worker is closed and the process groups destroyed
    (a fault is logged)."""
    worker = None
    try:
        worker = build_worker(model, spec, joined)
        joined.ready()
        while True:
            message = _receive(joined)
            if isinstance(message, StepPlan):
                worker.execute(message)  # the forward only: rank 0 samples
            elif isinstance(message, Stop):
                _goodbye(joined)  # rank 0 tears down only once every rank is out of its loop
                return 0
            else:
                raise RuntimeError(f"unknown message from rank 0: {message!r}")
    except Exception:
        logger.exception("tensor-parallel rank %d failed", joined.rank)
        return 1
    finally:
        if worker is not None:
            worker.close()
        _leave_process_group()


def _goodbye(joined: Rank) -> None:
    """After Stop: every rank meets here once out of its loop, so none tears its groups down
    under another's collective."""
    dist.barrier(group=joined.control)


def _leave_process_group() -> None:
    """Destroy every process group of this process (nothing if there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_drivers: weakref.WeakSet = weakref.WeakSet()  # rank 0's drivers still open in this process
_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_leave_at_exit)
        _exit_registered = True


def _leave_at_exit() -> None:
    """At the interpreter's exit, while it is whole: close the drivers left open (their ranks get
    Stop), then destroy the process groups, before any C++ object holding a thread goes."""
    for driver in list(_drivers):
        driver.close()
    _leave_process_group()


def _receive(joined: Rank):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=joined.control)
    return box[0]


class Driver:
    """Rank 0's side: send each message to the other ranks, and watch the local ones. Any
    failure (a worker gone, a collective timing out) closes every rank and is raised."""

    def __init__(self, joined: Rank, workers: list) -> None:
        self.joined, self.workers = joined, workers
        self.closed = False
        _drivers.add(self)

    def send(self, message) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is closed")
        dead = [w for w in self.workers if not w.is_alive()]
        if dead:
            raise RuntimeError("tensor-parallel worker " + ", ".join(
                f"{w.name} (pid {w.pid}) exited with code {w.exitcode}" for w in dead))
        dist.broadcast_object_list([message], src=0, group=self.joined.control)

    def close(self, healthy: bool = True) -> None:
        """Stop the workers (a Stop message when ``healthy``, then kill what is still running)
        and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _drivers.discard(self)
        if healthy and all(w.is_alive() for w in self.workers) and dist.is_initialized():
            try:
                dist.broadcast_object_list([Stop()], src=0, group=self.joined.control)
                _goodbye(self.joined)
            except Exception:
                logger.exception("tensor-parallel stop message failed")
        deadline = time.monotonic() + (JOIN_SECONDS if healthy else 0.0)
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
        _kill(self.workers)
        _leave_process_group()


def _kill(workers: list) -> None:
    for w in workers:
        if w.is_alive():
            w.kill()
        w.join()


class DrivingWorker:
    """Rank 0's worker: each plan goes to every rank, then runs here on rank 0's shard, which
    samples. The same interface as a ``Worker`` (``execute``, ``forward``, ``stats``,
    ``check_slots``, ``close``), and rank 0's parts to report."""

    def __init__(self, worker: Worker, driver: Driver) -> None:
        self.worker, self.driver = worker, driver
        self.model, self.cache, self.decode_step, self.device = worker.model, worker.cache, worker.decode_step, worker.device

    @property
    def draft(self):
        """The draft model proposing on rank 0 (speculative/draft.py), or None."""
        return self.worker.draft

    @draft.setter
    def draft(self, draft) -> None:
        self.worker.draft = draft

    def execute(self, plan: StepPlan, sampling: StepSampling | None = None) -> StepOutput:
        """A plan whose proposals rank 0's draft makes is drafted here first: every rank gets
        it with its proposals (and its row changes, which rank 0 has applied)."""
        try:
            filled, sampling, drafted = self.worker.propose(plan, sampling)
            self.driver.send(dataclasses.replace(filled, row_changes=plan.row_changes))
            output = self.worker.execute(filled, sampling)
            output.draft = drafted
            return output
        except Exception:
            self.driver.close(healthy=False)
            raise

    def forward(self, plan: StepPlan) -> ForwardOutput:
        try:
            self.driver.send(plan)
            return self.worker.forward(plan)
        except Exception:
            self.driver.close(healthy=False)
            raise

    def stats(self) -> WorkerStats:
        return self.worker.stats()

    def check_slots(self, tables, rows) -> None:
        self.worker.check_slots(tables, rows)

    def close(self) -> None:
        """Stop every rank and leave the process groups, then close rank 0's own worker."""
        self.driver.close()
        self.worker.close()


def _driving_worker(model, spec: WorkerConfig, joined: Rank, workers: list) -> DrivingWorker:
    worker = build_worker(model, spec, joined)
    joined.ready()  # the first plan's bounded broadcast must not wait on a rank still loading
    driver = Driver(joined, workers)
    driving = DrivingWorker(worker, driver)
    weakref.finalize(driving, driver.close)  # a worker dropped unclosed still stops its ranks
    return driving
