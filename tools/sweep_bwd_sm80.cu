// Tile-configuration sweep of the sm80-class backward kernel at head dim 128 (bf16), without JAX.
//
// Instantiates the per-warp kernel flash_bwd_sm80_kernel<bf16, BwdKernelTraits<X>> and the CTA-wide kernel
// flash_bwd_sm80_cta_kernel<bf16, BwdCtaKernelTraits<Y>> for several traits in one binary, runs the full
// backward sequence of launch_bwd_sm80 (dq_accum memset, preprocess, main kernel, dq convert) for each, and
// prints per variant: registers, spills, shared memory, resident CTAs per SM, median time of the whole sequence
// and of the main kernel alone, TFLOP/s, and the error of dq/dk/dv against the production launcher
// (launch_bwd_sm80<bf16, 128>: the CTA-wide kernel k where the device has the shared memory, else variant a).
// Inputs are random; o and lse come from the forward kernel. FLOPs: bwd = 2.5 * 4*B*H*Sq*Sk*D, halved under --causal.
//
//   build/sweep_bwd_sm80 [--batch N] [--seq N] [--heads N] [--causal] [--warmup N] [--reps N]
// tools/sweep_bwd_sm80.sh builds and runs it (compile with -I cuda).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/sm80/launch_sm80.cuh"
#include "cuda_check.h"

using jax_flash::DType;
using jax_flash::FlashParams;
using namespace jax_flash::cuda;

