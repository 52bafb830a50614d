// Tile choices of the sm_90a kernels (TMA + wgmma + warp specialisation), one traits struct per head-dim class.
// Reasons next to each choice; measured results in NOTES.md.
//
// Forward CTA (tiles from FwdTileScheduler; with kPersistent one CTA per SM walks many, else a CTA per unit): one
// producer warpgroup (a single thread issues every TMA load; the warpgroup gives its registers away with
// setmaxnreg) and kConsumerWarpgroups consumer warpgroups of 64 query rows each. K and V tiles of kBlockN keys
// stream through a kStages-deep ring of shared-memory buffers guarded by mbarriers; the ring runs on across a CTA's
// tiles. With kStoreOSmem each consumer warpgroup writes its O tile to shared memory and one thread stores it with
// TMA while the next tile starts.
#pragma once

#include <climits>
#include <cstdint>

#include "kernels/sm90/pipeline.h"
#include "kernels/sm90/tile_scheduler_bwd.cuh"
#include "kernels/sm90/tile_scheduler_fwd.cuh"

namespace jax_flash::cuda::sm90 {

inline constexpr int kWarpgroupThreads = 128;  // four warps issue one wgmma together
inline constexpr int kWgmmaM = 64;       // rows of one wgmma (a warpgroup's query rows)
inline constexpr int kWgmmaK = 16;       // reduction depth of one 16-bit wgmma
inline constexpr int kColBlock = 64;     // 16-bit elements per 128-byte swizzled row: TMA box width
inline constexpr int kMaxConsumerWarpgroups = 3;

template <int kHeadDim_>
struct FwdTraitsSm90;

// The primary template of each further forward tile choice (FwdWideTraitsSm90, FwdCapTraitsSm90,
// FwdCapCausalTraitsSm90): a head dim without a specialisation has none, and no call takes it.
struct NoFwdTileChoice {
  static constexpr bool kAvailable = false;
  static constexpr int kCausalMinRows = INT_MAX;
};

template <>
struct FwdTraitsSm90<64> {
  static constexpr int kHeadDim = 64;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 128;  // S accumulator 64 registers; small K/V tiles (16 KB) allow a deep ring
  static constexpr int kStages = 3;
  static constexpr bool kPingPong = true;  // softmax of one warpgroup under the other's GEMMs
  // Each step's PV_{i-1} wait pinned after the softmax (wgmma_wait_after), so the exponentials also run under the
  // warpgroup's own PV product; left to ptxas, the wait comes before them. Measured per head dim (H100, NOTES
  // session 41): d256 +5-7 % forward, d128 -1..-4 %, d64 -3..-5 %: only d256 takes it.
  static constexpr bool kSoftmaxUnderPv = false;
  // The online softmax's reference maximum moves only when a row's maximum passes it by more than 2^8, so most
  // steps skip O's rescale (FlashAttention-4's lazy rescale; FwdMainloop::kLazyLog2). Measured per kernel (H100,
  // NOTES session 42, two A/Bs): d256 +2-8 % forward, d64's three-warpgroup kernel +2 %, d128 level (-1..+4 %
  // around 0), d64's two-warpgroup kernel (causal) -1..-2 %: d256 and the d64 wide kernel take it.
  static constexpr bool kLazyRescale = false;
  // A capped call against a fixed reference (FwdMainloop's kFixedReference) takes the exponentials of every k-th
  // 8-column tile of S on the FMA pipe (exp2_fma) instead of MUFU, beside the tanh's MUFU op; 0: none. Measured with
  // k = 4 (H200, NOTES session 38): the d64 three-warpgroup forward x1.055, d128 x0.98, d256 x0.98 (k = 2: 0.90-0.97),
  // so only FwdWideTraitsSm90<64> takes it.
  static constexpr int kCapExpOnFmaEvery = 0;
  // A bfloat16 capped call's consumer warpgroups scale their rows of Q by the cap's pre in shared memory once a tile
  // (FwdMainloop::kScaledQ), so no score needs an FMUL ahead of its tanh. Measured (H200, NOTES session 66): the
  // three-warpgroup capped forward x1.011-1.034 (d128), x1.021 (d64 wide); the two-warpgroup tiles' short causal
  // rows lose (16 x 1024: x0.969, few key tiles a tile to pay for the pass), d256 level: only the 192-row tiles
  // take it.
  static constexpr bool kCapScaledQ = false;
  static constexpr bool kStoreOSmem = true;  // Q 16 + 3 x 32 + O 16 KB = 128 KB
  static constexpr bool kPersistent = true;  // faster on short sequences than a CTA per tile, equal on long ones
  // A grid of resident CTAs that take the CTA-per-unit order's units from a work counter (FlashParams::fwd_counter):
  // the dynamic balance of a CTA per unit with a persistent CTA's overlap of one tile's start with the last one's end
  // (kPersistent false; the capped causal tiles take it).
  static constexpr bool kWorkCounter = false;
  // A persistent grid whose CTAs move one place on each round (PersistentWalk in tile_scheduler_fwd.cuh): without a
  // mask the short last blocks of every head no longer fall to the same CTAs where the blocks per head divide the
  // grid; the 192-row tiles take it (FwdWideTraitsSm90<64>, FwdCapTraitsSm90<128>). Measured (H200, NOTES session
  // 64): capped d128 forward x1.05-1.06 at 512-1024 rows, x1.14 at 256, level at 4096; d64 x1.00-1.035. The
  // two-warpgroup grids measured level (a short 128-row block costs about a whole one) and keep the plain walk.
  static constexpr bool kSkewedRounds = false;
  // Each consumer warpgroup computes only the key tiles its own 64 rows see and takes empty ping-pong turns for
  // the rest of the block's (FwdMainloop::mma's n_mine): with 128-row blocks and 128-key tiles every warpgroup sees
  // every diagonal tile, so the two-warpgroup tiles leave it off; the capped tiles take it (the d64 wide kernel's
  // causal grids have not been measured with it).
  static constexpr bool kWarpgroupKeyRange = false;
  // K/V loads marked evict-first in L2 (l2_policy.cuh): the forward's query blocks read each key tile again; only
  // the TMA decode kernel's stream (DecodeTmaTileTraits) reads a tile once.
  static constexpr bool kKvReadOnce = false;
};

template <>
struct FwdTraitsSm90<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 128;  // S and O accumulators 64 registers each
  static constexpr int kStages = 2;    // Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB
  static constexpr bool kPingPong = true;
  static constexpr bool kSoftmaxUnderPv = false;  // (FwdTraitsSm90<64>)
  static constexpr bool kLazyRescale = false;      // (FwdTraitsSm90<64>)
  static constexpr int kCapExpOnFmaEvery = 0;      // (FwdTraitsSm90<64>)
  static constexpr bool kCapScaledQ = false;       // (FwdTraitsSm90<64>)
  static constexpr bool kStoreOSmem = true;  // + O 32 KB = 192 KB
  static constexpr bool kPersistent = true;  // balanced causal units; equal to a CTA per unit without a mask
  static constexpr bool kWorkCounter = false;  // (FwdTraitsSm90<64>)
  static constexpr bool kSkewedRounds = false;  // (FwdTraitsSm90<64>)
  static constexpr bool kWarpgroupKeyRange = false;  // (FwdTraitsSm90<64>)
  static constexpr bool kKvReadOnce = false;         // (FwdTraitsSm90<64>)
};

