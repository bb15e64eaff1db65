"""Weight-only int8 / int4 products at batch 1 on the CPU: ms per product and GB/s of weight bytes read.
Each call reads its weights from memory (a 64 MiB buffer is written between calls, twice the L3), as
decoding does; variants take turns in every round; the median of all calls.

    PYTHONPATH=. python tools/quantize_products.py ROUNDS all [THREADS]   # e.g. 5 all 1; 5 fp32 2: the fp32 forms
"""
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F

from generate import SPLIT_BYTES, SplitLinear
from quantize import Int4Linear, Int8Linear

torch.manual_seed(0)
warnings.filterwarnings("ignore", message=".*quantize_per")
if len(sys.argv) > 3:
    torch.set_num_threads(int(sys.argv[3]))
SHAPES = [(768, 768), (2304, 768), (3072, 768), (768, 3072), (50304, 768)]  # (out, in) as a Linear's weight
ROUNDS, CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 5, 5
ONLY = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else None
G = 128
int4mm = torch.ops.aten._weight_int4pack_mm_for_cpu
flush = torch.zeros(2**24)  # 64 MiB
pool = ThreadPoolExecutor(1)


def halves(x, wt):  # x @ wt, (in, out), its two column halves on two Python threads (torch's own threads spin)
    n = wt.size(1) // 2
    other = pool.submit(torch.mm, x, wt[:, :n])
    mine = torch.mm(x, wt[:, n:])  # while the other thread multiplies its half
    return torch.cat([other.result(), mine], 1)


def q8(w):
    s = w.abs().amax(1) / 127
    return torch.round(w / s[:, None]).to(torch.int8), s


