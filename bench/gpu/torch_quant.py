"""Quantizers of bench/gpu/torch_baseline.py, plain torch ops writing into existing storage, and
their checks against float64 references."""
import torch

from torch_models import BLOCK, F16_MAX, FP8_MAX, INT4_GROUP

# ---------------------------------------------------------------------------------------------
# Quantizers: plain torch ops writing into existing storage (views of the rollout's parameters).


def quant_fp8_rows(src, q_out, s_out):
    """fp8_per_channel. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [r]."""
    s = src.abs().amax(dim=1).float() / FP8_MAX
    s.masked_fill_(~(s > 0), 1.0)
    x = src / s[:, None]  # f32: both operands have dimensions, so bf16 / f32 promotes to f32
    x.clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)  # f32 -> e4m3fn, round to nearest even
    s_out.copy_(s)


def quant_fp8_tensor(src, q_out, s_out):
    """fp8_per_tensor, one shard. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [1]."""
    s = (src.abs().amax().float() / FP8_MAX).reshape(1, 1)  # 2-D, or bf16 / s would stay bf16
    s.masked_fill_(~(s > 0), 1.0)
    x = src / s
    x.clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(x)
    s_out.copy_(s.reshape(1))


def quant_int4_groups(src, q_out, s_out):
    """int4_group. src bf16 [r, c]; q_out uint8 [r, c/2] (column 2k in the low nibble);
    s_out f16 [r, c/128]."""
    r, c = src.shape
    g = c // INT4_GROUP
    v = src.view(r, g, INT4_GROUP)
    s = (v.abs().amax(dim=2).float() / 7.0).to(torch.float16)
    s.masked_fill_(s == 0, 1.0)
    s.clamp_(max=F16_MAX)  # an overflowed scale becomes the largest finite f16
    x = v / s.float()[..., None]  # f32
    x.round_().clamp_(-8, 7)  # round half to even
    codes = x.to(torch.int8).view(torch.uint8)  # two's complement bytes
    torch.bitwise_or(codes[..., 0::2] & 0x0F, codes[..., 1::2] << 4, out=q_out.view(r, g, INT4_GROUP // 2))
    s_out.copy_(s)


def block_grid(r, c):
    return -(-r // BLOCK), -(-c // BLOCK)


def quant_fp8_blocks(src, q_out, s_out):
    """fp8_block. src bf16 [r, c]; q_out e4m3fn [r, c]; s_out f32 [ceil(r/128), ceil(c/128)]."""
    r, c = src.shape
    br, bc = block_grid(r, c)
    x = src.float()
    if r % BLOCK or c % BLOCK:
        x = torch.nn.functional.pad(x, (0, bc * BLOCK - c, 0, br * BLOCK - r))
    v = x.view(br, BLOCK, bc, BLOCK)
    s = v.abs().amax(dim=(1, 3)) / FP8_MAX
    s.masked_fill_(~(s > 0), 1.0)
    y = (v / s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q_out.copy_(y.view(br * BLOCK, bc * BLOCK)[:r, :c])
    s_out.copy_(s)


def alloc_linear(scheme, shape, shard_rows, device):
    """The storage of one linear parameter: [rows, cols], or [experts, rows, cols] stacked."""
    lead, (rows, cols) = tuple(shape[:-2]), shape[-2:]
    if scheme == "fp8_per_channel":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(lead + (rows,), dtype=torch.float32, device=device))
    if scheme == "fp8_block":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(lead + block_grid(rows, cols), dtype=torch.float32, device=device))
    if lead:
        raise ValueError(f"{scheme}: stacked experts are measured under fp8_per_channel and fp8_block")
    if scheme == "fp8_per_tensor":
        return (torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(len(shard_rows), dtype=torch.float32, device=device))
    if scheme == "int4_group":
        if cols % INT4_GROUP:
            raise ValueError(f"int4_group needs cols % {INT4_GROUP} == 0, got {shape}")
        return (torch.zeros((rows, cols // 2), dtype=torch.uint8, device=device),
                torch.ones((rows, cols // INT4_GROUP), dtype=torch.float16, device=device))
    raise ValueError(f"unknown scheme {scheme}")


# ---------------------------------------------------------------------------------------------
# Float64 checks of the rollout's storage against the trainer's weights.


def pow2(k):
    """2.0**k in float64, exactly, for an integer tensor k (normal range)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def e4m3_ulp(x):
    """Spacing of e4m3fn values around float64 x (|x| <= 448): 2^(max(E, -6) - 3)."""
    _, e = torch.frexp(x.abs())
    return pow2((e.to(torch.int64) - 1).clamp(min=-6) - 3)


def e4m3_round(x):
    """Nearest e4m3fn value (ties to even) of float64 x, |x| <= 448, in float64."""
    u = e4m3_ulp(x)
    return (torch.round(x / u) * u).clamp(-FP8_MAX, FP8_MAX)


# Bounds. Codes are checked against w / s in float64, s being the rollout's own scale (itself
# checked against the exact amax / 448 or amax / 7). The rollout rounds w / s to f32 first, so a
# code may differ from the float64 rounding only where w / s lies within f32 rounding (2^-24
# relative) of a tie, and then it is one of the two nearest codes: |q - w/s| is at most half a
# code step, plus that sliver. Such near-ties are not rare: the f32 scale is amax / 448 rounded,
# so a bf16 w whose exact ratio to amax hits a tie lands next to it, and the f32 quotient can round
# back onto it (about 1 code in 1000 on the CPU; none seen on an H200). They are counted
# (code_mismatches), not failed. The scale may be one f32 ulp off the exact quotient (torch may
# divide by a scalar through its reciprocal).
SCALE_REL_FP8 = 2.0 ** -22
CODE_ERR_BOUND = 1.0 + 2.0 ** -18  # |q - w/s| in units of half a code step


def check_fp8(w, q, s, per_tensor):
    """w bf16 [r, c]; q e4m3fn [r, c]; s f32 [r] or [1]. Returns a dict of measures and ok."""
    w64 = w.double()
    amax = w64.abs().amax().reshape(1, 1) if per_tensor else w64.abs().amax(dim=1, keepdim=True)
    s64 = s.double().reshape(-1, 1)
    return fp8_measures(w64, q, amax, s64, s64)


def check_fp8_block(w, q, s):
    """w bf16 [r, c]; q e4m3fn [r, c]; s f32 [ceil(r/128), ceil(c/128)]."""
    r, c = w.shape
    br, bc = block_grid(r, c)
    w64 = w.double()
    padded = torch.nn.functional.pad(w64, (0, bc * BLOCK - c, 0, br * BLOCK - r))
    amax = padded.view(br, BLOCK, bc, BLOCK).abs().amax(dim=(1, 3))
    s64 = s.double()
    per_element = s64.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
    return fp8_measures(w64, q, amax, s64, per_element)


def fp8_measures(w64, q, amax, s64, s_elem):
    """Codes q of w64 under the scales s64 (one per amax entry), s_elem broadcast to w64's shape."""
    s_ref = amax / FP8_MAX
    s_ref = torch.where(s_ref > 0, s_ref, torch.ones_like(s_ref))
    scale_rel = ((s64 - s_ref).abs() / s_ref).max().item()
    x = (w64 / s_elem).clamp(-FP8_MAX, FP8_MAX)
    qd = q.to(torch.float64)
    err = ((qd - x).abs() / (e4m3_ulp(x) / 2)).max().item()
    mismatches = (qd != e4m3_round(x)).sum().item()
    n = w64.numel()
    ok = scale_rel <= SCALE_REL_FP8 and err <= CODE_ERR_BOUND
    return dict(ok=ok, scale_rel=scale_rel, code_err=err, mismatches=mismatches, elements=n)


def unpack_int4(p):
    """uint8 [r, c/2] -> int16 [r, c], low nibble = even column, sign-extended."""
    lo = (p & 0x0F).to(torch.int16)
    hi = (p >> 4).to(torch.int16)
    return torch.stack(((lo ^ 8) - 8, (hi ^ 8) - 8), dim=-1).reshape(p.shape[0], -1)


def check_int4(w, packed, s16):
    """w bf16 [r, c]; packed uint8 [r, c/2]; s16 f16 [r, c/128]."""
    r, c = w.shape
    g = c // INT4_GROUP
    w64 = w.double().view(r, g, INT4_GROUP)
    s_exact = w64.abs().amax(dim=2) / 7.0
    s64 = s16.double()
    zero = s_exact == 0
    # f16 rounding of the f32 quotient: half an f16 ulp (2^-11 relative, 2^-25 for subnormals),
    # plus the f32 step before it.
    bound = s_exact * (2.0 ** -11) * (1 + 2.0 ** -9) + 2.0 ** -25
    dev = (s64 - s_exact).abs()
    scale_ok = bool(((dev <= bound) | zero).all().item()) and bool((s64[zero] == 1).all().item())
    scale_rel = (dev / torch.where(zero, torch.ones_like(s_exact), s_exact)).masked_fill(zero, 0).max().item()
    x = (w64 / s64[..., None]).clamp(-8, 7)
    codes = unpack_int4(packed).view(r, g, INT4_GROUP).double()
    err = ((codes - x).abs() / 0.5).max().item()
    mismatches = (codes != torch.round(x)).sum().item()
    n = w.numel()
    ok = scale_ok and err <= CODE_ERR_BOUND
    return dict(ok=ok, scale_rel=scale_rel, code_err=err, mismatches=mismatches, elements=n)