// A second tile choice for attention without a causal or window mask (every key tile but the last unmasked), used
// where it measured faster; kAvailable says whether a head dim has one. With a causal or window mask the taller
// tiles waste more of the diagonal's work (short causal sequences were much slower with three warpgroups at head
// dim 64). Causal attention over at least
// kCausalMinRows query rows takes the wide tiles too: there the diagonal tiles are a small share of the work.
template <int kHeadDim_>
struct FwdWideTraitsSm90 : NoFwdTileChoice {};

template <>
struct FwdWideTraitsSm90<64> : FwdTraitsSm90<64> {
  static constexpr bool kAvailable = true;
  // Three consumer warpgroups (192-row tiles, 160 registers each): at head dim 64 a key tile's exponentials cost
  // as much as its two GEMMs, so a third warpgroup's softmax can run while two others' GEMMs are queued.
  static constexpr int kConsumerWarpgroups = 3;
  // 128 keys: S 64 + P 32 + O 32 accumulator registers spill 136 B of the 160 (96 keys: 4 B), yet measured faster
  // than 96-key tiles and than two warpgroups on long and short non-causal sequences (NOTES.md).
  static constexpr int kBlockN = 128;
  static constexpr bool kStoreOSmem = true;  // Q 24 + 3 x (K 16 + V 16) + O 24 KB = 144 KB
  static constexpr bool kSkewedRounds = true;  // (FwdTraitsSm90<64>)
  static constexpr bool kLazyRescale = true;  // (FwdTraitsSm90<64>)
  static constexpr int kCapExpOnFmaEvery = 4;  // (FwdTraitsSm90<64>)
  static constexpr bool kCapScaledQ = true;    // (FwdTraitsSm90<64>)
  // Causal: faster than two warpgroups at 16k rows, a wash at 4k, slower below (above), so from 8192 rows.
  static constexpr int kCausalMinRows = 8192;
};