def q4(w, g=G):
    N, K = w.shape
    wg = w.reshape(N, K // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = (hi - lo).clamp(min=1e-6) / 15
    q = ((wg - lo[..., None]) / s[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    return q, s, lo + 8 * s  # w ~ (q - 8) * s + z


def nibbles(q):  # (N, K) 0..15 -> (N, K/2) uint8, even k in the low nibble
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack(p):  # (N, K/2) uint8 -> (N, K) uint8
    return torch.stack([p & 15, p >> 4], -1).reshape(p.size(0), -1)


# int8: the compiled forms
c8_linear = torch.compile(lambda x, w, s: F.linear(x, w.to(x.dtype)) * s, dynamic=False)
c8_matmul = torch.compile(lambda x, w, s: x @ (w.to(x.dtype) * s[:, None]).T, dynamic=False)
c8_mv = torch.compile(lambda x, w, s: (x[:, None, :] * w.to(x.dtype)).sum(-1) * s, dynamic=False)
c8_mvT = torch.compile(lambda x, wt, s: (x[:, :, None] * wt.to(x.dtype)).sum(1) * s, dynamic=False)


def deq4(p, s, z, dtype):
    N = p.size(0)
    q = unpack(p).reshape(N, s.size(1), -1).to(dtype)
    return ((q - 8) * s[..., None].to(dtype) + z[..., None].to(dtype)).reshape(N, -1)


c4_linear = torch.compile(lambda x, p, s, z: F.linear(x, deq4(p, s, z, x.dtype)), dynamic=False)


def mv4(x, p, s, z):  # y = sum_g s * (x_g . q_g) + (z - 8 s) * sum(x_g): the integer part summed first
    N, ng = s.shape
    xg = x.view(x.size(0), 1, ng, -1)
    q = unpack(p).view(1, N, ng, -1).to(x.dtype)
    return ((xg * q).sum(-1) * s + xg.sum(-1) * (z - 8 * s)).sum(-1)


c4_mv = torch.compile(mv4, dynamic=False)
c4_mv_deq = torch.compile(lambda x, p, s, z: (x[:, None, :] * deq4(p, s, z, x.dtype)).sum(-1), dynamic=False)


def variants(N, K):
    w = torch.randn(N, K) * 0.02
    w8, s8 = q8(w)
    q, s4, z4 = q4(w)
    p4 = nibbles(q)
    cpu4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    sz = torch.stack([s4, z4], -1).transpose(0, 1).contiguous()  # (K/G, N, 2)
    szb = sz.bfloat16()
    wb = w.bfloat16()
    s8b = s8.bfloat16()
    fp16 = torch.ops.onednn.linear_prepack_fp16(w, [1, K])
    zeros = torch.zeros(N, dtype=torch.long)
    dyn = torch.ops.quantized.linear_prepack(torch.quantize_per_channel(w, s8.double(), zeros, 0, torch.qint8))
    wT = w.t().contiguous().t()
    onednn_w = torch.ops.onednn.qlinear_prepack(w8, [1, K])

    def onednn_w8a8(x):  # x quantized to uint8 per call (not weight-only: a second rounding)
        xs = x.abs().amax() / 127
        qx = torch.round(x / xs).add_(128).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, float(xs), 128, onednn_w, s8, zeros, None, 1.0, 0,
                                                  torch.float32, "none", [], "")
    w8T = w8.t().contiguous()
    b8, b4 = N * K + 4 * N, N * K // 2 + 8 * N * K // G  # weights and fp32 scales (and zeros) read
    b8b, b4b = N * K + 2 * N, N * K // 2 + 4 * N * K // G  # with bf16 ones
    linear = nn.Linear(K, N, bias=False)
    linear.weight.data = w
    int8, int4 = Int8Linear(linear), Int4Linear(linear, G)
    parts = min(torch.get_num_threads(), 4 * N * K // SPLIT_BYTES)  # as decode_layout splits: 1, a plain product
    split = SplitLinear(nn.Linear(K, N, bias=False), parts) if parts > 1 else (lambda x: F.linear(x, wT))
    if parts > 1:
        split.weight.data = wT
    return {  # name: (fn, weight bytes read)
        "fp32 F.linear, (out,in)": (lambda x: F.linear(x, w), 4 * N * K),
        "fp32 F.linear, decode_layout": (lambda x: F.linear(x, wT), 4 * N * K),
        "fp32 SplitLinear (as decode_layout splits)": (split, 4 * N * K),
        "fp32 two Python threads, a half each": (lambda x: halves(x, wT.t()), 4 * N * K),
        "bf16 F.linear": (lambda x: F.linear(x.bfloat16(), wb).float(), 2 * N * K),
        "fp16 onednn.linear_dynamic_fp16": (lambda x: torch.ops.onednn.linear_dynamic_fp16(x, fp16, None), 2 * N * K),
        "int8 _weight_int8pack_mm fp32": (lambda x: torch._weight_int8pack_mm(x, w8, s8), b8),
        "int8 _weight_int8pack_mm bf16 x": (lambda x: torch._weight_int8pack_mm(x.bfloat16(), w8, s8b).float(), b8b),
        "int8 dequant + F.linear": (lambda x: F.linear(x, w8.float()) * s8, b8),
        "int8 compiled F.linear(x, w.to)*s": (lambda x: c8_linear(x, w8, s8), b8),
        "int8 compiled x @ (w.to*s).T": (lambda x: c8_matmul(x, w8, s8), b8),
        "int8 compiled (x*w).sum(-1)*s": (lambda x: c8_mv(x, w8, s8), b8),
        "int8 compiled (in,out) (x*wT).sum*s": (lambda x: c8_mvT(x, w8T, s8), b8),
        "int8 dynamic W8A8 quantized::linear_dynamic": (lambda x: torch.ops.quantized.linear_dynamic(x, dyn), b8),
        "int8 W8A8 onednn.qlinear_pointwise": (onednn_w8a8, b8),
        "Int8Linear (this change)": (int8, b8b),
        "int4 _weight_int4pack_mm_for_cpu fp32": (lambda x: int4mm(x, cpu4, G, sz), b4),
        "int4 _weight_int4pack_mm_for_cpu bf16 x": (lambda x: int4mm(x.bfloat16(), cpu4, G, szb).float(), b4b),
        "int4 dequant + F.linear": (lambda x: F.linear(x, deq4(p4, s4, z4, x.dtype)), b4),
        "int4 compiled F.linear(x, dequant)": (lambda x: c4_linear(x, p4, s4, z4), b4),
        "int4 compiled (x*dequant).sum": (lambda x: c4_mv_deq(x, p4, s4, z4), b4),
        "int4 compiled group sums (mv4)": (lambda x: c4_mv(x, p4, s4, z4), b4),
        "Int4Linear, group 128 (this change)": (int4, b4b),
    }


def main():
    cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, int4 group {G}; "
          f"median of {ROUNDS} rounds x {CALLS} calls, weights evicted from cache before each call; "
          "GPT-2 step: 12 x the four block products + the 50304-row head")
    table, ref = {}, {}
    with torch.no_grad():
        for N, K in SHAPES:
            vs = {k: v for k, v in variants(N, K).items()
                  if ONLY is None or any(o in k for o in ONLY) or "decode_layout" in k}
            x = torch.randn(1, K)
            base = vs["fp32 F.linear, (out,in)"][0](x) if "fp32 F.linear, (out,in)" in vs else None
            for name, (fn, _) in vs.items():  # warm up (and compile); the error against fp32's product
                y = fn(x)
                ref[name, N, K] = float((y - base).abs().max() / base.abs().max()) if base is not None else float("nan")
            times = {name: [] for name in vs}
            for _ in range(ROUNDS):
                for name, (fn, _) in vs.items():
                    for _ in range(CALLS):
                        flush.add_(1)
                        t = time.perf_counter()
                        fn(x)
                        times[name].append(time.perf_counter() - t)
            for name, (fn, nbytes) in vs.items():
                table[name, N, K] = statistics.median(times[name]), nbytes
    names = list(dict.fromkeys(n for n, _, _ in table))
    head = " | ".join(f"{N}x{K}" for N, K in SHAPES)
    print(f"{'ms per product (GB/s)':<44} | {head} | GPT-2 step ms | vs fp32 decode_layout")
    step = lambda name: sum(table[name, N, K][0] * (1 if N == 50304 else 12) for N, K in SHAPES)  # noqa: E731
    base = step("fp32 F.linear, decode_layout")
    for name in names:
        cells = [f"{table[name, N, K][0] * 1e3:.3f} ({table[name, N, K][1] / table[name, N, K][0] / 1e9:.0f})"
                 for N, K in SHAPES]
        print(f"{name:<44} | {' | '.join(cells)} | {step(name) * 1e3:.2f} | {base / step(name):.2f}x")
    print("max |y - y_fp32| / max |y_fp32| at 768x3072 (rounding of the weights included):")
    for name in names:
        print(f"  {name:<44} {ref[name, 768, 3072]:.4f}")


main()
