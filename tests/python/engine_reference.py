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


def int4_marlin(x, scale_size_k=None):
    """int4_group for both engines' W4A16 kernels (compressed-tensors CompressedTensorsWNA16, then
    MarlinLinearKernel.process_weights_after_loading): weight_packed by gptq_marlin_repack
    (marlin_weights above), weight_scale [K/128, N] by marlin_permute_scales, in the model's dtype
    (bf16 here). The engines do not quantize int4 themselves, so the arithmetic is ferry's:
    scale = bf16(amax / 7) per 128 inputs of a row (1 when 0), code = round half even of x / scale
    clamped to [-8, 7] (NaN -> 0), stored as uint4b8 (code + 8). `scale_size_k`: the size_k the
    engine hands marlin_permute_scales, when it is not the weight's K (stacked experts' w13, below)."""
    n, k = x.shape
    groups = x.astype(F32).reshape(n, k // 128, 128)
    with np.errstate(invalid="ignore"):
        amax = np.where(np.isfinite(groups), np.abs(groups), F32(0.0)).max(axis=2).astype(F32)  # _amax per group
    bits = bf16_bits(amax / F32(7.0))
    bits = np.where(bits == 0, np.uint16(0x3F80), bits)
    scale = (bits.astype(np.uint32) << 16).view(F32)
    with np.errstate(invalid="ignore"):
        v = np.nan_to_num(groups / scale[:, :, None], nan=0.0, posinf=np.inf, neginf=-np.inf)
    codes = np.clip(np.rint(np.clip(v, -8, 7)), -8, 7).astype(np.int32).reshape(n, k)
    return {"weight_packed": marlin_weights((codes + 8).astype(np.uint32).T),
            "weight_scale": marlin_permute_scales(bits.T.copy(), k if scale_size_k is None else scale_size_k)}


def sglang_per_tensor_quant_fp8(x):
    """SGLang scaled_fp8_quant, dynamic (srt/layers/quantization/fp8_kernel.py -> sgl-kernel
    sgl_per_tensor_quant_fp8, csrc/gemm/per_tensor_quant_fp8.cu): per_tensor_absmax_kernel takes
    fmaxf of fabsf into a zeroed scale as max / 448; per_tensor_quant_fp8_kernel computes
    scale_val = 1.0f / scale, then fmax(fmin(x * scale_val, 448), -448) cast to e4m3 (satfinite,
    nearest even). Like vLLM's: a NaN takes +448, a zero matrix has scale 0 and every code +448."""
    scale = _amax(x) / FP8_MAX
    with np.errstate(divide="ignore", invalid="ignore"):
        v = _fminf_clamp(x.astype(F32) * (F32(1.0) / scale))
    return _codes(v, 0x7E), np.array([scale], dtype=F32)


# Stacked experts: x is one rank's [E, N, K] (w13: each expert's gate rows, then its up rows, as
# FusedMoE's weight_loader puts shard w1 before w3; w2: [E, H, I]).

def _experts(fn, x):
    """{suffix: array} of fn over each expert of x, stacked on a leading expert dimension."""
    parts = [fn(m) for m in x]
    return {suffix: np.stack([p[suffix] for p in parts]) for suffix in parts[0]}


def vllm_fp8_per_tensor_moe(x):
    """vLLM Fp8PerTensorOnlineMoEMethod.process_weights_after_loading (quantization/online/fp8.py):
    w13_scale = torch.ones(num_experts), then ops.scaled_fp8_quant of each expert's whole matrix
    (w13: gate and up together, one scale): weight [E, N, K], weight_scale f32[E]."""
    codes, scales = zip(*(vllm_scaled_fp8_quant(m) for m in x))
    return {"weight": np.stack(codes), "weight_scale": np.concatenate(scales)}


def sglang_fp8_per_tensor_moe(x):
    """SGLang Fp8MoEMethod.process_weights_after_loading (srt/layers/quantization/fp8.py), an
    unquantized checkpoint ("quantize in place"): w13_weight_scale re-created as
    torch.ones(num_local_experts) "because we directly quantize merged w13 weights and generate a
    single scaling factor", then scaled_fp8_quant of each expert's matrix: weight [E, N, K],
    weight_scale f32[E]."""
    codes, scales = zip(*(sglang_per_tensor_quant_fp8(m) for m in x))
    return {"weight": np.stack(codes), "weight_scale": np.concatenate(scales)}


def per_block_cast_moe(x):
    """vLLM Fp8PerBlockOnlineMoEMethod.process_weights_after_loading (quantization/online/fp8.py):
    per_block_cast_to_fp8 of each expert's matrix (w13 merged), weight_scale_inv
    f32[E, ceil(N/128), ceil(K/128)]. SGLang Fp8MoEMethod.create_weights (block quant) registers
    w13_weight_scale_inv [E, 2 * ceil(I/128), ceil(H/128)], the same shape when the rank's I is a
    multiple of 128 (vLLM's maybe_roundup_sizes pads I to one)."""
    return _experts(per_block_cast_to_fp8, x)


def sglang_int8_moe(x):
    """SGLang W8A8Int8MoEMethod.create_weights (srt/layers/quantization/w8a8_int8.py): w13_weight
    int8 [E, 2I, H] and w13_weight_scale f32 [E, 2I, 1] (w2: [E, H, I], [E, H, 1]), loaded as the
    checkpoint holds them; the arithmetic is int8_per_channel's (ferry's) per expert."""
    return _experts(lambda m: int8_per_channel(m, (m.shape[0], 1)), x)


def marlin_moe(x, w13):
    """int4_group stacked experts for both engines' Marlin MoE: vLLM
    CompressedTensorsWNA16MarlinMoEMethod.process_weights_after_loading (compressed_tensors_moe.py),
    SGLang's CompressedTensorsWNA16MoE (compressed_tensors_wNa16_moe.py), each expert in turn:
    gptq_marlin_moe_repack of w*_weight_packed [E, K/8, N] (size_k = K, size_n = N), and
    marlin_moe_permute_scales of w*_weight_scale [E, K/128, N] with size_k as the engines pass it:
    w13_weight_packed.shape[2] for w13, read after replace_parameter swapped in the repacked
    [E, K/16, 2N], so 2N (twice w13's 2I of the rank); w2_weight_scale.shape[1] * 128 (w2's K) for
    w2. The scale permutation depends on size_k only through 128 < size_k."""
    return _experts(lambda m: int4_marlin(m, scale_size_k=2 * m.shape[0] if w13 else None), x)


def stacked_engine_storage(layout, scheme, x, w13):
    """{suffix: array} of a stacked-experts parameter x [E, N, K] under (layout, scheme)."""
    if scheme == "fp8_per_tensor":
        return vllm_fp8_per_tensor_moe(x) if layout == "vllm" else sglang_fp8_per_tensor_moe(x)
    if scheme == "fp8_block":
        return per_block_cast_moe(x)
    if scheme == "int8_per_channel" and layout == "sglang":
        return sglang_int8_moe(x)
    if scheme == "int4_group":
        return marlin_moe(x, w13)
    raise ValueError(f"no stacked-experts reference for {layout} {scheme}")


def gptq_unpack(qweight):
    """Codes [K, N] of a GPTQ qweight i32[K/8, N] as GPTQ packs it (the inverse of gptq_pack in
    vLLM's quantization/utils/quant_utils.py): input row k = 8i + j in bits 4j..4j+3 of word (i, n)."""
    w = np.ascontiguousarray(qweight).view(np.uint32)
    return np.stack([(w >> np.uint32(4 * j)) & np.uint32(0xF) for j in range(8)], axis=1).reshape(-1, w.shape[1])


def gptq_marlin(qweight, scales, g_idx, size_k):
    """gptq_int4: a symmetric act-order GPTQ checkpoint (qweight i32[K/8, N], scales f16[G, N],
    g_idx i32[K]) as vLLM's GPTQMarlinLinearMethod (gptq_marlin.py) keeps it after
    MarlinLinearKernel.process_weights_after_loading (kernels/mixed_precision/marlin.py); SGLang's
    GPTQMarlinLinearMethod (srt/layers/quantization/gptq.py) does the same:
      - marlin_sort_g_idx (marlin_utils.py): g_idx_sort_indices = argsort(g_idx) (torch.argsort;
        stable here), g_idx = g_idx[g_idx_sort_indices];
      - qweight = gptq_marlin_repack(qweight, perm=g_idx_sort_indices, size_k, size_n, 4), whose
        reference is marlin_weights of the codes sorted by those indices (sort_weights, then
        marlin_weights, in marlin_utils_test.py; test_gptq_marlin_repack checks they agree);
      - scales, created in params_dtype (bf16 here: the checkpoint's f16 copied in, nearest even),
        permuted by marlin_permute_scales(s, size_k = the rank's K, size_n, group_size=128);
      - qzeros: Marlin's symmetric path replaces them by an empty tensor.
    G is the unsharded K / 128 on every rank: with act order, marlin_repeat_scales_on_all_ranks makes
    create_weights keep every group on every rank, a row-parallel layer's too."""
    idx = np.argsort(g_idx, kind="stable").astype(np.int32)
    codes = gptq_unpack(qweight)[idx]
    return {"qweight": marlin_weights(codes),
            "scales": marlin_permute_scales(bf16_bits(scales.astype(F32)), size_k),
            "g_idx": np.asarray(g_idx, dtype=np.int32)[idx], "g_idx_sort_indices": idx}


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