// A third tile choice, for soft-capped attention without a window mask (kAvailable says which head dims have one):
// FwdCapTraitsSm90 for calls without a causal mask, FwdCapCausalTraitsSm90 for causal calls of at least its
// kCausalMinRows query rows. A capped score costs two MUFU operations (tanh and exp2, 16 a clock an SM each), which at
// head dim 128 take as long as the score's share of its two products on the tensor pipe (4096 FLOP a clock an SM):
// with two warpgroups taking turns, one pipe waits whenever a turn ends early. Three consumer warpgroups keep a third
// softmax or product queued; in their 160 registers S is 64 keys wide. Measured (H200, NOTES session 60): capped
// forward 6-7 % faster without a mask. The plain forward on these tiles: 7-12 % slower (its MUFU stream is half the
// tensor time, and S = Q K^T as m64n64k16 reads both operands at the shared memory's full rate). A fourth stage, the
// softmax under P V (kSoftmaxUnderPv), 80-key tiles and issuing without ping-pong turns each measured level with these
// tiles.
template <int kHeadDim_>
struct FwdCapTraitsSm90 : NoFwdTileChoice {};

template <>
struct FwdCapTraitsSm90<128> : FwdTraitsSm90<128> {
  static constexpr bool kAvailable = true;
  static constexpr int kConsumerWarpgroups = 3;
  static constexpr int kBlockN = 64;  // S 32 + P 16 + O 64 accumulator registers of 160
  static constexpr int kStages = 3;   // Q 48 + 3 x (K 16 + V 16) + O 48 KB = 192 KB
  static constexpr bool kStoreOSmem = true;
  static constexpr bool kSkewedRounds = true;  // (FwdTraitsSm90<64>)
  static constexpr bool kCapScaledQ = true;    // (FwdTraitsSm90<64>)
  // A causal 192-row block's last three 64-key tiles are seen by one, two and three of its warpgroups: each
  // computes only its own (and a warpgroup whose rows all lie past seqlen_q computes none).
  static constexpr bool kWarpgroupKeyRange = true;
  static constexpr int kCausalMinRows = INT_MAX;  // causal calls: FwdCapCausalTraitsSm90
};

// The capped tiles for causal calls, in the order of a CTA per 192-row block (the scheduler's heavy-first order,
// HeavyFirstOrder: groups of a few heads), taken from a work counter by resident CTAs (kWorkCounter): each SM takes
// the next block when its last one's loads are issued, a dynamic balance that keeps a persistent CTA's overlap of the
// next tile's start with this one's end. The persistent grid's heavy-light pairs leave rounds part-idle (4 x 4096 x
// 16: 704 pairs on 132 CTAs, 6 rounds for 5.33), and single blocks walked in a snake across every head lost on K/V
// locality below 8192 rows (NOTES session 61). Capped causal forward, a CTA per block (H200, NOTES session 62)
// against two warpgroups: 4096 rows x1.018 (16 heads) and x1.065 (GQA 32/8), 2048 rows x0.989, 1024 rows x0.944;
// against the snake on the persistent grid: 2 x 8192 x 16 x1.036, 1 x 16384 x1.023, GQA 2 x 8192 x1.005. The work
// counter against a CTA per block (H100, NOTES session 63): 4096 rows x1.018 (16 heads) and x1.021 (GQA 32/8),
// 2 x 8192 x 16 x0.999, 1 x 16384 x0.989 (level: each CTA's prologue weighs less beside longer causal blocks).
// Without a mask the persistent grid stays ahead of a CTA per block (4 x 4096 x 16: x0.984) and of the counter
// (H200, NOTES session 64: x0.95-0.99 wherever the counter balances nothing; the skewed walk, kSkewedRounds, spreads
// the short blocks instead).
template <int kHeadDim_>
struct FwdCapCausalTraitsSm90 : NoFwdTileChoice {};

