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

Tensors cross by DLPack (torch, numpy, ...), never copied. Errors are ferry.Error with .code.
"""

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
    RolloutWorker,
    SourceSlice,
    SourceTensor,
    StorageTensor,
    Tensor,
    view_as,
    Trainer,
    UpdateReport,
    __version__,
    describe_model,
    llama_manifest,
    llama_rank_spec,
    load_hf_config,
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


def manifest_from_state_dict(state_dict):
    """The manifest of a state dict: a SourceTensor (name, dtype, shape) per entry, in its order.

    Values are torch tensors (parameters too), numpy arrays or anything with .dtype and .shape
    (bf16 numpy arrays through ml_dtypes). Nothing is read or copied. A dtype ferry does not take
    raises ferry.Error naming the tensor; a value without dtype and shape raises TypeError.
    """
    out = []
    for name, tensor in state_dict.items():
        dtype, shape = getattr(tensor, "dtype", None), getattr(tensor, "shape", None)
        if dtype is None or shape is None:
            raise TypeError(f"{name}: a {type(tensor).__name__} has no dtype and shape")
        try:
            out.append(SourceTensor(name, dtype, [int(d) for d in shape]))
        except Error as e:
            err = Error(f"{e.code}: {name}: {e.message}")
            err.code, err.message = e.code, f"{name}: {e.message}"
            raise err from e
    return out


def wrap_module(spec, module, none_dtype="bf16"):
    """ModelStorage over a torch module's parameters and buffers, by their names, without copies.

    Every storage tensor of `spec` (see storage_tensors) must be a parameter or buffer of `module`
    under the same name; other parameters and buffers are left alone. f8 storage may be a float8
    or uint8 tensor; packed int4 storage a uint8 tensor of the same bytes.
    """
    tensors = dict(module.named_buffers())
    tensors.update((name, p.detach()) for name, p in module.named_parameters())
    return ModelStorage.wrap(spec, tensors, none_dtype=none_dtype, strict=False)
