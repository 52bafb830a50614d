"""cuda/kernels/sm90/smem_layout.h, the sm_90a kernels' shared-memory layout arithmetic: a C++ check against an
independent model of the hardware's layouts (PTX ISA, TMA and CUTLASS documentation), built with the system C++
compiler; skipped without one. Swizzle: swizzled_chunk_offset is TMA's SWIZZLE_128B placement and a bijection onto the
tile's 16-byte chunks. stmatrix: the lane addresses of stmatrix_x4_lane_offset / stmatrix_x4_pair_offset, composed as
the forward's O epilogue and the backward's dS^T stores compose them at 1024-byte-aligned bases, put every element of
a warp's accumulator piece at its (row, column) of the logical tile (and do not at unaligned bases). Descriptors:
make_desc_sw128 decodes to the start address, leading offset, stride 1024, base offset 0 and 128-byte swizzle for
every shared address below 227 KB; desc_advance by the kernels' offsets equals the advanced address; the elements
wgmma reads through them (K-major and MN-major canonical layouts) are the ones TMA wrote, for every tile of the sm_90a
traits. dQ order: DqFragmentOrder (the backward's dQ staging and dq_accum order, read back by the conversion kernel)
maps every staged float4 to the accumulator elements it holds, covering the tile once. Mutated copies of each
function, run through the same checks, must each fail."""


def test_smem_layout_matches_hardware_model(run_cpp_check):
    returncode, stdout = run_cpp_check("smem_layout_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
