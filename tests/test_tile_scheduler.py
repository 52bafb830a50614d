"""cuda/kernels/tile_scheduler_fwd.cuh, the sm_90a forward's tile order: a C++ check on small shapes (every tile
exactly once, pairs heaviest first, unit counts above INT_MAX refused), built with the system C++ compiler;
skipped without one."""


def test_scheduler_visits_every_tile_once(run_cpp_check):
    returncode, stdout = run_cpp_check("tile_scheduler_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