namespace {

using Elem = __nv_bfloat16;
constexpr int kD = 128;
constexpr double kMaxRelErr = 1e-2;

// Same fields as BwdTraitsSm80<128>.
template <int kWarps_, int kSplitD_, int kBlockM_, int kMinBlocksPerSm_>
struct SweepTraits {
  static constexpr int kHeadDim = kD;
  static constexpr int kWarps = kWarps_;
  static constexpr int kSplitD = kSplitD_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
};

using LaunchFn = void (*)(const FlashParams&, cudaStream_t, cudaEvent_t, cudaEvent_t);

// Same fields as BwdCtaTraitsSm80<128>.
template <int kWarps_, int kBlockN_, int kBlockM_, int kSWarpsN_, int kKvWarpsN_, int kDqWarpsM_, int kMinBlocksPerSm_>
struct SweepCtaTraits {
  static constexpr int kHeadDim = kD;
  static constexpr int kWarps = kWarps_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kSWarpsN = kSWarpsN_;
  static constexpr int kKvWarpsN = kKvWarpsN_;
  static constexpr int kDqWarpsM = kDqWarpsM_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
};

struct Variant {
  const char* name;
  int warps, split_d, block_m, block_n, min_blocks, threads, smem_bytes;
  const void* kernel;
  LaunchFn launch;
};

// One kernel configuration: kernel, its main launcher (launch_bwd_sm80_main or launch_bwd_sm80_cta_main with
// Traits), shared memory and the "sd" column (0: CTA-wide kernel).
template <typename Traits, auto kKernel, auto kLaunchMain, int kSmemBytes, int kSplitD>
struct SweepVariant {
  // The backward sequence of launch_bwd_sm80 with this variant; main_begin/main_end bracket the main kernel.
  static void launch(const FlashParams& p, cudaStream_t s, cudaEvent_t main_begin, cudaEvent_t main_end) {
    CUDA_CHECK(launch_bwd_sequence<Elem, DqRowMajor>(p, s, [&]() -> cudaError_t {
      if (cudaError_t e = cudaEventRecord(main_begin, s); e != cudaSuccess) return e;
      if (cudaError_t e = kLaunchMain(p, s); e != cudaSuccess) return e;
      return cudaEventRecord(main_end, s);
    }));
  }
  static Variant make(const char* name) {
    return {name, Traits::kWarps, kSplitD, Traits::kBlockM, Traits::kBlockN, Traits::kMinBlocksPerSm,
            Traits::kThreads, kSmemBytes, reinterpret_cast<const void*>(kKernel), &launch};
  }
};

// Per-warp kernel.
template <typename Base>
Variant make_variant(const char* name) {
  using Traits = BwdKernelTraits<Base>;
  static_assert(Base::kHeadDim == kD, "the sweep is for head dim 128");
  static_assert(Base::kBlockM % kMmaM == 0, "kBlockM must be a multiple of 16");
  static_assert(Traits::kDimPerWarp % 16 == 0, "dK/dV columns per warp must be a multiple of 16");
  static_assert(Traits::kDqDimPerWarp % 16 == 0 && Traits::kDqDimPerWarp * Traits::kDqWarpsD == kD,
                "dQ columns per warp must tile the head dim in multiples of 16");
  return SweepVariant<Traits, flash_bwd_sm80_kernel<Elem, Traits>, launch_bwd_sm80_main<Elem, Traits>,
                      Traits::kSmemBytes, Base::kSplitD>::make(name);
}

// CTA-wide kernel.
template <typename Base>
Variant make_cta_variant(const char* name) {
  using Traits = BwdCtaKernelTraits<Base>;
  static_assert(Base::kHeadDim == kD, "the sweep is for head dim 128");
  return SweepVariant<Traits, flash_bwd_sm80_cta_kernel<Elem, Traits>, launch_bwd_sm80_cta_main<Elem, Traits>,
                      int(sizeof(BwdCtaSharedStorage<Elem, Traits>)), 0>::make(name);
}

std::vector<Variant> all_variants() {
  return {
      make_variant<BwdTraitsSm80<128>>("a w4 m32 (per-warp)"),
      make_cta_variant<BwdCtaTraitsSm80<128>>("k cta n128 m64"),
      make_cta_variant<SweepCtaTraits<8, 128, 64, 4, 4, 4, 1>>("l cta dq4x2"),
      make_cta_variant<SweepCtaTraits<8, 128, 32, 4, 4, 2, 1>>("m cta n128 m32"),
      make_cta_variant<SweepCtaTraits<4, 64, 64, 2, 2, 2, 2>>("n cta n64 m64 2cta"),
      make_variant<SweepTraits<8, 1, 32, 1>>("b w8 m32"),
      make_variant<SweepTraits<8, 1, 64, 1>>("c w8 m64"),
      make_variant<SweepTraits<4, 1, 64, 1>>("d w4 m64"),
      make_variant<SweepTraits<8, 1, 16, 1>>("e w8 m16"),
      make_variant<SweepTraits<4, 1, 16, 1>>("f w4 m16"),
      make_variant<SweepTraits<8, 2, 64, 1>>("g w8 sd2 m64"),
      make_variant<SweepTraits<8, 2, 32, 2>>("h w8 sd2 m32 2cta"),
      make_variant<SweepTraits<8, 2, 16, 2>>("i w8 sd2 m16 2cta"),
      make_variant<SweepTraits<4, 2, 32, 4>>("j w4 sd2 m32 4cta"),
  };
}

// ---- inputs ------------------------------------------------------------------------------------------------------
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform on [-sqrt(3), sqrt(3)) (unit variance, so q.k/sqrt(D) has unit variance), fixed seed per tensor.
void fill_random(std::vector<Elem>& host, Elem* dev, uint64_t seed) {
  const float half_width = std::sqrt(3.f);
  for (size_t i = 0; i < host.size(); ++i) {
    const double u = double(splitmix64(seed * 0x100000001B3ull + i) >> 11) * 0x1.0p-53;  // [0, 1)
    host[i] = __float2bfloat16_rn(float((2.0 * u - 1.0) * half_width));
  }
  CUDA_CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(Elem), cudaMemcpyHostToDevice));
}

// ---- comparison --------------------------------------------------------------------------------------------------
struct DiffAccum {
  double sq_diff;
  double sq_ref;
  unsigned int max_abs_bits;  // bit pattern of a non-negative float: ordered like the float
  unsigned long long nonfinite;
};

__device__ bool bf16_finite(Elem x) {
  const unsigned short bits = *reinterpret_cast<const unsigned short*>(&x);
  return (bits & 0x7F80u) != 0x7F80u;
}

