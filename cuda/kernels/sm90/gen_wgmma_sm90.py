"""Writes wgmma_sm90.cuh, the wgmma wrappers"""
# Writes the wgmma wrappers: inline PTX needs literal operand lists, so each shape is spelled out.
out = []
w = out.append
w("// wgmma.mma_async wrappers (sm_90a): D[64 x N] (+)= A[64 x 16] * B[16 x N], float32 accumulators.")
w("// Inline PTX needs each accumulator register as a literal operand, so every (N, A-source) pair is spelled out;")
w("// this file is written by gen_wgmma_sm90.py (python3 cuda/kernels/sm90/gen_wgmma_sm90.py).")
w("//   Wgmma<N, T, kTransB>::ss<kTransA>(d, desc_a, desc_b, accumulate): A and B from shared memory (descriptors);")
w("//   Wgmma<N, T, kTransB>::rs(d, a, desc_b, accumulate): A from registers (4 x 32-bit: a 16 x 16 tile per warp).")
w("// kTransB = 1 reads B as N-major (e.g. V[key][dim] for O += P V); 0 as K-major (e.g. K[key][dim] for S = Q K^T);")
w("// kTransA = 1 reads A as M-major (e.g. dS^T[key][query] for dQ = dS K).")
w("// Accumulator layout per thread (warp w of the warpgroup, lane = 4 g + t): d[4 j + e] holds row 16 w + g + 8 (e / 2),")
w("// column 8 j + 2 t + (e % 2): the m16n8 accumulator layout of mma.sync, repeated over N / 8 column tiles.")
w("#pragma once")
w("")
w("#include <cuda_bf16.h>")
w("#include <cuda_fp16.h>")
w("")
w("#include <cstdint>")
w("")
w("namespace jax_flash::cuda::sm90 {")
w("")
w("template <int N, typename T, int kTransB>")
w("struct Wgmma;")
w("")
for N in (32, 40, 64, 80, 96, 128, 256):  # S/dP tiles (64, 96, 128; 40 a d256 warpgroup's keys), O/dK/dV widths
    # (64, 128, 256; 80 the d256 backward's dK^T/dV^T keys), dQ halves (32, 64)
    nreg = N // 2
    for tname, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
        w("template <int kTransB>")
        w(f"struct Wgmma<{N}, {tname}, kTransB> {{")
        # SS
        dl = ", ".join(f"%{i}" for i in range(nreg))
        a = nreg
        w("  template <int kTransA = 0>")
        w(f"  __device__ __forceinline__ static void ss(float (&d)[{nreg}], uint64_t desc_a, uint64_t desc_b, int accumulate) {{")
        w("    asm volatile(")
        w('        "{\\n.reg .pred p;\\n"')
        w(f'        "setp.ne.b32 p, %{a+2}, 0;\\n"')
        w(f'        "wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{ptx}.{ptx} "')
        # split register list into lines
        regs = [f"%{i}" for i in range(nreg)]
        lines = [", ".join(regs[i:i+16]) for i in range(0, nreg, 16)]
        w('        "{"')
        for i, l in enumerate(lines):
            sep = "," if i < len(lines) - 1 else ""
            w(f'        "{l}{sep}"')
        w(f'        "}}, %{a}, %{a+1}, p, 1, 1, %{a+4}, %{a+3};\\n}}\\n"')
        ops = [f'"+f"(d[{i}])' for i in range(nreg)]
        w("        : " + ",\n          ".join(", ".join(ops[i:i+8]) for i in range(0, nreg, 8)))
        w('        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB), "n"(kTransA));')
        w("  }")
        # RS
        w(f"  __device__ __forceinline__ static void rs(float (&d)[{nreg}], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {{")
        w("    asm volatile(")
        w('        "{\\n.reg .pred p;\\n"')
        w(f'        "setp.ne.b32 p, %{a+5}, 0;\\n"')
        w(f'        "wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{ptx}.{ptx} "')
        w('        "{"')
        for i, l in enumerate(lines):
            sep = "," if i < len(lines) - 1 else ""
            w(f'        "{l}{sep}"')
        w(f'        "}}, {{%{a}, %{a+1}, %{a+2}, %{a+3}}}, %{a+4}, p, 1, 1, %{a+6};\\n}}\\n"')
        w("        : " + ",\n          ".join(", ".join(ops[i:i+8]) for i in range(0, nreg, 8)))
        w('        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(kTransB));')
        w("  }")
        w("};")
        w("")
w("}  // namespace jax_flash::cuda::sm90")
open(__import__("os").path.join(__import__("os").path.dirname(__file__), "wgmma_sm90.cuh"), "w").write("\n".join(out) + "\n")
