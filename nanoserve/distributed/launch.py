"""Starting the ranks of a tensor-parallel engine and driving them, one plan per step.

Rank 0 holds the engine (scheduler, tokenizer, sampler, the server); every rank holds its
shard of the weights and the cache of its K/V heads, built by the same ``build_rank`` from the
same config. Each step rank 0 broadcasts the plan (pickled, over a gloo group of its own) and
every rank runs ``runner.execute(plan)``; the forward's collectives run on the compute group
(gloo on the CPU, NCCL on CUDA) whose timeout bounds how long a missing rank can stall a step.

Two launches: on one host ``build_engine(..., tensor_parallel_size=N)`` spawns ranks 1..N-1
itself and joins them over a free loopback port; under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set) the same call joins the launched ranks through env://, and on
every rank but 0 it serves plans until rank 0 closes, then exits the process.
"""

from __future__ import annotations

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

from nanoserve.distributed.shard import check_float_model, check_tensor_parallel, parallelize, shard_weights
from nanoserve.engine.build import build_rank, resolve_weights
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.plan import StepPlan
from nanoserve.model.loader import load_config

logger = logging.getLogger(__name__)

# A worker waits for the next plan as long as the server idles; rank 0's side of the plan
# channel (each process sets its own) and the forward's collectives are bounded.
IDLE_TIMEOUT = timedelta(days=365)
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
class ComputeLogits:
    """Rank 0 scores prompt positions: every rank runs the LM head on these hidden states."""

    hidden: torch.Tensor


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


def build_tensor_parallel(model, tokenizer, config: EngineConfig):
    """build_engine with tensor_parallel_size > 1 (module docstring: the two launches)."""
    size = config.tensor_parallel_size
    weight_plan, _ = resolve_weights(config.weights, config.dtype, config.device, named_model=isinstance(model, str))
    arch = load_config(model) if isinstance(model, str) else model.config
    check_tensor_parallel(arch, size, weight_plan)  # before any process starts
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
        config = _rank_device(config, local_rank)
        joined = _join(rank, size, "env://", config)
        if rank > 0:
            code = serve_plans(model, tokenizer, config, joined)
            raise SystemExit(code)
        return _driven_engine(model, tokenizer, config, joined, workers=[])
    port = free_port()
    if not str(config.device).startswith("cuda"):
        # The ranks share this host's cores: each takes its part (the workers get the same count).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // size)))
    threads = torch.get_num_threads()
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, size):
        process = context.Process(target=_worker_main, args=(rank, size, port, model, config, os.getpid(), threads),
                                  name=f"nanoserve-tp{rank}")
        process.start()
        workers.append(process)
    try:
        joined = _join(0, size, f"tcp://127.0.0.1:{port}", _rank_device(config, 0))
        return _driven_engine(model, tokenizer, _rank_device(config, 0), joined, workers)
    except BaseException:
        _kill(workers)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(config: EngineConfig, local_rank: int) -> EngineConfig:
    """Each rank on its own GPU (cuda or cuda:k -> cuda:<local rank>); the CPU is shared."""
    if str(config.device).startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return dataclasses.replace(config, device=f"cuda:{local_rank}")
    return config


def _join(rank: int, size: int, init_method: str, config: EngineConfig) -> Rank:
    cuda = str(config.device).startswith("cuda")
    timeout = timedelta(seconds=config.tensor_parallel_timeout)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else IDLE_TIMEOUT)
    startup = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Rank(rank, size, dist.group.WORLD, control, startup)


def _worker_main(rank: int, size: int, port: int, model, config: EngineConfig, parent: int, threads: int) -> None:
    """A spawned rank's process: join, build the shard, serve plans; leave when rank 0 does.
    (No tokenizer: only rank 0 reads or writes text.)"""
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    config = _rank_device(config, rank)
    joined = _join(rank, size, f"tcp://127.0.0.1:{port}", config)
    raise SystemExit(serve_plans(model, None, config, joined))


def _exit_with_parent(parent: int) -> None:
    # A rank 0 killed outright cannot stop its workers; they notice it gone and leave.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve_plans(model, tokenizer, config: EngineConfig, joined: Rank) -> int:
    """A rank > 0: build its shard, then apply each message of rank 0 until Stop. Returns the
    process's exit code (a fault is logged and leaves the process group)."""
    try:
        engine = build_rank(model, tokenizer, config, joined)
        joined.ready()
        runner, network = engine.runner, engine.model
        while True:
            message = _receive(joined)
            if isinstance(message, StepPlan):
                runner.execute(message)
            elif isinstance(message, ComputeLogits):
                with torch.inference_mode():
                    network.compute_logits(message.hidden.to(runner.device))
            elif isinstance(message, Stop):
                return 0
            else:
                raise RuntimeError(f"unknown message from rank 0: {message!r}")
    except Exception:
        logger.exception("tensor-parallel rank %d failed", joined.rank)
        return 1
    finally:
        dist.destroy_process_group()


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
        if healthy and all(w.is_alive() for w in self.workers):
            try:
                dist.broadcast_object_list([Stop()], src=0, group=self.joined.control)
            except Exception:
                logger.exception("tensor-parallel stop message failed")
        deadline = time.monotonic() + (JOIN_SECONDS if healthy else 0.0)
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
        _kill(self.workers)
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(workers: list) -> None:
    for w in workers:
        if w.is_alive():
            w.kill()
        w.join()


class DrivingRunner:
    """Rank 0's runner: each plan goes to every rank, then runs here on rank 0's shard."""

    def __init__(self, runner, driver: Driver) -> None:
        self.runner, self.driver = runner, driver
        self.decode_step, self.device = runner.decode_step, runner.device

    def execute(self, plan: StepPlan):
        return self.driver_call(lambda: self.runner.execute(plan), plan)

    def driver_call(self, work, message):
        try:
            self.driver.send(message)
            return work()
        except Exception:
            self.driver.close(healthy=False)
            raise

    def close(self) -> None:
        self.driver.close()


class DrivingLogits:
    """Rank 0's scoring model: the LM head's gather needs every rank, so each call is sent."""

    def __init__(self, model, runner: DrivingRunner) -> None:
        self.model, self.runner = model, runner

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.driver_call(lambda: self.model.compute_logits(hidden), ComputeLogits(hidden.cpu()))


def _driven_engine(model, tokenizer, config: EngineConfig, joined: Rank, workers: list):
    engine = build_rank(model, tokenizer, config, joined)
    joined.ready()  # the first plan's bounded broadcast must not wait on a rank still loading
    driver = Driver(joined, workers)
    engine.runner = DrivingRunner(engine.runner, driver)
    engine.scoring_model = DrivingLogits(engine.model, engine.runner)
    weakref.finalize(engine, driver.close)  # an engine dropped unclosed still stops its ranks
    return engine