__global__ void diff_kernel(const Elem* x, const Elem* ref, int64_t n, DiffAccum* out) {
  double sq_diff = 0.0, sq_ref = 0.0;
  float max_abs = 0.f;
  unsigned long long nonfinite = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (!bf16_finite(x[i]) || !bf16_finite(ref[i])) {
      ++nonfinite;
      continue;
    }
    const float a = __bfloat162float(x[i]), r = __bfloat162float(ref[i]);
    const double d = double(a) - double(r);
    sq_diff += d * d;
    sq_ref += double(r) * r;
    max_abs = fmaxf(max_abs, fabsf(a - r));
  }
  for (int off = 16; off > 0; off /= 2) {
    sq_diff += __shfl_xor_sync(0xffffffff, sq_diff, off);
    sq_ref += __shfl_xor_sync(0xffffffff, sq_ref, off);
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffff, max_abs, off));
    nonfinite += __shfl_xor_sync(0xffffffff, nonfinite, off);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&out->sq_diff, sq_diff);
    atomicAdd(&out->sq_ref, sq_ref);
    atomicMax(&out->max_abs_bits, __float_as_uint(max_abs));
    atomicAdd(&out->nonfinite, nonfinite);
  }
}

struct Diff {
  double rel_l2;
  float max_abs;
  double ref_rms;
  unsigned long long nonfinite;
  bool ok() const { return nonfinite == 0 && rel_l2 < kMaxRelErr; }
};

Diff compare(const Elem* x, const Elem* ref, int64_t n, DiffAccum* scratch, cudaStream_t s) {
  CUDA_CHECK(cudaMemsetAsync(scratch, 0, sizeof(DiffAccum), s));
  diff_kernel<<<1024, 256, 0, s>>>(x, ref, n, scratch);
  CUDA_CHECK(cudaGetLastError());
  DiffAccum h;
  CUDA_CHECK(cudaMemcpyAsync(&h, scratch, sizeof(h), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  float max_abs;
  std::memcpy(&max_abs, &h.max_abs_bits, sizeof(max_abs));
  return {h.sq_ref > 0 ? std::sqrt(h.sq_diff / h.sq_ref) : (h.sq_diff > 0 ? INFINITY : 0.0), max_abs,
          std::sqrt(h.sq_ref / double(n)), h.nonfinite};
}

// ---- driver ------------------------------------------------------------------------------------------------------
struct Options {
  int batch = 4, seq = 4096, heads = 16;
  bool causal = false;
  int warmup = 3, reps = 20;
};

[[noreturn]] void usage(const char* argv0, int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: %s [--batch N] [--seq N] [--heads N] [--causal] [--warmup N] [--reps N]\n"
               "defaults: --batch 4 --seq 4096 --heads 16 --warmup 3 --reps 20 (head dim 128, bf16)\n",
               argv0);
  std::exit(rc);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    auto value = [&]() {
      if (i + 1 >= argc) usage(argv[0], 2);
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v <= 0 || v > (1 << 24)) usage(argv[0], 2);
      return int(v);
    };
    if (!std::strcmp(a, "--batch")) o.batch = value();
    else if (!std::strcmp(a, "--seq")) o.seq = value();
    else if (!std::strcmp(a, "--heads")) o.heads = value();
    else if (!std::strcmp(a, "--warmup")) o.warmup = value();
    else if (!std::strcmp(a, "--reps")) o.reps = value();
    else if (!std::strcmp(a, "--causal")) o.causal = true;
    else if (!std::strcmp(a, "--help") || !std::strcmp(a, "-h")) usage(argv[0], 0);
    else usage(argv[0], 2);
  }
  return o;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

