"""
Fused attention kernels for nanoformer, written in Triton.

flash_attention(q, k, v) computes softmax(scale * q kᵀ + bias) v exactly, in O(T) memory: the
FlashAttention-2 scheme (Dao 2023). The forward walks over blocks of keys keeping a running row
maximum and row sum (an "online softmax"), so the Tq x Tk score matrix never exists; it saves only
the log-sum-exp of each query row. The backward recomputes the scores block by block from that
log-sum-exp: one kernel per block of keys accumulates dK and dV, one per block of queries dQ.

Masks (causal, sliding window, key padding) and ALiBi are applied inside the kernels, and blocks
that no query of a tile can see are never visited, which is where most of the speed of causal and
windowed attention comes from. Grouped-query attention reads each key/value head from every query
head of its group; K and V are never repeated in memory.

    python bench.py attention            # benchmark against torch's attention (needs a CUDA GPU)
    python -m pytest tests/test_kernels.py     # tests

Without CUDA, Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) runs
the same kernels on CPU tensors, slowly: that is how the tests run in CI (conftest.py sets it).
"""

import contextlib
import math
import os

import torch

try:
    import triton
    import triton.language as tl
    available = True  # model code may check kernels.available before choosing this kernel
except ImportError:  # e.g. a CPU-only torch: the module still imports, flash_attention says what is missing
    available = False

MAX_HEAD_SIZE = 128  # a (block, head size) tile of Q, K, V and the output must fit in registers/SRAM

