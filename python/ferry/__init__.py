"""ferry: move fresh weights from an RL trainer into live rollout engines.

Trainer side::

    trainer = ferry.Trainer()                       # embeds the coordinator
    # rollout ranks join at trainer.coordinator_address
    manifest = ferry.manifest_from_state_dict(model.state_dict())
    trainer.start_weight_update(step, manifest)     # checks every replica, pauses them
    trainer.update_weights(model.state_dict())      # or trainer.send(name, tensor)
    report = trainer.finish_weight_update()         # every rank resumed at `step`

Rollout side::

    spec = ferry.llama_rank_spec(cfg, tp_rank, tp_size, "fp8_per_tensor")
    storage = ferry.wrap_module(spec, model)        # the engine's own tensors, zero copy
    worker = ferry.RolloutWorker(spec, storage, pause=engine.pause, resume=engine.resume,
                                 coordinator=address)

Every FERRY_* setting is also a keyword of Trainer and RolloutWorker, lower-cased without FERRY_
(``ferry.Trainer(timeout_ms=5000, bucket_bytes="64M", transport="tcp")``); a keyword beats the
environment, and ``trainer.settings`` / ``ferry.settings(**keywords)`` show each value and its source.

Sharded trainer (FSDP2, one process per rank of a torch.distributed job)::

    trainer = ferry.distributed_trainer()           # rank 0 embeds the coordinator
    sd = model.state_dict()                         # DTensor values
    manifest = ferry.manifest_from_state_dict(sd)   # global shapes; .holdings: this rank's boxes
    trainer.start_weight_update(step, manifest)     # collective over the trainer ranks
    trainer.update_weights(sd)                      # each DTensor's to_local(), never gathered
    trainer.finish_weight_update()

asyncio (every blocking call has an ``*_async`` twin that runs it on a thread and leaves the event
loop free)::

    await trainer.start_weight_update_async(step, manifest)
    await trainer.update_weights_async(model.state_dict())
    report = await trainer.finish_weight_update_async()
    await worker.serve_async()

ferry's log records go to Python's ``logging`` under the ``ferry`` logger (``ferry.forward_logs(False)``
sends them to stderr instead).

Tensors cross by DLPack (torch, numpy, ...), never copied. Errors are ferry.Error with .code.
"""

import asyncio as _asyncio
import concurrent.futures as _futures
import functools as _functools
import threading as _threading

from . import _ferry
from ._ferry import (  # noqa: F401
    Error,
    LlamaConfig,
    ModelConfig,
    ModelDesc,
    ModelStorage,
    ParamSpec,
    PauseRequest,
    RankSpec,
    Region,
    SourceLayout,
    SourceSlice,
    SourceTensor,
    StorageTensor,
    Tensor,
    view_as,
    UpdateReport,
    __version__,
    describe_model,
    flush_logs,
    forward_logs,
    llama_manifest,
    llama_rank_spec,
    load_checkpoint,
    load_hf_config,
    log_forwarding,
    megatron_layout,
    model_from_file,
    model_from_json,
    parse_hf_config,
    preset_model,
    preset_names,
    schemes,
    settings,
    storage_tensors,
    to_llama_config,
)


class _AsyncCalls:
    """The *_async methods: each runs its blocking call on this object's own threads (the call lets go
    of the GIL), so the event loop keeps running; ferry.Error and every other exception come out of the
    await. Cancelling the await does not stop the call: it runs to its end (FERRY_TIMEOUT_MS bounds
    every wait of an update). close() waits for calls still running, then closes."""

    _async_threads = 1
    _async_name = "ferry"

    def _async_executor(self):
        executor = self.__dict__.get("_executor")
        if executor is None:
            with _executor_lock:
                executor = self.__dict__.get("_executor")
                if executor is None:
                    executor = _futures.ThreadPoolExecutor(self._async_threads, self._async_name)
                    self.__dict__["_executor"] = executor
        return executor

    async def _call_async(self, method, *args, **kwargs):
        call = _functools.partial(method, self, *args, **kwargs)
        if self.__dict__.get("_closed"):
            return call()  # raises at once: closed
        return await _asyncio.get_running_loop().run_in_executor(self._async_executor(), call)

    def close(self):
        self.__dict__["_closed"] = True
        executor = self.__dict__.get("_executor")
        if executor is not None:
            executor.shutdown(wait=True)  # nothing may still be inside the object it closes
        super().close()

    def __exit__(self, *exc):
        self.close()


_executor_lock = _threading.Lock()