template <>
struct FwdCapCausalTraitsSm90<128> : FwdCapTraitsSm90<128> {
  static constexpr int kCausalMinRows = 4096;
  static constexpr bool kPersistent = false;
  static constexpr bool kWorkCounter = true;
  static constexpr bool kSkewedRounds = false;
};

template <>
struct FwdTraitsSm90<256> {
  static constexpr int kHeadDim = 256;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 64;   // O accumulator alone is 128 registers; Q 64 KB + 2 x 64 KB of K/V
  static constexpr int kStages = 2;
  static constexpr bool kPingPong = true;
  static constexpr bool kSoftmaxUnderPv = true;  // (FwdTraitsSm90<64>)
  static constexpr bool kLazyRescale = true;     // (FwdTraitsSm90<64>)
  static constexpr int kCapExpOnFmaEvery = 0;    // (FwdTraitsSm90<64>)
  static constexpr bool kCapScaledQ = false;     // (FwdTraitsSm90<64>)
  static constexpr bool kStoreOSmem = false;  // 192 KB in use; another 64 KB for O does not fit: stores from registers
  // A CTA per unit: the persistent loop's extra live registers raised the spills and made it slower.
  static constexpr bool kPersistent = false;
  static constexpr bool kWorkCounter = false;        // (FwdTraitsSm90<64>)
  static constexpr bool kSkewedRounds = false;       // (FwdTraitsSm90<64>)
  static constexpr bool kWarpgroupKeyRange = false;  // (FwdTraitsSm90<64>)
  static constexpr bool kKvReadOnce = false;         // (FwdTraitsSm90<64>)
};

// The TMA decode kernel (flash_decode_tma_sm90.cuh) of head-dim class kD: the forward's tiles (128 packed rows in
// two consumer warpgroups, 128-key K/V tiles), O kept out of shared memory (its epilogue writes from registers), a
// CTA per unit, or for many waves of units a persistent grid taking them from a work counter (DecodeTmaGrid; a
// static share of a ragged batch's units left SMs idle: NOTES, sessions 30 and 69). kPersistent (the forward's
// static walk) stays false.
template <int kD>
struct DecodeTmaTileTraits : FwdTraitsSm90<kD> {
  static_assert(kD <= 128 && FwdTraitsSm90<kD>::kConsumerWarpgroups == 2);
  static constexpr bool kStoreOSmem = false;
  static constexpr bool kPersistent = false;
  static constexpr bool kKvReadOnce = true;  // a unit's tiles are the only reads of its keys' rows
  // The persistent grid (DecodeTmaGrid::kPersistent) publishes each unit it takes in smem.unit; a CTA per unit leaves
  // that ring unused (64 bytes).
  static constexpr bool kWorkCounter = true;
};

template <typename T, typename Base>
struct FwdKernelTraitsSm90 : Base {
  static constexpr int kBlockM = Base::kConsumerWarpgroups * kWgmmaM;
  static constexpr int kThreads = (Base::kConsumerWarpgroups + 1) * kWarpgroupThreads;
  static constexpr int kColBlocks = Base::kHeadDim / kColBlock;  // TMA boxes per tile row
  // setmaxnreg budgets: the producer keeps 24, the consumers share the rest of the 64K registers (multiples of 8,
  // at most 240): 240 with two consumer warpgroups (d128 needs them all), 160 with three.
  static_assert(Base::kConsumerWarpgroups >= 1 && Base::kConsumerWarpgroups <= kMaxConsumerWarpgroups);
  static_assert(!(Base::kPersistent && Base::kWorkCounter), "a grid takes its units one way");
  static_assert(Base::kPersistent || !Base::kSkewedRounds, "only a persistent grid walks rounds");
  static constexpr int kProducerRegs = 24;
  static constexpr int kRegsPerThreadSlot = 64 * 1024 / 128;  // the register file over a warpgroup's threads
  static constexpr int kConsumerRegsFit = (kRegsPerThreadSlot - kProducerRegs) / Base::kConsumerWarpgroups / 8 * 8;
  static constexpr int kConsumerRegs = kConsumerRegsFit < 240 ? kConsumerRegsFit : 240;

