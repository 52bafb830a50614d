"""cuda/kernels/tile_scheduler_{common,fwd,bwd}.cuh, the sm_90a kernels' work order: C++ checks on small shapes,
built with the system C++ compiler; skipped without one. Heavy-first order: every (block, head) once, heads in
contiguous groups (the last whole), no unit lighter than a later one of its group. Forward: every tile exactly once,
pairs heaviest first, a CTA per unit under a causal mask in heavy-first order, unit counts above INT_MAX refused.
Backward: every (key block, kv head, batch) once in heavy-first order, clusters of neighbouring key blocks, each
(batch, kv head)'s key blocks in increasing order, grids above INT_MAX refused."""


def test_scheduler_visits_every_tile_once(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")


def test_heavy_first_order_and_backward_grid(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_bwd_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
