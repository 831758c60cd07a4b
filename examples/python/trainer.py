"""A trainer that pushes fresh weights into a rollout replica after every step (CPU, numpy).

    PYTHONPATH=build/python python3 examples/python/trainer.py --ranks 2 &
    # then, for each rank r of the replica:
    PYTHONPATH=build/python python3 examples/python/rollout.py --coordinator <address> --rank r --tp 2
"""

import argparse

import numpy as np

import ferry

CONFIG = dict(hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=512, vocab_size=1024, num_layers=4,
              dtype="f32")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2, help="rollout ranks to wait for")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    rng = np.random.default_rng(0)
    weights = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in manifest}

    with ferry.Trainer() as trainer:
        print(f"coordinator at {trainer.coordinator_address}", flush=True)
        trainer.wait_for_ranks(args.ranks, timeout_ms=600_000)
        for step in range(1, args.steps + 1):
            for w in weights.values():  # stands in for an optimizer step
                w += 0.01 * rng.standard_normal(w.shape).astype(np.float32)
            trainer.start_weight_update(step, manifest)  # checks every replica, pauses them
            trainer.update_weights(weights)  # zero copy: numpy arrays cross by DLPack
            r = trainer.finish_weight_update()  # every rank resumed at `step`
            print(f"update v{r.version}: ranks={r.ranks} bytes={r.bytes} seconds={r.seconds:.4f} "
                  f"gbps={r.gbps:.2f} moved={r.moved}/{r.registered}", flush=True)


if __name__ == "__main__":
    main()
