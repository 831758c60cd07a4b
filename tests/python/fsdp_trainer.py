"""One trainer rank of an FSDP2 job for tests/python/test_fsdp.py: a torch module whose parameter
names are a small Llama's checkpoint names, fully_shard() over the gloo process group, sending its
own Shard(0) rows of every parameter through ferry.distributed_trainer().

Run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Reports on stdout, one line per event:
address <host:port> (rank 0), box <name> <offset> <size>, done <version> <bytes>, closed.
Rank 0 waits for the replica's ranks after printing the address. Version v's checkpoint is
make_weights(manifest, v), the same numpy weights the test checks the replica against.
"""

import argparse
import json

import numpy as np

try:  # torch before ferry: torch's own NCCL must load before a (possibly older) one ferry links
    import torch
except ImportError:  # the test imports make_weights from here without torch
    torch = None

import ferry  # noqa: E402

CONFIG = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=201, num_layers=2,
              dtype="f32", vocab_pad_multiple=64)
TIMEOUT_S = 120


def make_weights(manifest, seed):
    rng = np.random.default_rng(seed)
    weights = {}
    for t in manifest:
        x = rng.standard_normal(t.shape).astype(np.float32)
        if "norm" in t.name:
            x = 1.0 + 0.1 * x
        weights[t.name] = x
    return weights


def emit(*words):
    print(*words, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--tp", type=int, required=True, help="ranks of the replica rank 0 waits for")
    args = ap.parse_args()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    # Sending must never gather a parameter.
    def no_gather(self, *a, **k):
        raise AssertionError("full_tensor() called on a sharded parameter")

    DTensor.full_tensor = no_gather

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))

    # A module tree named like the checkpoint: model.layers.0.self_attn.q_proj.weight, ...
    root = torch.nn.Module()
    weights = make_weights(manifest, 1)
    for t in manifest:
        *path, leaf = t.name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.from_numpy(weights[t.name].copy())))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(root, mesh=mesh)

    trainer = ferry.distributed_trainer(timeout_ms=TIMEOUT_S * 1000)
    assert (trainer.settings["timeout_ms"][1]) == "keyword"
    if rank == 0:
        emit("address", trainer.coordinator_address)
        trainer.wait_for_ranks(args.tp, timeout_ms=TIMEOUT_S * 1000)
    dist.barrier()

    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        compute_local_shape_and_global_offset = None

    for version in range(1, args.versions + 1):
        if version > 1:  # a "training step": each rank writes its own rows of the new weights
            weights = make_weights(manifest, version)
            with torch.no_grad():
                for name, p in root.named_parameters():
                    want = distribute_tensor(torch.from_numpy(weights[name]), mesh, [Shard(0)])
                    p.to_local().copy_(want.to_local())
        sd = root.state_dict()
        assert all(isinstance(v, DTensor) for v in sd.values())
        m = ferry.manifest_from_state_dict(sd)
        assert m == manifest, "global shapes"
        assert m.holdings == ferry.holdings_from_state_dict(sd)
        for name, t in sd.items():
            offset, size = ferry.dtensor_box(t, name)
            assert size == list(t.to_local().shape), (name, size, t.to_local().shape)
            if compute_local_shape_and_global_offset is not None:
                shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                assert (size, offset) == ([int(d) for d in shape], [int(d) for d in off]), name
            if version == 1:
                emit("box", name, json.dumps(offset, separators=(",", ":")), json.dumps(size, separators=(",", ":")))
        trainer.start_weight_update(version, m)
        trainer.update_weights(sd)
        report = trainer.finish_weight_update()
        emit("done", version, report.bytes)

    # Rank 0's embedded coordinator goes last, once the other ranks have left it.
    dist.barrier()
    if rank != 0:
        trainer.close()
    dist.barrier()
    trainer.close()
    dist.destroy_process_group()
    emit("closed")


if __name__ == "__main__":
    main()
