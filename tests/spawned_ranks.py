"""Runs a function on several spawned CPU processes joined in a gloo process group (a TCP
store on localhost), as torchrun would start them, and returns what each rank returned."""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import tempfile
from pathlib import Path

import torch.multiprocessing as mp


def run_ranks(worker: str, world_size: int, *args) -> list:
    """``worker`` (``"module:function"``, importable from the test folders) is called as
    ``function(rank, world_size, *args)`` on each of ``world_size`` processes; returns the
    ranks' return values (picklable) in rank order. A rank that raises fails the spawn."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(world_size, _free_port(), worker, out, args),
                 nprocs=world_size, join=True)
        return [pickle.loads((Path(out) / f"{rank}.pkl").read_bytes())
                for rank in range(world_size)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, worker: str, out: str, args) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")  # the reference path's notice, once per process
    torch.set_num_threads(1)  # several ranks share the CI machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo")
    try:
        module, name = worker.split(":")
        result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
        (Path(out) / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()
