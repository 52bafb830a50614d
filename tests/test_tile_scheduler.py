"""cuda/kernels/tile_scheduler_{fwd,bwd}.cuh, the sm_90a kernels' work order: C++ checks on small shapes, built with
the system C++ compiler; skipped without one. Forward: every tile exactly once, pairs heaviest first, unit counts
above INT_MAX refused. Backward: every (key block, kv head, batch) exactly once, key blocks never decreasing with
the CTA index (heaviest first under a causal mask), clusters of neighbouring key blocks, grids above INT_MAX
refused."""


def test_scheduler_visits_every_tile_once(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")


def test_backward_grid_covers_every_key_block_once_in_order(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_bwd_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
