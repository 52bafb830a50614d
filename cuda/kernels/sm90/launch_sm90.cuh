// Launchers of the sm_90a kernels, instantiated per (dtype, head-dim class) in flash_sm90_hdim*.cu. Tensor maps
// (TMA descriptors) are encoded on the host for each call: a few microseconds, no device synchronisation, and they
// travel by value as __grid_constant__ kernel parameters, so a captured CUDA graph keeps them.
#pragma once

#include <climits>
#include <type_traits>

#include "kernels/common/bwd_pre_post.cuh"
#include "kernels/common/launch_utils.h"
#include "kernels/flash_api.h"
#include "kernels/sm90/flash_bwd_sm90_d256.cuh"
#include "kernels/sm90/flash_bwd_sm90_tma_wgmma_ws.cuh"
#include "kernels/sm90/flash_fwd_sm90_tma_wgmma_ws.cuh"
#include "kernels/sm90/tensor_maps.h"
#include "kernels/sm90/work_counter.cuh"

namespace jax_flash::cuda::sm90 {

template <typename T, typename TileTraits, SegmentMode kSegments, bool kSoftCap, bool kFixedReference>
cudaError_t launch_fwd_sm90_tiles(const FlashParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraitsSm90<T, TileTraits>;
  constexpr auto kernel = flash_fwd_sm90_kernel<T, Traits, kSegments, kSoftCap, kFixedReference>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  CUtensorMap tm_q, tm_k, tm_v;
  CUtensorMap tm_o{};  // O in boxes of one warpgroup's rows; read only by the shared-memory (TMA store) epilogue
  if (cudaError_t e = make_bthd_tensor_maps<T>(p, {{&tm_q, p.q, p.seqlen_q, p.heads_q, Traits::kBlockM},
                                                   {&tm_k, p.k, p.seqlen_k, p.heads_kv, Traits::kBlockN},
                                                   {&tm_v, p.v, p.seqlen_k, p.heads_kv, Traits::kBlockN}});
      e != cudaSuccess) {
    return e;
  }
  if constexpr (Traits::kStoreOSmem) {
    if (cudaError_t e = make_bthd_tensor_map<T>(&tm_o, p.o, p.batch, p.seqlen_q, p.heads_q, p.head_dim, kWgmmaM);
        e != cudaSuccess) {
      return e;
    }
  }
  // Persistent or with a work counter: as many CTAs as fit on the device at once (one per SM), or one per work unit
  // if fewer. The counter starts at 0 (zeroed on the stream, so a captured graph zeroes it on every replay).
  const FwdTileScheduler sched(p, Traits::kBlockM, Traits::kPersistent);
  if (!sched.units_fit()) return cudaErrorInvalidConfiguration;
  const int units = sched.units;
  if (units == 0) return cudaSuccess;
  int grid = units;
  if constexpr (Traits::kPersistent || Traits::kWorkCounter) {
    int ctas = 0;
    if (cudaError_t e = resident_ctas<kernel>(Traits::kThreads, Traits::kSmemBytes, &ctas); e != cudaSuccess) {
      return e;
    }
    grid = imin(units, ctas);
  }
  if constexpr (Traits::kWorkCounter) {
    if (cudaError_t e = zero_work_counter(p.fwd_counter, stream); e != cudaSuccess) return e;
  }
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v, tm_o);
  return cudaGetLastError();
}

// Whether a call takes the three-warpgroup tiles of traits Tiles (FwdCapTraitsSm90, FwdWideTraitsSm90): no window
// mask, and unmasked or causal over at least Tiles::kCausalMinRows query rows (on a shorter causal diagonal the taller
// tiles lose more than they gain).
template <typename Tiles>
bool takes_three_warpgroup_tiles(const FlashParams& p) {
  return p.window_left < 0 && p.window_right < 0 && (!p.causal || p.seqlen_q >= Tiles::kCausalMinRows);
}