class Trainer(_AsyncCalls, _ferry.Trainer):
    __doc__ = _ferry.Trainer.__doc__
    # One thread: an update's calls run in the order they were made, and never wait for a free thread
    # of the loop's default executor.
    _async_name = "ferry-trainer"

    async def wait_for_ranks_async(self, n, timeout_ms=30000):
        """wait_for_ranks() without blocking the event loop."""
        return await self._call_async(_ferry.Trainer.wait_for_ranks, n, timeout_ms)

    async def start_weight_update_async(self, version, manifest, **options):
        """start_weight_update() without blocking the event loop (same arguments)."""
        return await self._call_async(_ferry.Trainer.start_weight_update, version, manifest, **options)

    async def send_async(self, name, tensor):
        """send() without blocking the event loop."""
        return await self._call_async(_ferry.Trainer.send, name, tensor)

    async def update_weights_async(self, weights):
        """update_weights() without blocking the event loop. A mapping is read, and a generator
        iterated, on the trainer's thread."""
        return await self._call_async(_ferry.Trainer.update_weights, weights)

    async def finish_weight_update_async(self):
        """finish_weight_update() without blocking the event loop: the UpdateReport."""
        return await self._call_async(_ferry.Trainer.finish_weight_update)

    async def abort_weight_update_async(self, reason="aborted by the trainer"):
        """abort_weight_update() without blocking the event loop."""
        return await self._call_async(_ferry.Trainer.abort_weight_update, reason)


class RolloutWorker(_AsyncCalls, _ferry.RolloutWorker):
    __doc__ = _ferry.RolloutWorker.__doc__
    # serve_async and a wait_serving_async may be awaited at once.
    _async_threads = 4
    _async_name = "ferry-worker"
    _SERVE_SLICE_MS = 200

    async def wait_serving_async(self, timeout_ms=30000):
        """wait_serving() without blocking the event loop."""
        return await self._call_async(_ferry.RolloutWorker.wait_serving, timeout_ms)

    async def wait_closed_async(self, timeout_ms):
        """wait_closed() without blocking the event loop."""
        return await self._call_async(_ferry.RolloutWorker.wait_closed, timeout_ms)

    async def resume_async(self):
        """resume() (runs the resume hook again) without blocking the event loop."""
        return await self._call_async(_ferry.RolloutWorker.resume)

    async def serve_async(self, timeout_ms=None):
        """serve() without blocking the event loop: returns when the coordinator ends the job, raises
        when it was lost (or DeadlineExceeded after timeout_ms). It waits in slices of 200 ms, so
        cancelling it, or close(), takes effect within one slice."""
        loop = _asyncio.get_running_loop()
        deadline = None if timeout_ms is None else loop.time() + timeout_ms / 1000
        while True:
            left_ms = None if deadline is None else max(0, int((deadline - loop.time()) * 1000))
            if left_ms is not None and left_ms <= self._SERVE_SLICE_MS:
                return await self.wait_closed_async(left_ms)  # the last slice says how it ended
            try:
                return await self.wait_closed_async(self._SERVE_SLICE_MS)
            except Error as e:
                if e.code != "DeadlineExceeded":
                    raise


class Manifest(list):
    """A manifest (a list of SourceTensor, global shapes) with `holdings`: the boxes this trainer
    rank holds when the state dict it came from has DTensor values (else None: every tensor whole).
    start_weight_update(version, manifest) uses them unless given holdings= itself."""

    holdings = None


def _is_dtensor(value):
    return hasattr(value, "to_local") and hasattr(value, "placements") and hasattr(value, "device_mesh")


def _named_error(name, e):
    err = Error(f"{e.code}: {name}: {e.message}")
    err.code, err.message = e.code, f"{name}: {e.message}"
    return err


def manifest_from_state_dict(state_dict):
    """The manifest of a state dict: a SourceTensor (name, dtype, shape) per entry, in its order.

    Values are torch tensors (parameters too), DTensors (their global shape), numpy arrays or
    anything with .dtype and .shape (bf16 numpy arrays through ml_dtypes). Nothing is read, copied
    or gathered. A dtype ferry does not take raises ferry.Error naming the tensor; a value without
    dtype and shape raises TypeError. When some values are DTensors, the result's .holdings are
    holdings_from_state_dict(state_dict).
    """
    out = Manifest()
    sharded = False
    for name, tensor in state_dict.items():
        dtype, shape = getattr(tensor, "dtype", None), getattr(tensor, "shape", None)
        if dtype is None or shape is None:
            raise TypeError(f"{name}: a {type(tensor).__name__} has no dtype and shape")
        sharded = sharded or _is_dtensor(tensor)
        try:
            out.append(SourceTensor(name, dtype, [int(d) for d in shape]))  # a DTensor's shape is global
        except Error as e:
            raise _named_error(name, e) from e
    if sharded:
        out.holdings = holdings_from_state_dict(state_dict)
    return out


