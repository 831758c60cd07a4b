"""One rank of a rollout replica whose weights live in its own numpy arrays (see trainer.py)."""

import argparse

import numpy as np

import ferry
from trainer import CONFIG

# numpy has no bf16 or f8: the engine keeps their bits, and ferry.view_as says what they are.
NUMPY = {"bf16": np.uint16, "f8_e4m3fn": np.uint8, "f32": np.float32}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--scheme", default="fp8_per_tensor")
    args = ap.parse_args()

    spec = ferry.llama_rank_spec(ferry.LlamaConfig(**CONFIG), args.rank, args.tp, args.scheme)
    # The engine allocates its weights once; ferry writes every update into these very arrays.
    layout = ferry.storage_tensors(spec)
    weights = {t.name: np.zeros(t.shape, NUMPY[t.dtype]) for t in layout}
    storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(weights[t.name], t.dtype) for t in layout})

    def pause(request):  # runs on a ferry thread before any byte of version request.version lands
        print(f"rank {args.rank}: pause for v{request.version} ({request.mode})", flush=True)

    def resume(version):  # every rank of the replica holds `version`
        scale = weights["model.layers.0.self_attn.qkv_proj.weight_scale"]
        print(f"rank {args.rank}: serving v{version}, qkv scales {scale}", flush=True)

    with ferry.RolloutWorker(spec, storage, pause=pause, resume=resume, coordinator=args.coordinator) as worker:
        worker.serve()  # until the trainer ends the job
        print(f"rank {args.rank}: job over at v{worker.weight_version}")


if __name__ == "__main__":
    main()