  // Every tile starts on a 1024-byte boundary (the 128-byte swizzle repeats every 8 rows).
  struct alignas(1024) SharedStorage {
    alignas(1024) T q[kBlockM * Base::kHeadDim];                    // [kColBlocks][kBlockM][64], swizzled
    alignas(1024) T k[Base::kStages][Base::kBlockN * Base::kHeadDim];  // [stage][kColBlocks][kBlockN][64]
    alignas(1024) T v[Base::kStages][Base::kBlockN * Base::kHeadDim];  // [stage][kColBlocks][kBlockN][64]
    alignas(1024) T o[Base::kStoreOSmem ? kBlockM * Base::kHeadDim : 1];  // [warpgroup][kColBlocks][64][64], swizzled
    PipelineBarriers<1> q_ring;  // released when every S of the tile is done: the next tile's Q may load
    PipelineBarriers<Base::kStages> k_ring;
    PipelineBarriers<Base::kStages> v_ring;
    // kWorkCounter: the producer thread publishes the tile of each unit it takes (m_block -1: none left).
    FwdTile unit[Base::kWorkCounter ? 2 : 1];
    PipelineBarriers<Base::kWorkCounter ? 2 : 1> unit_ring;
  };
  using UnitState = PipelineState<Base::kWorkCounter ? 2 : 1>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the dynamic base
  static_assert(kSmemBytes <= 227 * 1024, "H100's opt-in shared memory per block");
  static constexpr uint32_t kQBytes = kBlockM * Base::kHeadDim * sizeof(T);
  static constexpr uint32_t kKVBytes = Base::kBlockN * Base::kHeadDim * sizeof(T);  // one K (or V) tile
};

// Backward CTA (key/value stationary): one producer warpgroup and two consumer warpgroups of 64 keys each.
// Producer: one thread issues the TMA loads (K, V once per unit of a persistent CTA; a ring of Q/dO tiles with their
// rows' statistics), one warp
// (the dQ writer) adds each consumer warpgroup's dQ tile from shared memory into the float32 accumulator with one
// 1-D bulk reduce-add (DqFragmentOrder).
// Per query tile of kBlockM rows a consumer warpgroup computes S^T and dP^T (64 keys x kBlockM, wgmma from shared
// memory), P^T (under the dP^T GEMM) and dS^T in registers, writes dS^T to shared memory, and issues dV += P^T dO
// (A from registers), dQ = dS K over all 128 keys (its half of the dQ columns with 64 query rows, its 64 rows with
// 128) and dK += dS^T Q; dQ goes to shared memory for the writer while the GEMMs after it run. dQ needs both
// warpgroups' dS^T: with 128 query rows they meet at a barrier every tile; with 64 (kDqLags) dQ is a tile late and
// the warpgroups take turns (flash_bwd_sm90_tma_wgmma_ws.cuh).
template <int kHeadDim_>
struct BwdTraitsSm90;

template <>
struct BwdTraitsSm90<64> {
  static constexpr int kHeadDim = 64;
  // 128 queries per iteration (FA3's choice at this head dim): with 64 the GEMMs of an iteration are small beside its
  // fixed costs (barriers, statistics, the dQ hand-over). S^T and dP^T 64 registers each, dK + dV 64, dQ 32.
  // K 16 + V 16 + 2 x (Q 16 + dO 16) + 2 x dS^T 32 + dQ 2 x 16 + statistics 2 KB = 194 KB
  static constexpr int kBlockM = 128;
  static constexpr int kStages = 2;
  // A capped call takes every k-th 8-column tile's exponentials on the FMA pipe (exp2_fma; 0: none): the score's
  // tanh and exp2 queue two MUFU operations on the path to dS^T. k = 2 measured 4-7 % faster than none (H200, NOTES
  // session 27).
  static constexpr int kCapExpOnFmaEvery = 2;
};

