"""Context-parallel ring attention (jax_flash.ring_attention) on 8 fake CPU devices, mesh dp=2 x cp=4: contiguous
and zigzag layouts x full / causal / window / causal+window / padded lengths (including 0 and 1), forward and
gradients of q, k, v against the unsharded jax_flash.dot_product_attention; heads sharded on the other axis against
the float64 reference; the compiled ring holds only collective-permutes of single kv-head blocks; errors.

JAX fixes its device count when it starts and this process already runs with one CPU device, so the checks run once
in a subprocess (tests/ring_check.py, with XLA_FLAGS=--xla_force_host_platform_device_count=8) and each test reports
its case. Where two GPUs are present the same checks run on them in bfloat16 (dp=1 x cp=2, against the float64
reference), and the scheduled HLO must show every K/V transfer overlapping a kernel (collective-permute start and
done with a jax_flash kernel between them).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

SCRIPT = pathlib.Path(__file__).with_name("ring_check.py")

LAYOUTS = ("contiguous", "zigzag")
MASKS = ("full", "causal", "window", "causal_window", "padded", "padded_full")


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def ring_results(request):
    env = dict(os.environ)
    if request.param == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        env["JAX_PLATFORMS"] = "cpu"
    else:  # the same checks on two GPUs in bfloat16: dp=1 x cp=2
        if sum(d.platform == "gpu" for d in jax.devices()) < 2:
            pytest.skip("needs 2 GPUs")
        env.update(JAX_FLASH_CHECK_MESH="1x2", JAX_FLASH_CHECK_DTYPE="bfloat16", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-P", str(SCRIPT)], capture_output=True, text=True, env=env,
                          cwd=str(SCRIPT.parent.parent.parent), timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"ring_check.py failed (rc {proc.returncode}):\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


def _check(results, name):
    assert name in results, f"ring_check.py ran no case {name!r}"
    if results[name].startswith("skip: "):
        pytest.skip(results[name][6:])
    assert results[name] == "ok", results[name]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_matches_unsharded_forward_and_gradients(ring_results, layout, mask):
    _check(ring_results, f"{layout}-{mask}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_with_segment_ids_sinks_and_soft_cap(ring_results, layout):
    _check(ring_results, f"options-{layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_hlo_holds_only_collective_permutes_of_kv_blocks(ring_results, layout):
    _check(ring_results, f"hlo-{layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_kv_transfer_overlaps_kernel(ring_results, layout):
    _check(ring_results, f"overlap-{layout}")


def test_ring_with_heads_sharded_on_another_axis(ring_results):
    _check(ring_results, "head_sharded")


def test_ring_sharded_places_its_inputs(ring_results):
    _check(ring_results, "unplaced_inputs")


def test_ring_errors(ring_results):
    _check(ring_results, "errors")


def test_zigzag_helpers_multi_device(ring_results):
    _check(ring_results, "zigzag_helpers")


def test_zigzag_order_and_restore():
    x = jnp.arange(3 * 24 * 2).reshape(3, 24, 2)
    z = jax_flash.zigzag_order(x, 3)
    # 6 chunks of 4: order 0, 5, 1, 4, 2, 3.
    first = np.asarray(z[0, ::4, 0]) // 8
    assert first.tolist() == [0, 5, 1, 4, 2, 3]
    np.testing.assert_array_equal(jax_flash.zigzag_restore(z, 3), x)
    np.testing.assert_array_equal(jax_flash.zigzag_order(x, 1), x)
    with pytest.raises(ValueError, match="divisible by 2 \\* n = 10"):
        jax_flash.zigzag_order(x, 5)
    with pytest.raises(ValueError, match="positive int"):
        jax_flash.zigzag_order(x, 0)


def test_ring_attention_outside_shard_map_is_refused():
    q = jnp.zeros((1, 8, 2, 32))
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        jax_flash.ring_attention(q, q, q, axis_name="cp")
    with pytest.raises(ValueError, match="layout must be one of"):
        jax_flash.ring_attention(q, q, q, axis_name="cp", layout="ring")