// The forward of head-dim class kD: a soft-capped call takes the capped tiles where the head dim has them and the
// call their shape (FwdCapTraitsSm90 without a causal mask, FwdCapCausalTraitsSm90 with one); otherwise the wide-tile
// variant (FwdWideTraitsSm90) likewise; else the default tiles. Segment-id tests and the soft cap are compiled in only
// for calls that have them.
template <typename T, int kD, SegmentMode kSegments, bool kSoftCap, bool kFixedReference>
cudaError_t launch_fwd_sm90_variant(const FlashParams& p, cudaStream_t stream) {
  if constexpr (kSoftCap && FwdCapTraitsSm90<kD>::kAvailable) {
    if (takes_three_warpgroup_tiles<FwdCapTraitsSm90<kD>>(p)) {
      return launch_fwd_sm90_tiles<T, FwdCapTraitsSm90<kD>, kSegments, kSoftCap, kFixedReference>(p, stream);
    }
    if constexpr (FwdCapCausalTraitsSm90<kD>::kAvailable) {
      if (takes_three_warpgroup_tiles<FwdCapCausalTraitsSm90<kD>>(p)) {
        return launch_fwd_sm90_tiles<T, FwdCapCausalTraitsSm90<kD>, kSegments, kSoftCap, kFixedReference>(p, stream);
      }
    }
  }
  if constexpr (FwdWideTraitsSm90<kD>::kAvailable) {
    if (takes_three_warpgroup_tiles<FwdWideTraitsSm90<kD>>(p)) {
      return launch_fwd_sm90_tiles<T, FwdWideTraitsSm90<kD>, kSegments, kSoftCap, kFixedReference>(p, stream);
    }
  }
  return launch_fwd_sm90_tiles<T, FwdTraitsSm90<kD>, kSegments, kSoftCap, kFixedReference>(p, stream);
}

// A call with segment ids runs two persistent grids over the same tiles, one per segment policy (the kernel takes
// the tiles of its policy's batch elements and steps over the others', a flag load per batch element): one body
// with both policies, switched per tile, holds both in one consumer loop (d128: 80/192 B of spills against 4/16).
// A soft cap takes its fixed-reference variant where the cap's bound allows it (SoftCap::fixed_reference_holds:
// c <= 56.8) and P is bfloat16, else the running maximum: the fixed reference's terms reach 2^-(A + R) (2^-57.7 at
// c = 20), which float32 and bfloat16 hold but float16 (2^-24 at the least) flushes to 0, zeroing whole rows of P.
template <typename T, int kD>
cudaError_t launch_fwd_sm90(const FlashParams& p, cudaStream_t stream) {
  const SoftCap cap(p);
  return with_static_flags(
      [&](auto segments, auto soft_cap, auto fixed_reference) -> cudaError_t {
        constexpr bool kCap = decltype(soft_cap)::value;
        constexpr bool kFixed = kCap && decltype(fixed_reference)::value && std::is_same_v<T, __nv_bfloat16>;
        if constexpr (!decltype(segments)::value) {
          return launch_fwd_sm90_variant<T, kD, SegmentMode::kNone, kCap, kFixed>(p, stream);
        } else {
          if (cudaError_t e = launch_fwd_sm90_variant<T, kD, SegmentMode::kRuns, kCap, kFixed>(p, stream);
              e != cudaSuccess) {
            return e;
          }
          return launch_fwd_sm90_variant<T, kD, SegmentMode::kIds, kCap, kFixed>(p, stream);
        }
      },
      p.q_segment_ids != nullptr, cap.enabled(), cap.fixed_reference_holds(p.scale_log2));
}

// Q and dO in tiles of kBlockM rows, K and V in tiles of kBlockN: the loads of every sm_90a backward kernel.
template <typename T, typename Traits>
cudaError_t make_bwd_tensor_maps(const FlashParams& p, CUtensorMap* tm_q, CUtensorMap* tm_k, CUtensorMap* tm_v,
                                 CUtensorMap* tm_do) {
  return make_bthd_tensor_maps<T>(p, {{tm_q, p.q, p.seqlen_q, p.heads_q, Traits::kBlockM},
                                      {tm_do, p.dout, p.seqlen_q, p.heads_q, Traits::kBlockM},
                                      {tm_k, p.k, p.seqlen_k, p.heads_kv, Traits::kBlockN},
                                      {tm_v, p.v, p.seqlen_k, p.heads_kv, Traits::kBlockN}});
}

// The sm_90a main backward kernel, with or without ordered (deterministic) dQ additions: persistent (one CTA an
// SM, or one per unit if fewer) taking units from a counter in p.dq_semaphore, or with ordered additions one CTA
// per unit (tile_scheduler_bwd.cuh). Only as launch_bwd_sequence's main kernel: its preprocess zeroes the counter.
template <typename T, int kD, bool kDeterministic, bool kSegments, bool kSoftCap>
cudaError_t launch_bwd_sm90_main(const FlashParams& p, cudaStream_t stream) {
  using Traits = BwdKernelTraitsSm90<T, BwdTraitsSm90<kD>>;
  constexpr auto kernel = flash_bwd_sm90_kernel<T, Traits, kDeterministic, kSegments, kSoftCap>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_dk, tm_dv;
  if (cudaError_t e = make_bwd_tensor_maps<T, Traits>(p, &tm_q, &tm_k, &tm_v, &tm_do); e != cudaSuccess) return e;
  // dK and dV leave in boxes of one consumer warpgroup's keys (the TMA-store epilogue).
  if (cudaError_t e = make_bthd_tensor_maps<T>(p, {{&tm_dk, p.dk, p.seqlen_k, p.heads_kv, kWgmmaM},
                                                   {&tm_dv, p.dv, p.seqlen_k, p.heads_kv, kWgmmaM}});
      e != cudaSuccess) {
    return e;
  }
  // dQ tiles are added into dq_accum as kBlockM x kD blocks (DqFragmentOrder).
  if (p.head_dim_rounded != kD || p.seqlen_q_rounded % Traits::kBlockM != 0) return cudaErrorInvalidValue;
  const BwdTileScheduler sched(p, Traits::kBlockM, Traits::kBlockN);
  if (!sched.units_fit() || p.dq_semaphore == nullptr) return cudaErrorInvalidValue;
  if (sched.units == 0) return cudaSuccess;
  int grid = sched.units;
  if constexpr (!kDeterministic) {
    int ctas = 0;
    if (cudaError_t e = resident_ctas<kernel>(Traits::kThreads, Traits::kSmemBytes, &ctas); e != cudaSuccess) {
      return e;
    }
    grid = imin(sched.units, ctas);  // (the preprocess zeroed the work counter, dq_semaphore's first int)
  }
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v, tm_do, tm_dk, tm_dv);
  return cudaGetLastError();
}