template <>
struct BwdTraitsSm90<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kBlockM = 64;  // S^T/dP^T 32 registers each; dK + dV accumulators 128; dQ 32
  // K 32 + V 32 + 3 x (Q 16 + dO 16) + 2 x dS^T 16 + dQ 32 + stats 1.5 KB = 225.5 KB (227 KB with the barriers and
  // the alignment slack: all of it): the third stage lets a warpgroup run ahead of the other (the lagging dQ)
  // without waiting for the next tile's load.
  static constexpr int kStages = 3;
  // Capped: every 4th tile's exponentials on the FMA pipe (MUFU takes three of four): 0.8-0.9 % faster than every
  // 2nd at d128 (H200, 5 rounds; every tile on MUFU: 2-3 % slower; NOTES session 67).
  static constexpr int kCapExpOnFmaEvery = 4;
};

template <typename T, typename Base>
struct BwdKernelTraitsSm90 : Base {
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = kConsumerWarpgroups * kWgmmaM;  // keys per CTA
  static constexpr int kThreads = (kConsumerWarpgroups + 1) * kWarpgroupThreads;
  static constexpr int kColBlocks = Base::kHeadDim / kColBlock;
  // dQ of the query tile, split between the consumer warpgroups: with 64 queries each takes half the columns; with
  // two wgmma M of queries each takes its 64 rows and every column.
  static constexpr bool kDqSplitRows = Base::kBlockM > kWgmmaM;
  static constexpr int kDqRows = kDqSplitRows ? kWgmmaM : Base::kBlockM;  // dQ rows per consumer warpgroup
  static constexpr int kDqCols = kDqSplitRows ? Base::kHeadDim : Base::kHeadDim / kConsumerWarpgroups;
  // With 64 queries a tile, a warpgroup's dQ needs the other warpgroup's dS^T: it is computed one query tile late
  // and the warpgroups take turns instead of meeting every tile (kDqLags; flash_bwd_sm90_tma_wgmma_ws.cuh).
  static constexpr bool kDqLags = !kDqSplitRows;
  // setmaxnreg budgets: 2 x 128 x 240 + 128 x 24 <= 64K registers.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(Base::kBlockM % kColBlock == 0, "dS^T rows are whole 128-byte swizzled rows of 64 queries");
  static_assert(!kDqSplitRows || Base::kBlockM == kConsumerWarpgroups * kWgmmaM, "one wgmma M of dQ rows each");

