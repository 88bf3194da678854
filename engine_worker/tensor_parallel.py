"""One engine over tensor-parallel ranks: a process per rank, in torch.distributed's
default group (gloo on the CPU, NCCL on CUDA), the model split between them
(models/layers/parallel.py).

``python -m engine_worker --tensor-parallel-size N`` is rank 0. It starts ranks 1 to
N-1 as the same command, each told its place by torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the group's rendezvous on loopback).
A launcher of one's own (torchrun, a Kubernetes job) may start every rank with those
set instead; rank 0 then starts none. Rank 0 binds the engine's socket and runs the
server, the scheduler and the sampler; every step it prepares is broadcast to the
others (step_inputs.py), which run it on their shards (``follow``). The protocol, the
frontend and the cluster see one engine.

Placement: on CUDA, rank r takes cuda:LOCAL_RANK. On the CPU, each rank is pinned to
its share of the cores the engine may use (one socket's, where the shares are the
sockets), with a thread a core unless --threads says otherwise.

Failure: the ranks are one unit. Rank 0 watches the ranks it started: when one exits,
rank 0 logs which and exits too (code 1), taking the rest down, and the supervisor
restarts the engine whole; the frontend retries its requests as for any engine's death.
A rank whose rank 0 is gone exits: the kernel kills it with its parent
(PR_SET_PDEATHSIG), and a broadcast whose source closed fails.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a collective may wait: a rank that follows waits for rank 0's next step for
# as long as the engine is idle (a dead peer is seen by its closed connection and by
# the watch, not by this).
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


def rank_from_environment() -> Optional[int]:
    """This process's rank, where a launcher set RANK (None: it is the first)."""
    rank = os.environ.get("RANK")
    return None if rank is None else int(rank)


class Ranks:
    """The ranks rank 0 started (ranks 1..size-1, as this command): watched, stopped."""

    def __init__(self, argv: Sequence[str], size: int) -> None:
        """The group's rendezvous is a free loopback port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          WORLD_SIZE=str(size), RANK="0", LOCAL_RANK="0")
        parent = os.getpid()
        self.procs = [subprocess.Popen([sys.executable, "-m", "engine_worker", *argv],
                                       env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r)),
                                       preexec_fn=lambda: _die_with_parent(parent))
                      for r in range(1, size)]
        self.stopping = threading.Event()

    def watch(self) -> None:
        """A rank that exits before rank 0 stops them ends this process (and so the
        others): the engine is restarted whole."""
        def run() -> None:
            while not self.stopping.wait(0.2):
                for rank, p in enumerate(self.procs, start=1):
                    code = p.poll()
                    if code is not None and not self.stopping.is_set():
                        logger.critical("tensor-parallel rank %d exited with code %s: the "
                                        "engine stops (restarted whole by its supervisor)",
                                        rank, code)
                        self.stop(0.0)
                        os._exit(1)

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0, leaving (after telling them, where it can): the ranks are gone when
        this returns."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def join(rank: int, size: int, device: str, threads: Optional[int]) -> tuple[str, int]:
    """Join the group as ``rank``; (the device this rank computes on, its threads).
    ValueError where a launcher's variables do not fit."""
    world = int(os.environ.get("WORLD_SIZE", size))
    if world != size or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of WORLD_SIZE {world} does not fit "
                         f"--tensor-parallel-size {size}")
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise ValueError(f"tensor-parallel rank {rank} needs cuda:{local}; this machine "
                             f"has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local)
        backend, device = "nccl", f"cuda:{local}"
    else:
        backend = "gloo"
        threads = _pin(rank, size, threads)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return device, threads or 1


def _pin(rank: int, size: int, threads: Optional[int]) -> int:
    """The rank's share of this process's cores, pinned to them; its threads. The cores
    are taken socket by socket (a share is whole sockets where the sockets divide
    among the ranks), each socket's in order of its physical cores, so that a share
    holds both threads of a core rather than one of each of two."""
    cores = sorted(os.sched_getaffinity(0), key=_placement)
    if len(cores) < size:
        logger.warning("%d cores for %d tensor-parallel ranks: ranks share cores",
                       len(cores), size)
        return threads or 1
    share = cores[rank * len(cores) // size:(rank + 1) * len(cores) // size]
    os.sched_setaffinity(0, share)
    logger.info("tensor-parallel rank %d of %d: cores %s", rank, size,
                ",".join(map(str, share)))
    return threads or len(share)


def _placement(cpu: int) -> tuple[int, int, int]:
    """(socket, physical core, cpu) of a logical cpu, as sysfs says (else its number)."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(topology + "physical_package_id") as f:
            socket_id = int(f.read())
        with open(topology + "core_id") as f:
            core = int(f.read())
    except (OSError, ValueError):
        return (0, cpu, cpu)
    return (socket_id, core, cpu)


try:   # (loaded here, not in the child between fork and exec)
    _LIBC: Optional[ctypes.CDLL] = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:   # not glibc
    _LIBC = None


def _die_with_parent(parent: int) -> None:
    """(In a rank rank 0 starts, between fork and exec.) Killed when rank 0 exits;
    gone at once if it exited already."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def follow(engine) -> int:
    """A rank other than 0: run rank 0's steps on this rank's shards until it stops
    (signals are rank 0's: it drains, then tells this rank to stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logger.info("tensor-parallel rank %d of %d: following rank 0's steps",
                engine.runner.parallel.rank, engine.runner.parallel.size)
    try:
        engine.runner.follow()
    except Exception as e:   # rank 0 is gone (its connection closed)
        logger.error("tensor-parallel rank %d: lost rank 0 (%s); exiting",
                     engine.runner.parallel.rank, e)
        return 1
    return 0
