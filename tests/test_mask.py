"""cuda/mask.h, the mask policies every kernel shares: an exhaustive C++ check on small shapes (built with the
system C++ compiler; skipped without one)."""


def test_mask_ranges_agree_with_visible(run_cpp_check):
    returncode, stdout = run_cpp_check("mask_check")
    assert returncode == 0, stdout
    assert stdout.startswith("ok ")