def dtensor_box(tensor, name="tensor"):
    """(offset, size): the box of a DTensor's global tensor that this rank's to_local() holds.

    From its placements and device_mesh: Shard(d) on a mesh dimension of k ranks cuts dimension d
    as torch.chunk does (chunks of ceil(n / k), the last shorter, later ones empty); Shard on several
    mesh dimensions cuts in mesh-dimension order; Replicate() keeps the whole extent. Partial
    (unreduced) values, strided shards and ranks outside the mesh raise ValueError naming the tensor.
    A tensor that is not a DTensor is held whole.
    """
    shape = [int(d) for d in tensor.shape]
    offset, size = [0] * len(shape), list(shape)
    if not _is_dtensor(tensor):
        return offset, size
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{name}: this rank is not in the DTensor's device mesh, so it holds no part of it")
    mesh_shape = [int(k) for k in mesh.mesh.shape]
    for mesh_dim, placement in enumerate(tensor.placements):
        kind = type(placement).__name__
        if placement.is_replicate():
            continue
        if placement.is_partial():
            raise ValueError(f"{name}: placement {placement!r} on mesh dimension {mesh_dim} is a partial (unreduced) "
                             "value; reduce it (redistribute to Shard or Replicate) before sending")
        if not placement.is_shard() or kind != "Shard":
            raise ValueError(f"{name}: placement {placement!r} on mesh dimension {mesh_dim} is not Shard(d) or "
                             "Replicate(); ferry cannot say which box of the tensor this rank holds")
        d = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        k, c = mesh_shape[mesh_dim], int(coordinate[mesh_dim])
        chunk = -(-size[d] // k)  # torch.chunk: ceil(n / k) each, the last shorter, later ones empty
        start = min(c * chunk, size[d])
        end = min(start + chunk, size[d])
        offset[d] += start
        size[d] = end - start
    return offset, size


def holdings_from_state_dict(state_dict):
    """This trainer rank's holdings for start_weight_update(holdings=...): {name: (offset, size)}
    for each DTensor value (dtensor_box), {name: None} (held whole) for every other value."""
    out = {}
    for name, tensor in state_dict.items():
        out[name] = list(dtensor_box(tensor, name)) if _is_dtensor(tensor) else None
    return out


def distributed_trainer(group=None, **keywords):
    """The Trainer of this rank of a torch.distributed job (call it on every rank of `group`, the
    default group when None): trainer_rank is the rank in `group`, trainer_ranks its size. Rank 0
    embeds the coordinator and broadcasts its address (dist.broadcast_object_list); with
    coordinator='host:port' (a `ferry coordinator`), every rank joins that instead. Other keywords
    go to Trainer (port, pause_mode, settings such as timeout_ms)."""
    import torch.distributed as dist

    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    keywords.update(trainer_rank=rank, trainer_ranks=ranks)
    if keywords.get("coordinator"):
        return Trainer(**keywords)
    trainer, message = None, [None]
    if rank == 0:
        try:
            trainer = Trainer(**keywords)
            message = [("address", trainer.coordinator_address)]
        except Exception as e:  # the other ranks must not wait for an address that never comes
            message = [("error", f"{type(e).__name__}: {e}")]
            failure = e
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(message, src=src, group=group)
    kind, value = message[0]
    if rank == 0:
        if trainer is None:
            raise failure
        return trainer
    if kind == "error":
        raise RuntimeError(f"trainer rank 0 could not start the coordinator: {value}")
    keywords.pop("port", None)
    return Trainer(value, **keywords)


def _as_stored(tensor, shape):
    """`tensor` as the row-major [rows, cols] buffer ferry writes: vLLM and SGLang keep a quantized
    weight as a transposed view of that buffer (qweight.t()), which is transposed back, no copy."""
    shape = tuple(shape)
    if (len(shape) == 2 and getattr(tensor, "dim", lambda: 0)() == 2 and tuple(tensor.shape) == shape[::-1]
            and shape[1] != 1 and tensor.stride() == (1, shape[1])):
        return tensor.t()
    return tensor


def wrap_module(spec, module, none_dtype="bf16"):
    """ModelStorage over a torch module's parameters and buffers, by their names, without copies.

    Every storage tensor of `spec` (see storage_tensors) must be a parameter or buffer of `module`
    under the same name; other parameters and buffers are left alone. f8 storage may be a float8
    or uint8 tensor; packed int4 storage a uint8 tensor of the same bytes. A 2-D parameter that is
    the transposed view of the [rows, cols] storage (as vLLM and SGLang keep quantized weights) is
    taken through its transpose, which shares its memory.
    """
    tensors = dict(module.named_buffers())
    tensors.update((name, p.detach()) for name, p in module.named_parameters())
    for t in storage_tensors(spec, none_dtype=none_dtype):
        if t.name in tensors:
            tensors[t.name] = _as_stored(tensors[t.name], t.shape)
    return ModelStorage.wrap(spec, tensors, none_dtype=none_dtype, strict=False)