template <typename X>
X* device_alloc(int64_t n) {
  X* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, n * sizeof(X)));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  int dev = 0, clock_khz = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::printf("device: %s (sm_%d%d), %d SMs, max SM clock %.0f MHz, %zu KB smem per block (opt-in)\n", prop.name,
              prop.major, prop.minor, sms, clock_khz / 1e3, prop.sharedMemPerBlockOptin / 1024);
  const double flops = 2.5 * 4.0 * opt.batch * opt.heads * double(opt.seq) * opt.seq * kD * (opt.causal ? 0.5 : 1.0);
  std::printf("shape: B=%d S=%d H=%d D=%d bf16 %s; bwd %.3f TFLOP; %d warmup + %d timed reps, medians\n", opt.batch,
              opt.seq, opt.heads, kD, opt.causal ? "causal" : "non-causal", flops * 1e-12, opt.warmup, opt.reps);

  const int64_t q_elems = int64_t(opt.batch) * opt.seq * opt.heads * kD;  // q, k, v, o, dout and gradients alike
  const int64_t stat_elems = int64_t(opt.batch) * opt.heads * opt.seq;
  Elem* q = device_alloc<Elem>(q_elems);
  Elem* k = device_alloc<Elem>(q_elems);
  Elem* v = device_alloc<Elem>(q_elems);
  Elem* o = device_alloc<Elem>(q_elems);
  Elem* dout = device_alloc<Elem>(q_elems);
  Elem* grads = device_alloc<Elem>(3 * q_elems);      // dq, dk, dv
  Elem* ref_grads = device_alloc<Elem>(3 * q_elems);  // production launcher's dq, dk, dv
  float* lse = device_alloc<float>(stat_elems);
  // The backward's workspaces: rows padded to whole 128-row tiles, dq_accum columns to the head-dim class.
  constexpr int kAlign = jax_flash::kRowStatsAlign;
  const int seq_rounded = (opt.seq + kAlign - 1) / kAlign * kAlign;
  const int head_dim_rounded = jax_flash::head_dim_class(kD);
  float* row_stats = device_alloc<float>(int64_t(opt.batch) * opt.heads * 2 * seq_rounded);
  float* dq_accum = device_alloc<float>(int64_t(opt.batch) * opt.heads * seq_rounded * head_dim_rounded);
  int32_t* q_lens = device_alloc<int32_t>(opt.batch);
  int32_t* kv_lens = device_alloc<int32_t>(opt.batch);
  int32_t* offsets = device_alloc<int32_t>(opt.batch);  // whole sequences: global position 0
  DiffAccum* diff_scratch = device_alloc<DiffAccum>(1);
  {
    std::vector<Elem> host(q_elems);
    fill_random(host, q, 1);
    fill_random(host, k, 2);
    fill_random(host, v, 3);
    fill_random(host, dout, 4);
    const std::vector<int32_t> lens(opt.batch, opt.seq);
    CUDA_CHECK(cudaMemcpy(q_lens, lens.data(), opt.batch * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(kv_lens, lens.data(), opt.batch * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(offsets, 0, opt.batch * sizeof(int32_t)));
  }

  // As FillCommonParams / FillBackwardParams would for this call.
  FlashParams p{};
  p.batch = opt.batch;
  p.seqlen_q = p.seqlen_k = opt.seq;
  p.heads_q = p.heads_kv = opt.heads;
  p.head_dim = kD;
  p.dtype = DType::kBF16;
  p.scale = 1.f / std::sqrt(float(kD));
  p.scale_log2 = p.scale * jax_flash::kLog2e;
  p.causal = opt.causal;
  p.window_left = p.window_right = -1;
  p.q_lens = q_lens;
  p.kv_lens = kv_lens;
  p.q_offsets = p.kv_offsets = offsets;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.dout = dout;
  p.dq = grads;
  p.dk = grads + q_elems;
  p.dv = grads + 2 * q_elems;
  p.dq_accum = dq_accum;
  p.row_stats = row_stats;
  p.seqlen_q_rounded = seq_rounded;
  p.head_dim_rounded = head_dim_rounded;

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(launch_fwd_sm80<Elem, kD>(p, stream));  // o and lse

  // Reference: the production launcher.
  FlashParams ref = p;
  ref.dq = ref_grads;
  ref.dk = ref_grads + q_elems;
  ref.dv = ref_grads + 2 * q_elems;
  CUDA_CHECK(cudaMemsetAsync(ref_grads, 0xFF, 3 * q_elems * sizeof(Elem), stream));
  CUDA_CHECK(launch_bwd_sm80<Elem, kD>(ref, stream, int(prop.sharedMemPerBlockOptin)));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const char* grad_names[3] = {"dq", "dk", "dv"};
  bool ref_ok = true;
  std::printf("reference (launch_bwd_sm80<bf16,128>; variant \"sd\" 0 = CTA-wide kernel):");
  for (int i = 0; i < 3; ++i) {
    const Diff self = compare(ref_grads + i * q_elems, ref_grads + i * q_elems, q_elems, diff_scratch, stream);
    std::printf(" %s rms %.4g%s", grad_names[i], self.ref_rms, self.nonfinite ? " NON-FINITE" : "");
    ref_ok = ref_ok && self.nonfinite == 0 && self.ref_rms > 0;
  }
  std::printf("%s\n\n", ref_ok ? "" : "  (FAIL: reference not finite or all zero)");

  std::vector<cudaEvent_t> events(4 * opt.reps);
  for (auto& e : events) CUDA_CHECK(cudaEventCreate(&e));

  std::printf("%-18s %2s %3s %3s %3s %4s %4s %5s %6s %6s %9s %9s %7s %7s  %-26s %-26s %-26s %s\n", "variant", "w",
              "sd", "BM", "BN", "minB", "regs", "spill", "smemKB", "CTA/SM", "total_ms", "main_ms", "TF/s", "mainTF",
              "dq rel / maxabs", "dk rel / maxabs", "dv rel / maxabs", "check");
  bool all_ok = ref_ok;
  for (const Variant& var : all_variants()) {
    cudaFuncAttributes attr;
    CUDA_CHECK(cudaFuncGetAttributes(&attr, var.kernel));
    std::printf("%-18s %2d %3d %3d %3d %4d %4d %5zu %6.1f ", var.name, var.warps, var.split_d, var.block_m,
                var.block_n, var.min_blocks, attr.numRegs, attr.localSizeBytes, var.smem_bytes / 1024.0);
    if (size_t(var.smem_bytes) > prop.sharedMemPerBlockOptin) {
      std::printf("skipped: needs %d B of shared memory\n", var.smem_bytes);
      continue;
    }
    CUDA_CHECK(cudaFuncSetAttribute(var.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, var.smem_bytes));
    int ctas_per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, var.kernel, var.threads, var.smem_bytes));
    std::printf("%6d ", ctas_per_sm);
    if (ctas_per_sm == 0) {
      std::printf("skipped: does not fit on an SM\n");
      continue;
    }

    CUDA_CHECK(cudaMemsetAsync(grads, 0xFF, 3 * q_elems * sizeof(Elem), stream));
    for (int i = 0; i < opt.warmup; ++i) var.launch(p, stream, events[1], events[2]);
    for (int r = 0; r < opt.reps; ++r) {
      CUDA_CHECK(cudaEventRecord(events[4 * r], stream));
      var.launch(p, stream, events[4 * r + 1], events[4 * r + 2]);
      CUDA_CHECK(cudaEventRecord(events[4 * r + 3], stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> total_ms(opt.reps), main_ms(opt.reps);
    for (int r = 0; r < opt.reps; ++r) {
      CUDA_CHECK(cudaEventElapsedTime(&total_ms[r], events[4 * r], events[4 * r + 3]));
      CUDA_CHECK(cudaEventElapsedTime(&main_ms[r], events[4 * r + 1], events[4 * r + 2]));
    }
    const float t_total = median(total_ms), t_main = median(main_ms);
    std::printf("%9.3f %9.3f %7.1f %7.1f ", t_total, t_main, flops / (t_total * 1e-3) * 1e-12,
                flops / (t_main * 1e-3) * 1e-12);

    bool ok = true;
    for (int i = 0; i < 3; ++i) {
      const Diff d = compare(grads + i * q_elems, ref_grads + i * q_elems, q_elems, diff_scratch, stream);
      char cell[64];
      if (d.nonfinite) std::snprintf(cell, sizeof(cell), "%llu non-finite", d.nonfinite);
      else std::snprintf(cell, sizeof(cell), "%.2e / %.2e", d.rel_l2, d.max_abs);
      std::printf(" %-26s", cell);
      ok = ok && d.ok();
    }
    std::printf(" %s\n", ok ? "ok" : "FAIL");
    all_ok = all_ok && ok;
  }

  for (auto& e : events) CUDA_CHECK(cudaEventDestroy(e));
  CUDA_CHECK(cudaStreamDestroy(stream));
  for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)grads, (void*)ref_grads, (void*)lse,
                    (void*)row_stats, (void*)dq_accum, (void*)q_lens, (void*)kv_lens, (void*)offsets,
                    (void*)diff_scratch}) {
    CUDA_CHECK(cudaFree(ptr));
  }
  std::printf("\n%s (pass: rel L2 < %.0e vs the production launcher, every value finite)\n",
              all_ok ? "all variants pass" : "SOME VARIANTS FAIL", kMaxRelErr);
  return all_ok ? 0 : 1;
}
