#!/usr/bin/env python3
"""PyTorch baselines for `ferry bench transport --transport nccl`: what plain torch.distributed
(backend nccl) moves between two GPUs of one host, for the same bucket size.

Two processes (torch.multiprocessing.spawn), rank 0 on cuda:0 and rank 1 on the last visible GPU,
meet at tcp://127.0.0.1:<free port>. Each mode moves a uint8 tensor of --bytes from rank 0 to rank 1
--iters times after --warmup untimed iterations:
  sendrecv   rank 0 dist.send, rank 1 dist.recv
  broadcast  dist.broadcast from rank 0
Each iteration ends with torch.cuda.synchronize() on both ranks. Rank 0's clock runs from a
barrier before the first timed iteration until a one-element all_reduce after the last (which
rank 1 joins only once its last iteration is synchronized), so the time covers every byte landing
on rank 1. seconds = that time / iters; gbps = bytes / seconds / 1e9. After each mode rank 1
checks that it holds rank 0's bytes (the tensors are refilled before the next mode).

Output: rank 0 prints one JSON line per mode on stdout:
  {"bench":"transport","case":"torch_nccl_sendrecv","device":"cuda","bytes":N,"seconds":S,"gbps":G}
With fewer than 2 GPUs it says so on stderr, prints nothing and exits 0. NCCL's NVLink multicast
stays off (NCCL_NVLS_ENABLE=0) unless the environment sets it. --cpu runs the same protocol with
gloo on CPU tensors (device "cpu"), to check the script on a machine without GPUs.
"""
import argparse
import json
import os
import socket
import sys
import time

MODES = ("sendrecv", "broadcast")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(mode, rank, tensor, fence, iters, sync):
    import torch.distributed as dist

    def once():
        if mode == "sendrecv":
            if rank == 0:
                dist.send(tensor, dst=1)
            else:
                dist.recv(tensor, src=0)
        else:
            dist.broadcast(tensor, src=0)
        sync()

    def end():
        dist.all_reduce(fence)
        sync()

    once()  # warm-up: sets up the communicator for this kind of operation
    end()
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    end()
    return (time.perf_counter() - t0) / iters


def worker(rank, args, port, devices):
    import torch
    import torch.distributed as dist

    if args.cpu:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
        backend = "gloo"
        kwargs = {}
    else:
        device = torch.device("cuda", devices[rank])
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
        backend = "nccl"
        kwargs = {"device_id": device}
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, **kwargs)
    except TypeError:  # a torch without device_id
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tensor = torch.full((args.bytes,), rank + 1, dtype=torch.uint8, device=device)
        fence = torch.zeros(1, dtype=torch.float32, device=device)
        sync()
        modes = MODES if args.mode == "all" else (args.mode,)
        for mode in modes:
            seconds = run_mode(mode, rank, tensor, fence, args.iters, sync)
            if rank == 1 and not bool((tensor == 1).all()):
                raise RuntimeError(f"{mode}: rank 1 did not receive rank 0's bytes")
            if rank == 0:
                line = {"bench": "transport", "case": f"torch_nccl_{mode}", "device": device.type,
                        "bytes": args.bytes, "seconds": round(seconds, 9),
                        "gbps": round(args.bytes / seconds / 1e9 if seconds > 0 else 0.0, 3)}
                print(json.dumps(line, separators=(",", ":")), flush=True)
            tensor.fill_(rank + 1)  # the next mode must move the bytes again
            sync()
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=64 << 20, help="bytes per iteration (default 64 MiB)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per mode (default 50)")
    p.add_argument("--mode", choices=MODES + ("all",), default="all")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU tensors: checks the script without GPUs")
    args = p.parse_args()
    if args.bytes <= 0 or args.iters <= 0:
        p.error("--bytes and --iters must be positive")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off; children inherit it
    # One op at a time here, so the serialization of unbatched send/recv it warns about costs nothing.
    os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")

    import torch
    import torch.multiprocessing as mp

    devices = [0, 0]
    if not args.cpu:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < 2:
            print(f"torch_nccl_baseline: needs 2 GPUs (NCCL refuses two ranks on one GPU), this machine shows {n}; "
                  "nothing measured", file=sys.stderr)
            return 0
        devices = [0, n - 1]
        print(f"torch_nccl_baseline: rank 0 on cuda:{devices[0]}, rank 1 on cuda:{devices[1]}, "
              f"torch {torch.__version__}, nccl {torch.cuda.nccl.version()}", file=sys.stderr)
    mp.spawn(worker, args=(args, free_port(), devices), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