  struct alignas(1024) SharedStorage {
    alignas(1024) T k[kBlockN * Base::kHeadDim];                          // [kColBlocks][kBlockN][64]
    alignas(1024) T v[kBlockN * Base::kHeadDim];                          // [kColBlocks][kBlockN][64]
    alignas(1024) T q[Base::kStages][Base::kBlockM * Base::kHeadDim];     // [stage][kColBlocks][kBlockM][64]
    alignas(1024) T dout[Base::kStages][Base::kBlockM * Base::kHeadDim];  // [stage][kColBlocks][kBlockM][64]
    alignas(1024) T ds[2][kBlockN * Base::kBlockM];  // [parity][kQueryColBlocks][key][64], swizzled
    alignas(1024) float dq[kConsumerWarpgroups][kDqRows * kDqCols];  // [wg][...]: DqFragmentOrder
    // [stage]: lse * log2(e) of the tile's rows, then their dsum (bulk copies from FlashParams::row_stats).
    alignas(16) float stats[Base::kStages][2 * Base::kBlockM];
    PipelineBarriers<1> k_ring;                // the unit's K (empty: the consumers' last dQ of it is done)
    PipelineBarriers<1> v_ring;                // the unit's V (empty: the consumers' last dP^T is done)
    PipelineBarriers<Base::kStages> qdo_ring;  // Q and dO tiles of one query tile and their row statistics
    PipelineBarriers<2> unit_ring;             // the producer's next unit (tile_scheduler_bwd.cuh) for every role
    BwdUnitSlot unit[2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "H100's opt-in shared memory per block");
  static_assert(kRowStatsAlign % Base::kBlockM == 0, "a query tile's row statistics lie inside the padded rows");
  static constexpr uint32_t kStatsBytes = Base::kBlockM * sizeof(float);  // one statistic of a tile's rows
  // Q and dO tiles and both statistics of their rows.
  static constexpr uint32_t kQdOBytes = 2 * Base::kBlockM * Base::kHeadDim * sizeof(T) + 2 * kStatsBytes;
  static constexpr uint32_t kDqWgBytes = kDqRows * kDqCols * sizeof(float);  // a consumer warpgroup's dQ tile
  // The dK/dV epilogue stages a consumer warpgroup's 64 keys in TMA boxes of 64 columns: dK in dS^T buffer
  // [warpgroup], dV in its dQ buffer (both free after the unit's last products), leaving K and V to the next unit.
  static constexpr uint32_t kKvGradWgBytes = kWgmmaM * Base::kHeadDim * sizeof(T);
  static_assert(kKvGradWgBytes <= sizeof(T) * kBlockN * Base::kBlockM && kKvGradWgBytes <= kDqWgBytes,
                "a warpgroup's dK fits a dS^T buffer and its dV its dQ buffer");
};

// The order of a query tile's dQ in dq_accum (and in shared memory) for the BwdKernelTraitsSm90 kernel: as the
// consumer warpgroups' wgmma accumulators hold it, float4 slots [warpgroup][8-column tile j][thread], so that each
// thread stages its accumulator with 16-byte stores and each warpgroup's part is one contiguous bulk reduction.
// Slot (wg, j, thread) holds the thread's accumulator elements 4 j .. 4 j + 3: rows 16 warp + g and + 8, columns
// 8 j + 2 t and + 1 of its warpgroup's part (lane = 4 g + t); pairs() is the map the conversion kernel
// (bwd_pre_post.cuh) reads it back with.
template <typename Traits>
struct DqFragmentOrder {
  static constexpr int kTileRows = Traits::kBlockM;
  static constexpr bool kScalarElems = false;
  static constexpr int kTiles = Traits::kDqCols / 8;  // 8-column tiles of a warpgroup's part
  JF_HD static void pairs(int slot, int (&row)[2], int (&col)[2]) {
    const int thread = slot % kWarpgroupThreads;
    const int j = slot / kWarpgroupThreads % kTiles;
    const int wg = slot / (kWarpgroupThreads * kTiles);
    const int lane = thread % 32;
    const int r = thread / 32 * 16 + lane / 4 + (Traits::kDqSplitRows ? wg * Traits::kDqRows : 0);
    row[0] = r;
    row[1] = r + 8;
    col[0] = col[1] = 8 * j + 2 * (lane % 4) + (Traits::kDqSplitRows ? 0 : wg * Traits::kDqCols);
  }
};

// Backward CTA at head dim 256 after FlashAttention-3 (docs/d256_bwd_plan.md; flash_bwd_sm90_d256.cuh): 64
// queries x 80 keys, one producer warpgroup (one TMA thread) and two consumer warpgroups; no cluster. Per query tile
// a consumer warpgroup cw computes S = Q K^T and dP = dO V^T for the queries x its 40 keys (wgmma N = 40, both
// operands from shared memory), P and dS in registers, stores P^T and dS^T ([key][64 queries], stmatrix .trans)
// into the tile's buffers, and after one barrier between the warpgroups computes dV^T += dO^T P, dK^T += Q^T dS and
// dQ^T = K^T dS^T for its head-dim rows [128 cw, +128) in two m64 slices (all operands from shared memory), adding
// dQ^T from registers into dq_accum (DqTransposedFragmentOrder). dK^T, dV^T: 2 x 40 floats each per thread, dQ^T 32
// at a time: 192 live at the dQ^T GEMM.
struct BwdD256TraitsSm90 {
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockM = 64;              // queries per tile
  static constexpr int kBlockN = 80;              // keys per CTA
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kWgKeys = kBlockN / kConsumerWarpgroups;  // S / dP columns of a warpgroup (wgmma N)
  static constexpr int kWgCols = kHeadDim / kConsumerWarpgroups;  // dK^T / dV^T / dQ^T rows of a warpgroup
  static constexpr int kSlices = kWgCols / kWgmmaM;               // m64 slices of those rows
  static constexpr int kQStages = 2;
  static constexpr int kDoStages = 1;
  static constexpr int kThreads = (kConsumerWarpgroups + 1) * kWarpgroupThreads;
  static constexpr int kColBlocks = kHeadDim / kColBlock;
  static constexpr int kProducerRegs = 24;  // 2 x 128 x 240 + 128 x 24 <= 64K registers
  static constexpr int kConsumerRegs = 240;
  static_assert(kWgKeys % 8 == 0, "a warpgroup's K/V rows start on a 1024-byte swizzle atom (8 rows)");
  static_assert(kBlockM == kColBlock, "P^T / dS^T rows are one 128-byte swizzled row of 64 queries");
  static_assert(kSlices == 2, "two m64 slices of head-dim rows per warpgroup");

