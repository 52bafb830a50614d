"""cuda/kernels/sm90/tile_scheduler_fwd.cuh, the sm_90a forward's work order: a C++ check on small shapes, built with the
system C++ compiler; skipped without one. Heavy-first order: every (block, head) once, heads in contiguous groups
(the last whole), no unit lighter than a later one of its group. Scheduler: every tile exactly once, pairs heaviest
first, a CTA per unit under a causal mask (no window, enough blocks per head) in heavy-first order and otherwise head
after head, unit counts above INT_MAX refused. The backward's (tile_scheduler_bwd.cuh): every (key block, kv head,
batch) once, key block fastest, unit counts above INT_MAX / 2 refused."""


def test_scheduler_visits_every_tile_once(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