// The head-dim-256 main backward kernel after FlashAttention-3 (docs/d256_bwd_plan.md): one CTA per (80-key block,
// kv head, batch), dQ^T added from registers in no fixed order (DqTransposedFragmentOrder; BackwardUnsupportedReason
// rejects deterministic=True there).
template <typename T, bool kSegments, bool kSoftCap>
cudaError_t launch_bwd_sm90_d256_main(const FlashParams& p, cudaStream_t stream) {
  using Traits = BwdD256TraitsSm90;
  constexpr auto kernel = flash_bwd_sm90_d256_kernel<T, kSegments, kSoftCap>;
  constexpr int kSmem = Traits::kSmemBytes<T>;
  if (cudaError_t e = ensure_smem_limit<kernel>(kSmem); e != cudaSuccess) return e;
  CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_dk, tm_dv;
  if (cudaError_t e = make_bwd_tensor_maps<T, Traits>(p, &tm_q, &tm_k, &tm_v, &tm_do); e != cudaSuccess) return e;
  if (cudaError_t e = make_bthd_tensor_maps<T>(p, {{&tm_dk, p.dk, p.seqlen_k, p.heads_kv, Traits::kBlockN},
                                                   {&tm_dv, p.dv, p.seqlen_k, p.heads_kv, Traits::kBlockN}});
      e != cudaSuccess) {
    return e;
  }
  // dQ^T tiles are added into dq_accum as 64 x 256 blocks (DqTransposedFragmentOrder).
  if (p.head_dim_rounded != Traits::kHeadDim || p.seqlen_q_rounded % Traits::kBlockM != 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p, tm_q, tm_k, tm_v, tm_do, tm_dk, tm_dv);
  return cudaGetLastError();
}

// The shared backward sequence (launch_bwd_sequence) around the sm_90a main kernel of the head-dim class, with the
// conversion reading dq_accum in the order that kernel adds into it. Segment-id tests and the soft cap are compiled
// in only for calls that have them, ordered dQ additions only for deterministic calls.
template <typename T, int kD>
cudaError_t launch_bwd_sm90(const FlashParams& p, cudaStream_t stream) {
  const bool segments = p.q_segment_ids != nullptr;
  const bool soft_cap = SoftCap(p).enabled();
  if constexpr (kD > 128) {
    return launch_bwd_sequence<T, DqTransposedFragmentOrder>(p, stream, [&] {
      return with_static_flags(
          [&](auto seg, auto cap) {
            return launch_bwd_sm90_d256_main<T, decltype(seg)::value, decltype(cap)::value>(p, stream);
          },
          segments, soft_cap);
    });
  } else {
    using DqOrder = DqFragmentOrder<BwdKernelTraitsSm90<T, BwdTraitsSm90<kD>>>;
    return launch_bwd_sequence<T, DqOrder>(p, stream, [&] {
      return with_static_flags(
          [&](auto det, auto seg, auto cap) {
            return launch_bwd_sm90_main<T, kD, decltype(det)::value, decltype(seg)::value, decltype(cap)::value>(
                p, stream);
          },
          p.deterministic, segments, soft_cap);
    });
  }
}

}  // namespace jax_flash::cuda::sm90

// Explicit instantiation for one (dtype, head-dim class).
#define JAX_FLASH_INSTANTIATE_SM90(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_fwd_sm90<T, D>(const FlashParams&, cudaStream_t);

// The backward has a Hopper kernel for these head-dim classes (others run the sm_80-class backward).
#define JAX_FLASH_INSTANTIATE_SM90_BWD(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_bwd_sm90<T, D>(const FlashParams&, cudaStream_t);
