"""The rollout process of bench/gpu/torch_baseline.py: its fused (quantized) parameters, allocated
once, and the loop that writes the trainer's tensors into them and checks them when asked."""
import math
import traceback

import torch

from torch_models import BLOCK, Target, layout, scale_name, sync
from torch_quant import (alloc_linear, check_fp8, check_fp8_block, check_int4, quant_fp8_blocks, quant_fp8_rows,
                         quant_fp8_tensor, quant_int4_groups)

# ---------------------------------------------------------------------------------------------
# Rollout process.


class Rollout:
    def __init__(self, cfg, scheme, device):
        self.scheme, self.device = scheme, device
        self.targets, specs = layout(cfg)
        self.params = {}
        for name, (kind, shape, shard_rows) in specs.items():
            if kind == "copy":
                self.params[name] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
            else:
                self.params[name], self.params[scale_name(name)] = alloc_linear(scheme, shape, shard_rows, device)
        self.ptrs = {n: t.data_ptr() for n, t in self.params.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.params.values())

    def write(self, name, src, row0=0):
        """src: rows [row0, row0 + src.shape[0]) of the trainer tensor `name`."""
        t = self.targets[name]
        w = self.params[t.param]
        if t.kind == "copy":
            w[row0: row0 + src.shape[0]].copy_(src)
            return
        s = self.params[scale_name(t.param)]
        if t.kind == "stacked":  # experts [row0, row0 + n) of [E, R, C], as the rows of [E * R, C]
            w, s, src, row0 = w.view(-1, w.shape[-1]), s.view(-1, *s.shape[2:]), src.reshape(-1, src.shape[-1]), row0 * t.rows
            if self.scheme == "fp8_block" and t.rows % BLOCK:
                raise ValueError(f"{name}: fp8_block over stacked experts needs rows in whole tiles, got {t.rows}")
        r0 = t.row0 + row0
        r1 = r0 + src.shape[0]
        if t.expert >= 0:
            w, s = w[t.expert], s[t.expert]
        if self.scheme == "fp8_per_channel":
            quant_fp8_rows(src, w[r0:r1], s[r0:r1])
        elif self.scheme == "fp8_block":
            if r0 % BLOCK or (r1 % BLOCK and r1 != w.shape[0]):
                raise ValueError(f"{name}: rows {r0}..{r1} are not whole fp8_block tiles")
            quant_fp8_blocks(src, w[r0:r1], s[r0 // BLOCK: -(-r1 // BLOCK)])
        elif self.scheme == "fp8_per_tensor":
            if row0 != 0 or src.shape[0] != t.rows:
                raise ValueError(f"{name}: fp8_per_tensor needs the whole tensor at once")
            quant_fp8_tensor(src, w[r0:r1], s[t.shard: t.shard + 1])
        else:
            quant_int4_groups(src, w[r0:r1], s[r0:r1])

    def check(self, name, w):
        """Compares what the rollout holds for trainer tensor `name` with its current value w."""
        t = self.targets[name]
        p = self.params[t.param]
        if t.kind == "copy":
            ok = torch.equal(p, w)
            return dict(ok=ok, scale_rel=0.0, code_err=0.0, mismatches=0 if ok else -1, elements=w.numel())
        s = self.params[scale_name(t.param)]
        if t.expert >= 0:
            p, s = p[t.expert], s[t.expert]
        if t.kind == "stacked":
            p, s, w = p.view(-1, p.shape[-1]), s.view(-1, *s.shape[2:]), w.reshape(-1, w.shape[-1])
            t = Target("linear", t.param, rows=p.shape[0])
        q = p[t.row0: t.row0 + t.rows]
        if self.scheme == "fp8_block":
            return check_fp8_block(w, q, s[t.row0 // BLOCK: -(-(t.row0 + t.rows) // BLOCK)])
        if self.scheme == "fp8_per_channel":
            return check_fp8(w, q, s[t.row0: t.row0 + t.rows], per_tensor=False)
        if self.scheme == "fp8_per_tensor":
            return check_fp8(w, q, s[t.shard: t.shard + 1], per_tensor=True)
        return check_int4(w, q, s[t.row0: t.row0 + t.rows])

    def ptrs_unchanged(self):
        return all(t.data_ptr() == self.ptrs[n] for n, t in self.params.items())


def rollout_main(conn, cfg, scheme, device_str):
    try:
        device = torch.device(device_str)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ro = Rollout(cfg, scheme, device)
        sync(device)
        conn.send(("ready", ro.nbytes, len(ro.params)))
        buf = None
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "tensors":  # per-tensor IPC: [(name, rebuild, args)]
                held = []
                for name, rebuild, args in msg[1]:
                    held.append(rebuild(*args))
                    ro.write(name, held[-1])
                sync(device)
                held.clear()  # drops the opened handles once the GPU is done with them
                conn.send(("ack",))
            elif op == "buffer":  # packed buffer, shared once
                rebuild, args = msg[1]
                buf = rebuild(*args)
                conn.send(("ack",))
            elif op == "chunk":  # packed chunk: (k, [(name, shape, offset, row0)])
                k, pieces = msg[1], msg[2]
                for name, shape, off, row0 in pieces:
                    n = math.prod(shape) * 2
                    ro.write(name, buf[off: off + n].view(torch.bfloat16).view(shape), row0)
                sync(device)
                conn.send(("ack", k))
            elif op == "verify":  # [(name, rebuild, args)] of the trainer's current tensors
                report = {"ptrs_unchanged": ro.ptrs_unchanged(), "tensors": {}}
                for name, rebuild, args in msg[1]:
                    report["tensors"][name] = ro.check(name, rebuild(*args))
                sync(device)
                conn.send(("verified", report))
            elif op == "stop":
                break
            else:
                raise ValueError(f"unknown message {op}")
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise
