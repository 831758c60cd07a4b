"""Independent numpy references of the engines' quantized layouts, written from vLLM's and SGLang's
own source (docs/engines.md cites each function) and not from ferry's code. Every function takes
the full-precision parameter of one rank as float32 [rows, cols] and returns {suffix: array}, the
arrays as the engine's parameters hold them (fp8 as uint8 codes)."""

import numpy as np

from reference import bf16_bits, e4m3fn_encode

F32 = np.float32
FP8_MAX = F32(448.0)


def _amax(x):
    """Largest |x| over the finite values (ferry leaves NaN and inf out of amax in every layout)."""
    a = np.abs(x[np.isfinite(x)])
    return F32(a.max()) if a.size else F32(0.0)


def _codes(v, nan_code):
    """e4m3fn codes of f32 `v`, nearest even with saturation (__NV_SATFINITE, torch's .to() below
    448); NaN gets `nan_code`."""
    with np.errstate(invalid="ignore"):
        codes = e4m3fn_encode(np.nan_to_num(v.astype(np.float64), nan=0.0))
    return np.where(np.isnan(v), np.uint8(nan_code), codes).astype(np.uint8)


def _fminf_clamp(v):
    """fmaxf(-448, fminf(v, 448)) as CUDA computes it: a NaN operand yields the other one."""
    return np.fmax(-FP8_MAX, np.fmin(v, FP8_MAX))


def vllm_scaled_fp8_quant(x):
    """vLLM ops.scaled_fp8_quant, dynamic per tensor (csrc/quantization/w8a8/fp8/common.cu*:
    segmented max / 448, then scaled_fp8_conversion<true> with 1 / scale): one f32 scale for the
    whole (fused) tensor, no guard for a zero scale (1 / 0 = inf, 0 * inf = NaN, clamped to 448)."""
    scale = _amax(x) / FP8_MAX
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = F32(1.0) / scale
        v = _fminf_clamp(x.astype(F32) * inv)
    return _codes(v, 0x7E), np.array([scale], dtype=F32)


def vllm_fp8_per_tensor(x):
    """vLLM online fp8_per_tensor (Fp8PerTensorOnlineLinearMethod): weight, weight_scale f32[1]."""
    codes, scale = vllm_scaled_fp8_quant(x)
    return {"weight": codes, "weight_scale": scale}


def vllm_fp8_per_channel(x):
    """vLLM online fp8_per_channel (Fp8PtpcOnlineLinearMethod: _fp8_channel_scale,
    _fp8_quant_per_channel): scale = max(amax / 448, 1 / (448 * 512)) per row, codes of the true
    quotient x / scale clamped by torch (NaN kept); weight_scale f32[rows, 1]."""
    floor = F32(1.0) / (FP8_MAX * F32(512.0))
    scales = np.array([max(_amax(row) / FP8_MAX, floor) for row in x], dtype=F32)
    v = np.clip(x.astype(F32) / scales[:, None], -FP8_MAX, FP8_MAX)
    return {"weight": _codes(v, 0x7F), "weight_scale": scales.reshape(-1, 1)}


def per_block_cast_to_fp8(x, block=128):
    """per_block_cast_to_fp8 (vllm/utils/deep_gemm.py, from DeepGEMM): amax of each 128x128 block
    (edge blocks hold fewer elements) clamped to >= 1e-4, scale = amax / 448, codes of
    x * (1 / scale); weight_scale_inv f32[ceil(rows/128), ceil(cols/128)]."""
    rows, cols = x.shape
    br, bc = -(-rows // block), -(-cols // block)
    codes = np.empty(x.shape, dtype=np.uint8)
    scales = np.empty((br, bc), dtype=F32)
    for i in range(br):
        for j in range(bc):
            tile = x[i * block:(i + 1) * block, j * block:(j + 1) * block].astype(F32)
            s = max(_amax(tile), F32(1e-4)) / FP8_MAX
            scales[i, j] = s
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = _codes(tile * (F32(1.0) / s), 0x7F)
    return {"weight": codes, "weight_scale_inv": scales}


def sglang_fp8_per_channel(x):
    """SGLang's online fp8 on sm_89+ (Fp8LinearMethod -> per_token_group_quant_fp8 over whole rows ->
    per_token_quant_fp8): scale = row amax / 448, multiplier 0 for a zero scale else 1 / scale,
    codes of fmaxf(-448, fminf(x * m, 448)); weight_scale f32[1, rows] (the [rows, 1] output
    transposed and made contiguous)."""
    scales = np.array([_amax(row) / FP8_MAX for row in x], dtype=F32)
    with np.errstate(divide="ignore"):
        inv = np.where(scales == 0, F32(0.0), F32(1.0) / scales).astype(F32)
    v = _fminf_clamp(x.astype(F32) * inv[:, None])
    return {"weight": _codes(v, 0x7E), "weight_scale": scales.reshape(1, -1)}


def int8_per_channel(x, shape):
    """int8 per channel in the engines' W8A8 layout (vLLM CompressedTensorsW8A8Int8 / SGLang
    W8A8Int8LinearMethod: weight int8 [rows, cols], weight_scale f32 `shape`), with ferry's
    arithmetic, since both engines load int8 weights as they are: scale = amax / 127 (1 when 0),
    q = round half even of x / scale, clamped to [-127, 127]."""
    scales = np.array([_amax(row) / F32(127.0) for row in x], dtype=F32)
    scales = np.where(scales > 0, scales, F32(1.0)).astype(F32)
    q = np.clip(np.rint(x.astype(F32) / scales[:, None]), -127, 127).astype(np.int8)
    return {"weight": q, "weight_scale": scales.reshape(shape)}


def marlin_weight_perm():
    """get_weight_perm(num_bits=4) of vLLM's marlin_utils_test.py, built as vLLM builds it."""
    perm = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in perm1)
    return np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()


def marlin_weights(q_w):
    """marlin_weights (marlin_utils_test.py) of unsigned codes q_w [K, N]: 16x16 tiles
    (marlin_permute_weights), the 1024-element permutation, eight codes per int32, the first lowest.
    The same bytes as the gptq_marlin_repack kernel gives."""
    k, n = q_w.shape
    q = q_w.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, n * 16)
    q = q.reshape(-1, 1024)[:, marlin_weight_perm()].reshape(k // 16, n * 16).astype(np.uint32)
    packed = np.zeros((k // 16, n * 2), dtype=np.uint32)
    for i in range(8):
        packed |= q[:, i::8] << np.uint32(4 * i)
    return packed.view(np.int32)


def marlin_permute_scales(s, size_k, group_size=128):
    """marlin_permute_scales (marlin_utils.py) of s [groups, N]."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    perm = scale_perm if group_size < size_k else scale_perm_single
    return s.reshape(-1, len(perm))[:, perm].reshape(s.shape)


def int4_marlin(x):
    """int4_group for both engines' W4A16 kernels (compressed-tensors CompressedTensorsWNA16, then
    MarlinLinearKernel.process_weights_after_loading): weight_packed by gptq_marlin_repack
    (marlin_weights above), weight_scale [K/128, N] by marlin_permute_scales, in the model's dtype
    (bf16 here). The engines do not quantize int4 themselves, so the arithmetic is ferry's:
    scale = bf16(amax / 7) per 128 inputs of a row (1 when 0), code = round half even of x / scale
    clamped to [-8, 7] (NaN -> 0), stored as uint4b8 (code + 8)."""
    n, k = x.shape
    groups = x.astype(F32).reshape(n, k // 128, 128)
    amax = np.array([[_amax(g) for g in row] for row in groups], dtype=F32)
    bits = bf16_bits(amax / F32(7.0))
    bits = np.where(bits == 0, np.uint16(0x3F80), bits)
    scale = (bits.astype(np.uint32) << 16).view(F32)
    with np.errstate(invalid="ignore"):
        v = np.nan_to_num(groups / scale[:, :, None], nan=0.0, posinf=np.inf, neginf=-np.inf)
    codes = np.clip(np.rint(np.clip(v, -8, 7)), -8, 7).astype(np.int32).reshape(n, k)
    return {"weight_packed": marlin_weights((codes + 8).astype(np.uint32).T),
            "weight_scale": marlin_permute_scales(bits.T.copy(), k)}


def engine_storage(layout, scheme, x):
    """{suffix: array} of a quantized parameter under (layout, scheme)."""
    rows = x.shape[0]
    if scheme == "fp8_per_tensor" and layout == "vllm":
        return vllm_fp8_per_tensor(x)
    if scheme == "fp8_per_channel":
        return vllm_fp8_per_channel(x) if layout == "vllm" else sglang_fp8_per_channel(x)
    if scheme == "fp8_block":
        return per_block_cast_to_fp8(x)
    if scheme == "int8_per_channel":
        return int8_per_channel(x, (rows, 1))
    if scheme == "int4_group":
        return int4_marlin(x)
    raise ValueError(f"no reference for {layout} {scheme}")
