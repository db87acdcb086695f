"""One job over many rows, in this process or on a Ray cluster, with the same worker and results.

``map_with_llm`` hands the rows, a batch at a time, to ``worker(llm, batch) -> results``. Without
Ray it loads one ``LLM`` here. With Ray, Ray Data streams the rows into a pool of actors that each
hold one ``LLM`` (``replicas`` of them, each reserving ``num_cpus`` CPUs and ``num_gpus`` GPUs).
A replica that dies is restarted and its batch retried: every row carries its index, so results
come back in input order, each row exactly once. Ray is an optional extra, imported only here.
"""

from __future__ import annotations

import argparse
import pickle
import socket
import warnings
from typing import Callable

from multispec.params import check_int, check_real

__all__ = ["add_ray_arguments", "map_with_llm", "ray_options"]

REPLICA_RESTARTS = 3
"""How often Ray restarts a dead replica, and retries a batch it was running, before the job
fails: enough for a lost node or an out-of-memory kill, not an endless loop on a batch that
kills its replica every time (Ray Data's default for actor pools: restart and retry forever).
Ray 2.60 takes these actor options only as extra ``map_batches`` keywords, which it marks
deprecated: that warning is muted."""
CONNECT_TIMEOUT = 5.0
"""Seconds to reach a Ray address before calling it unreachable."""

Worker = Callable[..., list]


def map_with_llm(rows: list[dict], worker: Worker, llm_options: dict, *, ray_address: str | None | bool = None,
                 replicas: int = 1, num_cpus: float = 1, num_gpus: float = 0, batch_size: int = 8) -> list[dict]:
    """``worker(llm, batch_rows)`` over ``rows`` in batches of ``batch_size``; one result per row,
    in input order.

    ``worker`` must be a picklable top-level function returning one dict per row of its batch;
    ``llm_options`` are the keyword arguments of ``LLM``. ``ray_address``: None or False runs in
    this process with one ``LLM``; True or "auto" uses Ray as ``ray.init()`` finds it (the Ray this
    process already joined, ``RAY_ADDRESS``, a cluster started on this machine with ``ray start``,
    else a new local one); any other string is the address of a running cluster ("HOST:PORT" or
    "ray://HOST:PORT"). An address that cannot be reached, or Ray missing, is a ValueError.
    """
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError("rows: must be a list of dicts")
    if not callable(worker):
        raise ValueError(f"worker={worker!r}: must be a function worker(llm, rows) -> list of dicts")
    if not isinstance(llm_options, dict):
        raise ValueError(f"llm_options={llm_options!r}: must be a dict of LLM keyword arguments")
    replicas = check_int("replicas", replicas, 1)
    num_cpus = check_real("num_cpus", num_cpus, "must be a number >= 0", lambda x: x >= 0)
    num_gpus = check_real("num_gpus", num_gpus, "must be a number >= 0", lambda x: x >= 0)
    batch_size = check_int("batch_size", batch_size, 1)
    if (ray_address is not None and not isinstance(ray_address, (bool, str))) or ray_address == "":
        raise ValueError(f"ray_address={ray_address!r}: must be None, True, 'auto' or a cluster address")
    if not rows:
        return []
    if ray_address is None or ray_address is False:
        return _in_process(rows, worker, llm_options, batch_size)
    return _on_ray(rows, worker, llm_options, ray_address, replicas, num_cpus, num_gpus, batch_size)


def _in_process(rows: list[dict], worker: Worker, llm_options: dict, batch_size: int) -> list[dict]:
    from multispec.api import LLM

    llm = LLM(**llm_options)
    results = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        results.extend(_checked(worker(llm, batch), len(batch)))
    return results


def _checked(results, expected: int) -> list[dict]:
    if not isinstance(results, list) or len(results) != expected or not all(isinstance(r, dict) for r in results):
        raise RuntimeError(f"the worker must return a list of {expected} dicts, one per row of its batch; got "
                           f"{type(results).__name__} of {len(results) if isinstance(results, list) else '?'}")
    return results


