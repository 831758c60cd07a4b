"""A PyTorch trainer on a GPU that updates a rollout process after every optimizer step.

    PYTHONPATH=build/python python3 examples/python/gpu_trainer.py &
    PYTHONPATH=build/python python3 examples/python/gpu_rollout.py --coordinator <address>

Both processes on one node, the rollout's storage on the GPU: the rollout reads the trainer's tensors
in place (their allocations exported once by CUDA IPC) and quantizes them straight into its storage.
"""

import argparse

import torch

import ferry

CONFIG = dict(hidden_size=1024, num_heads=16, num_kv_heads=8, intermediate_size=4096, vocab_size=32000,
              num_layers=8, dtype="bf16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()

    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    # Stands in for the policy: parameters under their checkpoint names.
    params = {t.name: torch.nn.Parameter(0.02 * torch.randn(t.shape, device="cuda", dtype=torch.bfloat16))
              for t in manifest}
    opt = torch.optim.Adam(params.values(), lr=1e-3)  # moves every weight by about 1e-3 a step

    with ferry.Trainer() as trainer:
        print(f"coordinator at {trainer.coordinator_address}", flush=True)
        trainer.wait_for_ranks(args.ranks, timeout_ms=600_000)
        for step in range(1, args.steps + 1):
            loss = sum((p.float() ** 2).mean() for p in params.values())
            opt.zero_grad()
            loss.backward()
            opt.step()
            # ferry reads the tensors on its own streams: the step's kernels must have finished, and
            # the weights must not change until finish_weight_update() returns.
            torch.cuda.synchronize()
            trainer.start_weight_update(step, manifest)
            trainer.update_weights({name: p.detach() for name, p in params.items()})
            r = trainer.finish_weight_update()
            print(f"step {step}: loss={loss.item():.5f} update v{r.version} bytes={r.bytes} "
                  f"seconds={r.seconds:.4f} gbps={r.gbps:.2f} moved={r.moved}/{r.registered}", flush=True)


if __name__ == "__main__":
    main()
