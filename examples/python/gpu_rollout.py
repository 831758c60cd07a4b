"""A rollout process whose weights are torch tensors on the GPU that ferry updates in place: their
data_ptr() never changes, so kernels and captured CUDA graphs keep reading live weights."""

import argparse

import torch

import ferry
from gpu_trainer import CONFIG

TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "f8_e4m3fn": torch.float8_e4m3fn}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--scheme", default="fp8_per_tensor")
    args = ap.parse_args()

    spec = ferry.llama_rank_spec(ferry.LlamaConfig(**CONFIG), 0, 1, args.scheme)
    # The engine's own tensors, allocated once (a real engine takes them from its modules:
    # ferry.wrap_module(spec, model)). f8 tensors are handed over as their bytes.
    weights = {t.name: torch.zeros(t.shape, dtype=TORCH[t.dtype], device="cuda")
               for t in ferry.storage_tensors(spec, none_dtype="bf16")}
    storage = ferry.ModelStorage.wrap(
        spec, {n: (w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w) for n, w in weights.items()})
    addresses = {n: w.data_ptr() for n, w in weights.items()}

    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    rows = torch.tensor(next(p.shard_rows for p in spec.params if p.name == qkv), device="cuda")
    x = torch.randn(4, CONFIG["hidden_size"], device="cuda")

    def decode_step():  # stands in for the engine's kernels: they read the registered tensors
        w = weights[qkv].float() * weights[qkv + "_scale"].repeat_interleave(rows)[:, None]
        return (x @ w.T).norm().item()

    def resume(version):
        assert all(w.data_ptr() == addresses[n] for n, w in weights.items())
        print(f"serving v{version}: decode output norm {decode_step():.4f}", flush=True)

    with ferry.RolloutWorker(spec, storage, pause=lambda r: torch.cuda.synchronize(), resume=resume,
                             coordinator=args.coordinator) as worker:
        worker.serve()
        print(f"job over at v{worker.weight_version}")


if __name__ == "__main__":
    main()