def _on_ray(rows: list[dict], worker: Worker, llm_options: dict, address: str | bool, replicas: int,
            num_cpus: float, num_gpus: float, batch_size: int) -> list[dict]:
    """Rows travel pickled in a binary column next to their index: Arrow, Ray Data's block format,
    cannot hold arbitrary dicts (a field that is a number in one row and a string in another)."""
    ray = _import_ray()
    joined = _join(ray, address)
    try:
        dataset = ray.data.from_items([{"index": i, "row": pickle.dumps(row)} for i, row in enumerate(rows)])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            results = dataset.map_batches(
                _Replica, fn_constructor_kwargs={"worker": worker, "llm_options": llm_options},
                compute=ray.data.ActorPoolStrategy(size=replicas), num_cpus=num_cpus, num_gpus=num_gpus,
                batch_size=batch_size, batch_format="pyarrow", max_restarts=REPLICA_RESTARTS,
                max_task_retries=REPLICA_RESTARTS)
        return _in_order(results.iter_rows(), len(rows))
    finally:
        if joined:
            ray.shutdown()


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError("Ray is not installed: pip install multispec[ray] (or run without --ray)") from None
    return ray


def _join(ray, address: str | bool) -> bool:
    """Connect this process to Ray unless it already is; True when this call connected it (and
    so disconnects it after, shutting down a local Ray it started). An explicit address is
    checked first even so; a process that already joined a cluster keeps it."""
    explicit = address is not True and address != "auto"
    if explicit:
        _check_reachable(address)
    if ray.is_initialized():
        return False
    if not explicit:
        ray.init()
        return True
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError, TimeoutError) as error:
        raise ValueError(f"Ray address {address!r}: cannot join the cluster: {error}") from None
    return True


def _check_reachable(address: str) -> None:
    """Fail in seconds, naming the address, where ``ray.init`` would retry for a minute."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r}: expected HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as error:
        raise ValueError(f"Ray address {address!r} cannot be reached: {error}") from None


class _Replica:
    """One actor of the pool: loads one LLM when (re)started, then runs the worker on each batch."""

    def __init__(self, worker: Worker, llm_options: dict):
        from multispec.api import LLM

        self.worker = worker
        self.llm = LLM(**llm_options)

    def __call__(self, batch):
        import pyarrow as pa

        rows = [pickle.loads(blob) for blob in batch.column("row").to_pylist()]
        results = _checked(self.worker(self.llm, rows), len(rows))
        return pa.table({"index": batch.column("index"),
                         "result": pa.array([pickle.dumps(r) for r in results], pa.binary())})


def _in_order(records, count: int) -> list[dict]:
    """Results by row index, the first of any duplicate kept; every row must have one."""
    by_index = {}
    for record in records:
        by_index.setdefault(record["index"], record["result"])
    missing = [i for i in range(count) if i not in by_index]
    if missing:
        raise RuntimeError(f"{len(missing)} rows came back without a result (first: row {missing[0]})")
    return [pickle.loads(by_index[i]) for i in range(count)]


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]``, ``--replicas``, ``--num-cpus``, ``--num-gpus``, ``--batch-size``."""
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="run on Ray: the cluster at ADDRESS (HOST:PORT or ray://HOST:PORT), or without ADDRESS "
                             "the one RAY_ADDRESS or `ray start` on this machine names, else a new local one")
    parser.add_argument("--replicas", type=int, default=1, help="with --ray: actors, each holding one model")
    parser.add_argument("--num-cpus", type=float, default=1.0, help="with --ray: CPUs reserved per replica")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="with --ray: GPUs reserved per replica")
    parser.add_argument("--batch-size", type=int, default=8, help="rows handed to a replica at a time")


def ray_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``map_with_llm`` that ``add_ray_arguments`` parsed."""
    return {"ray_address": args.ray, "replicas": args.replicas, "num_cpus": args.num_cpus,
            "num_gpus": args.num_gpus, "batch_size": args.batch_size}