  template <typename T>
  struct alignas(1024) SharedStorage {
    alignas(1024) T k[kColBlocks * kBlockN * kColBlock];                 // [kColBlocks][80 keys][64]
    alignas(1024) T v[kColBlocks * kBlockN * kColBlock];                 // [kColBlocks][80 keys][64]
    alignas(1024) T q[kQStages][kColBlocks * kBlockM * kColBlock];       // [stage][kColBlocks][64 queries][64]
    alignas(1024) T dout[kDoStages][kColBlocks * kBlockM * kColBlock];   // [stage][kColBlocks][64 queries][64]
    alignas(1024) T pt[2][kBlockN * kBlockM];                            // P^T [parity][80 keys][64 queries]
    alignas(1024) T dst[2][kBlockN * kBlockM];                           // dS^T [parity][80 keys][64 queries]
    // [Q stage]: lse * log2(e) of the tile's rows, then their dsum (bulk copies on the Q stage's barrier).
    alignas(16) float stats[kQStages][2 * kBlockM];
    PipelineBarriers<1> kv_ring;          // the unit's K and V
    PipelineBarriers<kQStages> q_ring;    // Q tiles and their rows' statistics
    PipelineBarriers<kDoStages> do_ring;  // dO tiles
  };
  template <typename T>
  static constexpr int kSmemBytes = int(sizeof(SharedStorage<T>)) + 1024;  // + slack to align the dynamic base
  static_assert(kSmemBytes<uint16_t> <= 227 * 1024, "H100's opt-in shared memory per block");
  static constexpr uint32_t kStatsBytes = kBlockM * sizeof(float);  // one statistic of a tile's rows
  static_assert(kRowStatsAlign % kBlockM == 0, "a query tile's row statistics lie inside the padded rows");
};

// The order of a query tile's dQ in dq_accum for the FA3-style d256 backward (docs/d256_bwd_plan.md, section 4): each
// consumer warpgroup cw computes dQ^T, head-dim rows [128 cw, +128) in two m64 slices h, queries as columns, and adds
// it from registers with red.global.add.v4.f32 (atomic_add_f32x4) in float4 slots [cw 2][s = 8 h + j: 16][thread 128]
// of the tile's 64 x 256 floats, so a warp's add covers 512 contiguous bytes. Slot (cw, s, thread) holds the thread's
// accumulator floats 4 j .. 4 j + 3 of slice h: with lane = 4 g + t of warp w, d = 128 cw + 64 h + 16 w + g and q = 8
// j + 2 t, the (query, d) elements (q, d), (q + 1, d), (q, d + 8), (q + 1, d + 8). elems() is the map a conversion
// reads it back with.
struct DqTransposedFragmentOrder {
  static constexpr int kTileRows = 64;  // queries
  static constexpr bool kScalarElems = true;
  static constexpr int kCols = 256;     // head dim
  static constexpr int kSlots = kTileRows * kCols / 4;
  JF_HD static int slot(int cw, int h, int j, int thread) { return (16 * cw + 8 * h + j) * kWarpgroupThreads + thread; }
  JF_HD static void elems(int slot, int (&row)[4], int (&col)[4]) {
    const int thread = slot % kWarpgroupThreads, s = slot / kWarpgroupThreads % 16;
    const int cw = slot / (16 * kWarpgroupThreads);
    const int lane = thread % 32, w = thread / 32, h = s / 8, j = s % 8;
    const int d = 128 * cw + 64 * h + 16 * w + lane / 4, q = 8 * j + 2 * (lane % 4);
    row[0] = q, col[0] = d;
    row[1] = q + 1, col[1] = d;
    row[2] = q, col[2] = d + 8;
    row[3] = q + 1, col[3] = d + 8;
  }
};

}  // namespace jax_flash::cuda::sm90
