#!/usr/bin/env python3
"""PyTorch baselines for a colocated weight update: a trainer process and a rollout process share
one GPU, and every update moves the trainer's bf16 weights into the rollout's existing quantized
parameters with plain PyTorch, the way RL stacks do it today without ferry.

Workload (--model): a Llama-3-8B-shaped model (HF parameter names, untied embeddings), or a
Qwen3-30B-A3B-shaped mixture of experts (qwen3-30b-a3b: 48 layers, 128 experts of 768 rows, q/k
norms; 18,867 tensors), with random bf16 weights in the trainer. The rollout holds vLLM-style fused
parameters (qkv_proj, gate_up_proj; the experts stacked per layer as w13 [E, 2I, H] and
w2 [E, H, I]) allocated once; linear weights are quantized under --scheme, norms, routers and
embeddings stay bf16. fp8_block: one f32 scale per 128 x 128 tile, amax / 448 (1 for a zero
tile), as ferry's fp8_block. --experts stacked: the trainer holds each layer's experts stacked too,
as transformers' fused experts do (mlp.experts.gate_up_proj [E, 2I, H], gate rows first, and
mlp.experts.down_proj [E, H, I]: 531 tensors); each is quantized in one go.

Baselines (--baseline):
  per_tensor  each update the trainer makes one CUDA IPC handle per tensor
              (torch.multiprocessing.reductions.reduce_tensor) and sends all of them over a Pipe;
              the rollout rebuilds each tensor, quantizes it with torch ops and copy_s it into its
              parameters, synchronizes and acks.
  packed      like vLLM's packed IPC weight transfer: one packed buffer (--buffer-mib, default
              1024) is allocated and shared once; it is split into --buffers slots (default 2:
              double buffering, two 512 MiB halves). Per update the trainer packs consecutive
              tensors into a free slot, synchronizes, sends the chunk's (name, shape, offset)
              list; the rollout unpacks views, quantizes, copy_s, synchronizes and acks the slot.
              A tensor larger than a slot is split at row boundaries (per-row schemes and bf16
              copies only).

Timing: the trainer changes its weights (add_, untimed), synchronizes, then measures wall time
until the rollout's ack that every parameter is written (the rollout synchronizes before it acks).
Median over --updates after --warmup updates. Floor: a device-to-device copy's bandwidth
(2 * bytes / time) and floor_seconds = floor_bytes / bandwidth, floor_bytes = 3 bytes per
parameter (fp8 schemes); under int4_group 2.5 bytes per linear-weight parameter and 3 per other.

After the timed updates the rollout checks one layer (--verify-layer) against a float64
reference computed from the trainer's current weights, the bf16 tensors bit for bit, and that no
rollout parameter's data_ptr() changed since allocation.

Output: one JSON line per (baseline, scheme) on stdout; progress on stderr. --selftest checks the
quantizers, the float64 checks and the packing plan on the CPU (no GPU needed); --device cpu
--tiny runs the whole two-process protocol on the CPU with small shapes.
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from torch_models import DEFAULT_SCHEMES, MODELS, SCHEMES, layout, log, make_weights, sync
from torch_rollout import rollout_main

BASELINES = ("per_tensor", "packed")
CASE_PREFIX = {"per_tensor": "torch_per_tensor_ipc", "packed": "torch_packed_ipc"}
ALIGN = 256  # byte alignment of tensors inside the packed buffer
REPLY_TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------------------------
# Trainer side.


def expect(conn, what):
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no '{what}' from the rollout within {REPLY_TIMEOUT_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("rollout failed:\n" + msg[1])
    if msg[0] != what:
        raise RuntimeError(f"expected '{what}' from the rollout, got '{msg[0]}'")
    return msg


def align_up(n, a=ALIGN):
    return (n + a - 1) // a * a


def plan_chunks(shapes, splittable, slot_bytes, nslots):
    """Packs (name, shape) in order into chunks of at most slot_bytes; chunk k goes to slot
    k % nslots. Returns [[(name, piece shape, absolute offset, row0, rows)]]."""
    chunks, cur, used = [], [], 0

    def close():
        nonlocal cur, used
        if cur:
            chunks.append(cur)
        cur, used = [], 0

    def add(name, shape, row0, rows, nbytes):
        nonlocal used
        if align_up(used) + nbytes > slot_bytes:
            close()
        off = align_up(used)
        cur.append((name, (rows,) + tuple(shape[1:]), off, row0, rows))
        used = off + nbytes

    for name, shape in shapes:
        row_bytes = math.prod(shape[1:]) * 2
        rows = shape[0]
        if rows * row_bytes <= slot_bytes:
            add(name, shape, 0, rows, rows * row_bytes)
            continue
        if not splittable(name):
            raise ValueError(f"{name} ({rows * row_bytes} bytes) does not fit in a packed slot of {slot_bytes} bytes "
                             "and its scheme needs the whole tensor at once; raise --buffer-mib or use --buffers 1")
        per = slot_bytes // row_bytes
        if per == 0:
            raise ValueError(f"a row of {name} does not fit in a packed slot of {slot_bytes} bytes")
        r = 0
        while r < rows:
            n = min(per, rows - r)
            add(name, shape, r, n, n * row_bytes)
            r += n
    close()
    return [[(name, shape, (k % nslots) * slot_bytes + off, row0, rows) for name, shape, off, row0, rows in chunk]
            for k, chunk in enumerate(chunks)]


def update_per_tensor(conn, weights):
    handles = []
    for name, w in weights:
        rebuild, args = reduce_tensor(w)
        handles.append((name, rebuild, args))
    conn.send(("tensors", handles))
    expect(conn, "ack")


def update_packed(conn, wmap, plan, buf, nslots, device):
    in_flight = 0
    for k, chunk in enumerate(plan):
        if in_flight == nslots:  # the slot chunk k reuses is free once chunk k - nslots is acked
            expect(conn, "ack")
            in_flight -= 1
        for name, shape, off, row0, rows in chunk:
            n = math.prod(shape) * 2
            buf[off: off + n].view(torch.bfloat16).view(shape).copy_(wmap[name][row0: row0 + rows])
        sync(device)
        conn.send(("chunk", k, [(name, shape, off, row0) for name, shape, off, row0, _ in chunk]))
        in_flight += 1
    while in_flight:
        expect(conn, "ack")
        in_flight -= 1


def measure_copy(device, nbytes, reps=10):
    """Device-to-device copy bandwidth, bytes read + written per second (median of reps)."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def run_case(args, cfg, device, weights, buf, baseline, scheme, copy_bw):
    targets, _ = layout(cfg)
    on = ("" if args.model == "llama3-8b" else "-" + args.model) + ("-stacked" if cfg.get("stacked") else "")
    case = f"{CASE_PREFIX[baseline]}{on}/{scheme}"
    params = sum(w.numel() for _, w in weights)
    linear_params = sum(w.numel() for n, w in weights if targets[n].kind != "copy")
    if scheme == "int4_group":
        floor_bytes = 2.5 * linear_params + 3.0 * (params - linear_params)
    else:
        floor_bytes = 3.0 * params
    floor_s = floor_bytes / copy_bw

    plan = None
    if baseline == "packed":
        slot_bytes = (buf.numel() // args.buffers) // ALIGN * ALIGN

        def splittable(name):
            # Stacked experts split between whole experts (whole matrices, whole tiles).
            return targets[name].kind in ("copy", "stacked") or scheme not in ("fp8_per_tensor", "fp8_block")

        plan = plan_chunks([(n, tuple(w.shape)) for n, w in weights], splittable, slot_bytes, args.buffers)

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=rollout_main, args=(child, cfg, scheme, str(device)), daemon=True)
    proc.start()
    child.close()
    try:
        _, rollout_bytes, rollout_tensors = expect(conn, "ready")
        log(f"{case}: rollout holds {rollout_tensors} tensors, {rollout_bytes / 2**30:.2f} GiB")
        if baseline == "packed":
            conn.send(("buffer", reduce_tensor(buf)))
            expect(conn, "ack")
            log(f"{case}: packed buffer {buf.numel() / 2**20:.0f} MiB in {args.buffers} slot(s), "
                f"{len(plan)} chunks per update")
        wmap = dict(weights)
        times = []
        for u in range(args.warmup + args.updates):
            delta = 1e-3 if u % 2 == 0 else -1e-3
            for _, w in weights:
                w.add_(delta)
            sync(device)
            t0 = time.perf_counter()
            if baseline == "per_tensor":
                update_per_tensor(conn, weights)
            else:
                update_packed(conn, wmap, plan, buf, args.buffers, device)
            dt = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.ipc_collect()  # lets the trainer release what the rollout has closed
            if u >= args.warmup:
                times.append(dt)
            log(f"{case}: update {u}{' (warm-up)' if u < args.warmup else ''} {dt * 1e3:.2f} ms")

        layer = args.verify_layer if args.verify_layer >= 0 else cfg["layers"] + args.verify_layer
        prefix = f"model.layers.{layer}."
        names = [n for n, _ in weights if n.startswith(prefix)]
        names += ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        conn.send(("verify", [(n, *reduce_tensor(wmap[n])) for n in names]))
        _, report = expect(conn, "verified")
        conn.send(("stop",))
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    bad = [n for n, r in report["tensors"].items() if not r["ok"]]
    verified = not bad and report["ptrs_unchanged"]
    for n in bad:
        log(f"{case}: VERIFY FAILED {n}: {report['tensors'][n]}")
    if not report["ptrs_unchanged"]:
        log(f"{case}: VERIFY FAILED: a rollout parameter's data_ptr changed")
    lin = [r for n, r in report["tensors"].items() if targets[n].kind != "copy"]
    log(f"{case}: verified layer {layer} ({len(report['tensors'])} tensors): "
        f"{'ok' if verified else 'FAILED'}; max |q - w/s| {max(r['code_err'] for r in lin):.6f} half-steps, "
        f"max scale rel err {max(r['scale_rel'] for r in lin):.3g}, "
        f"code mismatches {sum(r['mismatches'] for r in lin)} of {sum(r['elements'] for r in lin)}")

    med = statistics.median(times)
    line = {
        "bench": "colocated",
        "case": case,
        "device": device.type,
        "params": params,
        "bytes": 2 * params,
        "seconds": round(med, 9),
        "updates": len(times),
        "floor_seconds": round(floor_s, 9),
        "ratio_to_floor": round(med / floor_s, 3),
        "min_seconds": round(min(times), 9),
        "max_seconds": round(max(times), 9),
        "warmup": args.warmup,
        "model": args.model,
        "experts": "stacked" if cfg.get("stacked") else "per-expert",
        "layers": cfg["layers"],
        "tensors": len(weights),
        "rollout_bytes": rollout_bytes,
        "floor_bytes": int(floor_bytes),
        "copy_gbps": round(copy_bw / 1e9, 3),
        "verified": verified,
        "verified_layer": layer,
        "code_mismatches": sum(r["mismatches"] for r in lin),
    }
    if baseline == "packed":
        line.update(buffer_bytes=buf.numel(), buffers=args.buffers, chunks=len(plan))
    return line, verified


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b", choices=tuple(MODELS))
    ap.add_argument("--experts", default="per-expert", choices=("per-expert", "stacked"),
                    help="MoE models: a tensor per expert, or each layer's experts stacked (gate_up_proj, down_proj)")
    ap.add_argument("--scheme", default="all", choices=SCHEMES + ("all",))
    ap.add_argument("--baseline", default="all", choices=BASELINES + ("all",))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; fewer for quick runs)")
    ap.add_argument("--updates", type=int, default=10, help="timed updates (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--buffer-mib", type=int, default=1024, help="packed IPC buffer, MiB")
    ap.add_argument("--buffers", type=int, default=2, choices=(1, 2),
                    help="slots of the packed buffer: 2 = double buffering with two halves")
    ap.add_argument("--copy-mib", type=int, default=2048, help="size of the copy that measures the floor")
    ap.add_argument("--verify-layer", type=int, default=-1, help="layer checked against float64 (default: last)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small shapes (hidden 256) for a quick check of the protocol")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selftest", action="store_true", help="CPU checks of quantizers, float64 checks and packing")
    args = ap.parse_args()

    if args.selftest:
        from torch_baseline_selftest import selftest
        return selftest()
    if args.updates < 1 or args.warmup < 0:
        ap.error("--updates must be >= 1 and --warmup >= 0")

    cfg = dict(MODELS[args.model][1 if args.tiny else 0], stacked=args.experts == "stacked")
    if args.layers is not None:
        cfg["layers"] = args.layers
    if not (-cfg["layers"] <= args.verify_layer < cfg["layers"]):
        ap.error(f"--verify-layer outside the model's {cfg['layers']} layers")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log("no CUDA device")
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    schemes = DEFAULT_SCHEMES[args.model] if args.scheme == "all" else (args.scheme,)
    baselines = BASELINES if args.baseline == "all" else (args.baseline,)

    log(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"model {cfg}")
    weights = make_weights(cfg, device, args.seed)
    sync(device)
    params = sum(w.numel() for _, w in weights)
    log(f"trainer: {len(weights)} tensors, {params} params, {2 * params / 2**30:.2f} GiB bf16")
    copy_bw = measure_copy(device, args.copy_mib * 2**20)
    log(f"device copy ({args.copy_mib} MiB): {copy_bw / 1e9:.1f} GB/s read + write")
    buf = None
    if "packed" in baselines:
        buf = torch.empty(args.buffer_mib * 2**20, dtype=torch.uint8, device=device)

    all_ok = True
    for scheme in schemes:
        for baseline in baselines:
            line, ok = run_case(args, cfg, device, weights, buf, baseline, scheme, copy_bw)
            all_ok &= ok
            print(json.dumps(line, separators=(",", ":")), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