# Triton reads TRITON_INTERPRET when a kernel is defined, so this must agree with what it sees then.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def flash_attention(q, k, v, *, causal=False, scale=None, alibi_slopes=None, window=0, key_padding_mask=None):
    """Exact attention softmax(scale * q kᵀ + bias) v, differentiable in q, k and v.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D) with Hq a multiple of Hkv: query head h reads key/value
    head h // (Hq // Hkv). fp16, bf16 or fp32 in, the same dtype out: (B, Hq, Tq, D), laid out in
    memory as (B, Tq, Hq, D) so that out.transpose(1, 2).reshape(B, Tq, Hq * D) is free.
    The queries are the last Tq of the Tk positions (query i sits at position Tk - Tq + i: new
    tokens after a KV cache). With dist = query position - key position, a key is visible when
      causal: dist >= 0;  window > 0: also dist < window (causal) or |dist| < window (not causal);
      key_padding_mask (B, Tk) bool: True for real keys, False keys are never visible.
    alibi_slopes (Hq,) adds -slope[h] * |dist| to the scores; scale defaults to 1/sqrt(D).
    A query that sees no key gets zeros (and zero gradients), never NaN. The slopes get no gradient.
    """
    if not available:
        raise RuntimeError("kernels.flash_attention needs Triton: pip install triton "
                           "(CUDA builds of torch bring it with them)")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0::3] != q.shape[0::3] or q.size(1) % k.size(1):
        raise ValueError(f"expected q (B, Hq, Tq, D) and k, v (B, Hkv, Tk, D) with Hq % Hkv == 0, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, Tq, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if D > MAX_HEAD_SIZE:
        raise ValueError(f"head size {D} is not supported (at most {MAX_HEAD_SIZE}): use torch's attention")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError("flash_attention runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1)")
    if alibi_slopes is not None:
        if alibi_slopes.shape != (Hq,):
            raise ValueError(f"alibi_slopes must have shape ({Hq},), got {tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
    if key_padding_mask is not None:
        if key_padding_mask.shape != (B, k.size(2)):
            raise ValueError(f"key_padding_mask must have shape ({B}, {k.size(2)}), "
                             f"got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.dtype != torch.bool:  # an additive 0/-inf mask would turn into its opposite
            raise ValueError(f"key_padding_mask must be bool (True for a real key), got {key_padding_mask.dtype}")
        key_padding_mask = key_padding_mask.to(q.device)
    if window < 0:
        raise ValueError(f"window={window} must be 0 (no window) or a positive span")
    scale = D ** -0.5 if scale is None else float(scale)
    if not scale > 0:  # the kernel takes the row maximum before scaling
        raise ValueError(f"scale={scale} must be positive")
    out, _ = torch.ops.nanoformer.flash_attention(q, k, v, alibi_slopes, key_padding_mask,
                                                  scale, bool(causal), int(window))
    return out


# ----------------------------------------------------------------------------------------------
# Kernels. Scores live in base 2: s = (scale * q·k + bias) * log2(e), so exp becomes the cheaper
# exp2 and the saved log-sum-exp is in base 2 too. The keys a query sees form one band around
# the diagonal: the query at position p sees keys p - back .. p + ahead (causal: ahead = 0; a
# window sets back, and ahead when not causal; without a window both reach past any length).

if available:

    @triton.jit
    def _tile(length, BLOCK: tl.constexpr):
        """This program's tile: the start of its block of BLOCK along `length`, and its row of
        batch * heads. One grid axis holds both, tiles of one head side by side (they share its
        keys and values in cache): a second axis would allow only 65,535 rows of batch * heads."""
        blocks = tl.cdiv(length, BLOCK)
        return tl.program_id(0) % blocks * BLOCK, tl.program_id(0) // blocks

    @triton.jit
    def _band(first, last, below, above, length, BLOCK: tl.constexpr):
        """Which blocks of the other side a tile must visit. The tile's rows sit at positions
        first..last (in the other side's index units); a row at x sees x - below .. x + above,
        clipped to 0 .. length - 1. Returns block-aligned starts lo <= full_lo <= full_hi <= hi:
        [full_lo, full_hi) is seen by every row of the tile (no masking needed), [lo, full_lo) and
        [full_hi, hi) by some rows (masked), and nothing outside [lo, hi) is seen by any row.
        Everything is clamped to >= 0 before dividing: integer division truncates towards zero."""
        lo = tl.maximum(first - below, 0) // BLOCK * BLOCK
        hi = tl.maximum(tl.minimum(last + above + 1, length), lo)
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - below, 0), BLOCK) * BLOCK, hi)
        full_hi = tl.maximum(tl.maximum(tl.minimum(first + above + 1, length), 0) // BLOCK * BLOCK, full_lo)
        return lo, full_lo, full_hi, hi

    @triton.jit
    def _keys_seen(offs_m, Tq, Tk, back, ahead):
        """For each query of a block: its position, and the first and last key it may see
        (padding aside). A row past Tq, in the tail of the last block, sees none (last < first)."""
        pos = Tk - Tq + offs_m
        key_lo = pos - back
        key_hi = tl.where(offs_m < Tq, tl.minimum(pos + ahead, Tk - 1), -1)
        return pos, key_lo, key_hi

    @triton.jit
    def _bias_and_mask(s, pos, k_idx, key_lo, key_hi, keep, slope,
                       HAS_ALIBI: tl.constexpr, HAS_PAD: tl.constexpr, MASKED: tl.constexpr):
        """ALiBi and masking of a tile of base-2 scores s. The query positions pos, the key
        indices k_idx, the per-query key range and the padding mask keep come shaped to broadcast
        against s (the dK/dV kernel's tile is transposed: keys x queries). Masked scores: -inf."""
        if HAS_ALIBI:
            s -= slope * tl.abs(pos - k_idx).to(tl.float32)
        if HAS_PAD:
            s = tl.where(keep, s, float("-inf"))
        if MASKED:
            s = tl.where((k_idx >= key_lo) & (k_idx <= key_hi), s, float("-inf"))
        return s

    # -------------------------------------------------------------------------- forward

    @triton.jit
    def _fwd_block(acc, m_i, l_i, q, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                   stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_PAD: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """One key block of the online softmax: rescale what was accumulated so far to the new row
        maximum, then add this block's exp2(s - max) to the row sums and exp2(s - max) v to acc."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk if MASKED else offs_n >= 0  # a full block lies inside 0 .. Tk - 1
        kT = tl.load(K + offs_n[None, :] * stride_kt + offs_d[:, None],  # (D, BLOCK_N)
                     mask=n_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :],  # (BLOCK_N, D)
                    mask=n_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        qk = tl.dot(q, kT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED or HAS_ALIBI or HAS_PAD:
            keep = 0
            if HAS_PAD:
                keep = tl.load(KeyPad + offs_n * stride_pt, mask=n_ok, other=0)[None, :] != 0
            s = _bias_and_mask(qk * qk_scale, pos[:, None], offs_n[None, :], key_lo[:, None], key_hi[:, None],
                               keep, slope, HAS_ALIBI, HAS_PAD, MASKED)
            # finite, as m_i starts at -1e30: a row with only -inf scores so far gets p = 0
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:  # the bulk of the work: scaling after the max leaves one multiply-add per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _fwd_kernel(Q, K, V, Out, Lse,
                    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                    Slopes, KeyPad, stride_pb, stride_pt, Hq, Hkv, Tq, Tk, back, ahead, qk_scale, scale,
                    TQ_BUCKET, TK_BUCKET, BAND,  # only the autotuning key: lengths rounded up to powers
                    # of two, and the band's kind (0 full, 1 causal, 2 window, 3 causal window)
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program per (block of BLOCK_M queries, batch * query head)."""
        start_m, bh = _tile(Tq, BLOCK_M)
        b, h = bh // Hq, bh % Hq
        kvh = h // (Hq // Hkv)  # the key/value head this query head reads
        Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        K += b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        KeyPad += b.to(tl.int64) * stride_pb

        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)  # the head size padded to a power of two: pads load as 0
        q_mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, D)
        pos, key_lo, key_hi = _keys_seen(offs_m, Tq, Tk, back, ahead)  # (BLOCK_M,) each
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + h) * 1.4426950408889634  # log2(e): the bias goes to base 2 too

        # A large finite start for the row maximum keeps exp2(m_old - m_new) finite while a row
        # has seen only masked (-inf) scores; its sum then stays 0 and marks the row empty.
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # running row maximum of the scores
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(s - m_i) v
        first, last = Tk - Tq + start_m, Tk - Tq + tl.minimum(start_m + BLOCK_M, Tq) - 1  # positions
        lo, full_lo, full_hi, hi = _band(first, last, back, ahead, Tk, BLOCK_N)
        for start_n in range(lo, full_lo, BLOCK_N):
            acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                                       stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                                       HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, True, PRECISION)
        for start_n in range(full_lo, full_hi, BLOCK_N):
            acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                                       stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                                       HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, False, PRECISION)
        for start_n in range(full_hi, hi, BLOCK_N):
            acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                                       stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                                       HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, True, PRECISION)

        # A row that saw no key has l = 0 and acc = 0: it outputs 0, and its log-sum-exp is +inf
        # so that the backward's exp2(s - lse) is 0 for it whatever s is.
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
        Out += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        tl.store(Out + offs_m[:, None] * stride_ot + offs_d[None, :], out.to(Out.dtype.element_ty), mask=q_mask)
        tl.store(Lse + bh.to(tl.int64) * Tq + offs_m, lse, mask=offs_m < Tq)

    # -------------------------------------------------------------------------- backward

    @triton.jit
    def _bwd_delta_kernel(Out, DO, Delta, stride_ob, stride_oh, stride_ot, stride_db, stride_dh, stride_dt,
                          Hq, Tq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta = rowsum(dO * O) (fp32), the term every row's dS = P (dP - delta) subtracts."""
        start_m, bh = _tile(Tq, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        b, h = bh // Hq, bh % Hq
        mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < HEAD_DIM)
        Out += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        DO += b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        o = tl.load(Out + offs_m[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dt + offs_d[None, :], mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(Delta + bh.to(tl.int64) * Tq + offs_m, delta, mask=offs_m < Tq)

    @triton.jit
    def _dkdv_block(dk, dv, k, v, Q, DO, Lse, Delta, keep, start_m, offs_n, offs_d,
                    stride_qt, stride_dt, Tq, Tk, back, ahead, qk_scale, slope,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_PAD: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """One query block's contribution to a key block's dK and dV. Works on the transposed
        tile (keys x queries) so that both products come out without transposing the result."""
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Tq if MASKED else offs_m >= 0  # a full block lies inside 0 .. Tq - 1
        qT = tl.load(Q + offs_m[None, :] * stride_qt + offs_d[:, None],  # (D, BLOCK_M)
                     mask=m_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dt + offs_d[None, :],  # (BLOCK_M, D)
                     mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        lse = tl.load(Lse + offs_m, mask=m_ok, other=float("inf"))  # rows past Tq: p = 0
        delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
        sT = tl.dot(k, qT, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        pos, key_lo, key_hi = _keys_seen(offs_m, Tq, Tk, back, ahead)
        sT = _bias_and_mask(sT, pos[None, :], offs_n[:, None], key_lo[None, :], key_hi[None, :], keep, slope,
                            HAS_ALIBI, HAS_PAD, MASKED)
        pT = tl.exp2(sT - lse[None, :])  # the forward's probabilities, recomputed
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, DK, DV,
                         stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                         stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
                         stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                         Slopes, KeyPad, stride_pb, stride_pt, Hq, Hkv, Tq, Tk, back, ahead, qk_scale, scale,
                         TQ_BUCKET, TK_BUCKET, BAND,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ALIBI: tl.constexpr,
                         HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program per (block of BLOCK_N keys, batch * key/value head). It loops over the query
        heads of its group, so dK and dV sum over the group in registers: no atomics, no copies."""
        start_n, bh = _tile(Tk, BLOCK_N)
        b, kvh = bh // Hkv, bh % Hkv
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = (offs_n[:, None] < Tk) & (offs_d[None, :] < HEAD_DIM)
        K += b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        k = tl.load(K + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D)
        v = tl.load(V + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D)
        keep = 0
        if HAS_PAD:
            KeyPad += b.to(tl.int64) * stride_pb
            keep = tl.load(KeyPad + offs_n * stride_pt, mask=offs_n < Tk, other=0)[:, None] != 0

        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        # the queries that see key j sit at positions j - ahead .. j + back: in query indices,
        # (j - (Tk - Tq)) - ahead .. (j - (Tk - Tq)) + back
        first, last = start_n - (Tk - Tq), tl.minimum(start_n + BLOCK_N, Tk) - 1 - (Tk - Tq)
        lo, full_lo, full_hi, hi = _band(first, last, ahead, back, Tq, BLOCK_M)
        group = Hq // Hkv
        for g in range(group):
            h = kvh * group + g  # the query heads of this key/value head's group
            Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
            DOh = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
            Lseh = Lse + (b * Hq + h).to(tl.int64) * Tq
            Deltah = Delta + (b * Hq + h).to(tl.int64) * Tq
            slope = 0.0
            if HAS_ALIBI:
                slope = tl.load(Slopes + h) * 1.4426950408889634
            for start_m in range(lo, full_lo, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, Lseh, Deltah, keep, start_m, offs_n, offs_d,
                                     stride_qt, stride_dt, Tq, Tk, back, ahead, qk_scale, slope,
                                     HEAD_DIM, BLOCK_M, HAS_ALIBI, HAS_PAD, True, PRECISION)
            for start_m in range(full_lo, full_hi, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, Lseh, Deltah, keep, start_m, offs_n, offs_d,
                                     stride_qt, stride_dt, Tq, Tk, back, ahead, qk_scale, slope,
                                     HEAD_DIM, BLOCK_M, HAS_ALIBI, HAS_PAD, False, PRECISION)
            for start_m in range(full_hi, hi, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, Lseh, Deltah, keep, start_m, offs_n, offs_d,
                                     stride_qt, stride_dt, Tq, Tk, back, ahead, qk_scale, slope,
                                     HEAD_DIM, BLOCK_M, HAS_ALIBI, HAS_PAD, True, PRECISION)

        dk *= scale  # s = scale * q·k: the chain rule's factor, applied once
        DK += b.to(tl.int64) * stride_dkb + kvh.to(tl.int64) * stride_dkh
        DV += b.to(tl.int64) * stride_dvb + kvh.to(tl.int64) * stride_dvh
        tl.store(DK + offs_n[:, None] * stride_dkt + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _dq_block(dq, q, do, lse, delta, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                  stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ALIBI: tl.constexpr,
                  HAS_PAD: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
        """One key block's contribution to a query block's dQ."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk if MASKED else offs_n >= 0
        kv_mask = n_ok[None, :] & (offs_d[:, None] < HEAD_DIM)  # (D, BLOCK_N)
        kT = tl.load(K + offs_n[None, :] * stride_kt + offs_d[:, None], mask=kv_mask, other=0.0)
        vT = tl.load(V + offs_n[None, :] * stride_vt + offs_d[:, None], mask=kv_mask, other=0.0)
        keep = 0
        if HAS_PAD:
            keep = tl.load(KeyPad + offs_n * stride_pt, mask=n_ok, other=0)[None, :] != 0
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        s = _bias_and_mask(s, pos[:, None], offs_n[None, :], key_lo[:, None], key_hi[:, None], keep, slope,
                           HAS_ALIBI, HAS_PAD, MASKED)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        return dq

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, Lse, Delta, DQ,
                       stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                       stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
                       stride_dqb, stride_dqh, stride_dqt,
                       Slopes, KeyPad, stride_pb, stride_pt, Hq, Hkv, Tq, Tk, back, ahead, qk_scale, scale,
                       TQ_BUCKET, TK_BUCKET, BAND,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ALIBI: tl.constexpr,
                       HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program per (block of BLOCK_M queries, batch * query head), like the forward."""
        start_m, bh = _tile(Tq, BLOCK_M)
        b, h = bh // Hq, bh % Hq
        kvh = h // (Hq // Hkv)
        Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DO += b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        K += b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        KeyPad += b.to(tl.int64) * stride_pb

        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, D)
        do = tl.load(DO + offs_m[:, None] * stride_dt + offs_d[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, D)
        lse = tl.load(Lse + bh.to(tl.int64) * Tq + offs_m, mask=offs_m < Tq, other=float("inf"))
        delta = tl.load(Delta + bh.to(tl.int64) * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        pos, key_lo, key_hi = _keys_seen(offs_m, Tq, Tk, back, ahead)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + h) * 1.4426950408889634

        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first, last = Tk - Tq + start_m, Tk - Tq + tl.minimum(start_m + BLOCK_M, Tq) - 1
        lo, full_lo, full_hi, hi = _band(first, last, back, ahead, Tk, BLOCK_N)
        for start_n in range(lo, full_lo, BLOCK_N):
            dq = _dq_block(dq, q, do, lse, delta, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                           stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                           HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, True, PRECISION)
        for start_n in range(full_lo, full_hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse, delta, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                           stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                           HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, False, PRECISION)
        for start_n in range(full_hi, hi, BLOCK_N):
            dq = _dq_block(dq, q, do, lse, delta, K, V, KeyPad, start_n, pos, key_lo, key_hi, offs_d,
                           stride_kt, stride_vt, stride_pt, Tk, qk_scale, slope,
                           HEAD_DIM, BLOCK_N, HAS_ALIBI, HAS_PAD, True, PRECISION)

        dq *= scale
        DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
        tl.store(DQ + offs_m[:, None] * stride_dqt + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_mask)

    # -------------------------------------------------------------------------- autotuning
    # (BLOCK_M, BLOCK_N, num_warps, num_stages) to try on a GPU; the autotuner keeps the fastest
    # per shape and skips configs that need more shared memory than the GPU has. fp16 and bf16
    # products run on tensor cores and want large tiles; fp32 ones (in full precision) run on the
    # CUDA cores and spill registers unless the tiles are small. The interpreter runs a single
    # config (it cannot time several without a GPU), with blocks small enough that the tests'
    # lengths span several, and query and key blocks of different sizes.
    _TUNING_KEY = ["TQ_BUCKET", "TK_BUCKET", "BAND", "HEAD_DIM", "HAS_ALIBI", "HAS_PAD"]  # and the dtypes

    def _tuned(kernel, half, fp32, interpreter):
        """The kernel autotuned for each input dtype: {dtype: kernel to launch}."""
        def tune(configs):
            configs = [interpreter] if INTERPRET else configs
            return triton.autotune([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                                    for m, n, w, s in configs], key=_TUNING_KEY)(kernel)
        half_tuned = tune(half)
        return {torch.float16: half_tuned, torch.bfloat16: half_tuned, torch.float32: tune(fp32)}

    _fwd = _tuned(_fwd_kernel,
                  half=[(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
                  fp32=[(32, 32, 4, 2), (64, 32, 8, 2), (32, 16, 8, 2)],
                  interpreter=(64, 32, 1, 1))
    # dK/dV: a block of keys stays in place while small blocks of queries stream past it
    _bwd_dkdv = _tuned(_bwd_dkdv_kernel,
                       half=[(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (16, 64, 8, 3), (32, 64, 4, 3),
                             (16, 64, 4, 3), (32, 128, 4, 3)],
                       fp32=[(16, 64, 8, 2), (16, 32, 4, 2), (16, 32, 8, 2)],
                       interpreter=(32, 64, 1, 1))
    # dQ: a block of queries stays, blocks of keys stream past
    _bwd_dq = _tuned(_bwd_dq_kernel,
                     half=[(128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3),
                           (64, 64, 4, 3)],
                     fp32=[(32, 16, 4, 2), (64, 32, 8, 2), (32, 16, 8, 2), (64, 16, 8, 2)],
                     interpreter=(64, 32, 1, 1))


# ----------------------------------------------------------------------------------------------
# Launching, as custom ops so that torch.compile keeps them in its graph instead of breaking it.

def _unit_stride(x):
    """The kernels step along the head dimension with stride 1; any other stride costs a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _new_like_heads(x, dtype=None):
    """An empty (B, H, T, D) tensor laid out as (B, T, H, D): heads side by side, the layout the
    model's projections produce and consume, so transposing back to (B, T, H * D) is a view."""
    B, H, T, D = x.shape
    return x.new_empty(B, T, H, D, dtype=dtype).transpose(1, 2)


def _strides(*tensors):
    """The batch, head and time strides of each (B, H, T, D) tensor, one after the other."""
    return [stride for x in tensors for stride in x.stride()[:3]]


def _shared_args(q, k, alibi_slopes, key_padding_mask, scale, causal, window):
    """The arguments all three main kernels end with, and their constexpr flags. An absent
    tensor is replaced by q, a pointer the kernel never reads since its flag is off."""
    _, Hq, Tq, D = q.shape
    Hkv, Tk = k.size(1), k.size(2)
    unlimited = Tq + Tk  # farther than any key is from any query
    back = window - 1 if window > 0 else unlimited  # the query at p sees keys p - back .. p + ahead
    ahead = 0 if causal else back
    pad = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else None
    args = (alibi_slopes if alibi_slopes is not None else q,
            pad if pad is not None else q, *(pad.stride() if pad is not None else (0, 0)),
            Hq, Hkv, Tq, Tk, back, ahead, scale * math.log2(math.e), scale,
            triton.next_power_of_2(Tq), triton.next_power_of_2(Tk), int(causal) + 2 * (window > 0))
    flags = dict(HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),  # tl.dot needs >= 16
                 HAS_ALIBI=alibi_slopes is not None, HAS_PAD=pad is not None,
                 # fp32 products in full precision, not TF32, so that fp32 results are tight;
                 # None is Triton's default (TF32 only ever applies to fp32 inputs)
                 PRECISION="ieee" if q.dtype == torch.float32 else None)
    return args, flags


def _cuda_device(x):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


@torch.library.custom_op("nanoformer::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None,
                        key_padding_mask: torch.Tensor | None, scale: float, causal: bool,
                        window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: returns the output and the base-2 log-sum-exp of each query row (B, Hq, Tq), fp32."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    B, Hq, Tq, _ = q.shape
    out = _new_like_heads(q)
    lse = q.new_empty(B, Hq, Tq, dtype=torch.float32)
    args, flags = _shared_args(q, k, alibi_slopes, key_padding_mask, scale, causal, window)
    grid = lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]) * B * Hq,)
    with _cuda_device(q):
        _fwd[q.dtype][grid](q, k, v, out, lse, *_strides(q, k, v, out), *args, **flags)
    return out, lse


@_flash_attention_op.register_fake
def _(q, k, v, alibi_slopes, key_padding_mask, scale, causal, window):
    return _new_like_heads(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("nanoformer::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, alibi_slopes: torch.Tensor | None,
                                 key_padding_mask: torch.Tensor | None, scale: float, causal: bool,
                                 window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: dq, dk, dv from the upstream gradient do and the forward's out and lse."""
    do, q, k, v, out = (_unit_stride(x) for x in (do, q, k, v, out))
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.size(1), k.size(2)
    dq, dk, dv = _new_like_heads(q), _new_like_heads(k), _new_like_heads(v)
    delta = torch.empty_like(lse)  # (B, Hq, Tq) fp32
    args, flags = _shared_args(q, k, alibi_slopes, key_padding_mask, scale, causal, window)
    with _cuda_device(q):
        _bwd_delta_kernel[(triton.cdiv(Tq, 64) * B * Hq,)](out, do, delta, *_strides(out, do), Hq, Tq, HEAD_DIM=D,
                                                              BLOCK_D=flags["BLOCK_D"], BLOCK_M=64)
        grid = lambda meta: (triton.cdiv(Tk, meta["BLOCK_N"]) * B * Hkv,)
        _bwd_dkdv[q.dtype][grid](q, k, v, do, lse, delta, dk, dv, *_strides(q, k, v, do, dk, dv), *args, **flags)
        grid = lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]) * B * Hq,)
        _bwd_dq[q.dtype][grid](q, k, v, do, lse, delta, dq, *_strides(q, k, v, do, dq), *args, **flags)
    return dq, dk, dv


@_flash_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, alibi_slopes, key_padding_mask, scale, causal, window):
    return _new_like_heads(q), _new_like_heads(k), _new_like_heads(v)


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, key_padding_mask, scale, causal, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, key_padding_mask)
    ctx.scale, ctx.causal, ctx.window = scale, causal, window
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward_op(dout, q, k, v, out, lse, alibi_slopes, key_padding_mask,
                                              ctx.scale, ctx.causal, ctx.window)
    return dq, dk, dv, None, None, None, None, None


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)
