"""jax_flash under sharding (issue 17 item 1), on CPU with 8 fake devices: mesh (2, 4) ("dp", "tp") of Auto axes
(custom_partitioning) and of Explicit axes (shard_map); q sharded over batch, heads, both, sequence, or
replicated; 8 query heads over 8, 4 and 1 kv heads; causal, windows, lengths (0 and 1 included). Forward and
gradients against the unsharded call; the compiled HLO's collectives; the output keeps q's sharding.

JAX fixes its device count when it starts, and this process has one CPU device: the cases run in a subprocess
(tests/sharding_check.py) with ``--xla_force_host_platform_device_count=8``, one per axis type. Where two GPUs are
present the same cases run on them in bfloat16 (meshes 1x2 and 2x1), against the float64 reference."""

import json
import math
import os
import re
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import sharding

CHECK = pathlib.Path(__file__).with_name("sharding_check.py")

# spec:Hq:Hkv:mask[:vmap|:remat|:shardmap|:nomesh] (shardmap: the call inside the user's jax.shard_map over the
# mesh; nomesh: sharded arrays without jax.set_mesh)
CASES = [
    "dp:8:8:causal", "dp:8:4:lens", "dp:8:1:window",
    "tp:8:8:window", "tp:8:4:causal_window_lens", "tp:8:1:causal",
    "dp_tp:8:8:lens", "dp_tp:8:4:causal", "dp_tp:8:1:causal_window_lens",
    "repl:8:4:causal_window_lens",
    "sp:8:8:causal", "sp:8:4:causal_window_lens", "dp_sp:8:1:window",
    "dp_tp:8:4:causal:vmap", "dp:8:8:causal_window_lens:remat", "sp:8:4:causal:vmap", "sp:8:8:lens:remat",
    "tp:8:4:causal_window_lens:shardmap", "tp:8:1:window:shardmap",
    "dp_tp:8:4:causal:nomesh", "sp:8:4:causal_window_lens:nomesh", "hd:8:4:causal",
    "dp_tp:8:4:options", "sp:8:4:options", "dp:8:8:options:vmap",
]
FWD_TOL, GRAD_TOL = 2e-5, 1e-4  # float32 on CPU: against the unsharded call
# The same cases on 2 GPUs in bfloat16, meshes ("dp", "tp") of 1x2 (heads, sequence, head_dim sharded) and 2x1
# (batch sharded): the sharded call's error against the float64 reference at most BF16_FACTOR x the unsharded
# call's plus BF16_FLOOR (relative to the reference's largest magnitude).
GPU_MESHES = {"1x2": CASES, "2x1": [c for c in CASES if c.split(":")[0] in ("dp", "dp_tp", "repl")]}
BF16_FACTOR, BF16_FLOOR = 2.0, 2.0**-9
# A head axis that does not divide the kv heads: an error naming the sizes (by the size of "tp").
ERROR_CASES = {4: {"tp:8:2:none": "does not divide the 2 key/value heads"},
               2: {"tp:6:3:none": "does not divide the 3 key/value heads"}, 1: {}}
RUNS = [("Auto", "cpu"), ("Explicit", "cpu")] + [(t, f"gpu-{m}") for m in GPU_MESHES for t in ("Auto", "Explicit")]


def _gpu_count():
    return sum(d.platform == "gpu" for d in jax.devices())


def _run(axis_type, platform):
    """{case: result} of sharding_check.py's cases on 8 fake CPU devices (mesh 2x4, float32) or on 2 GPUs."""
    if platform == "cpu":
        mesh, cases = "2x4", CASES
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    else:
        if _gpu_count() < 2:
            pytest.skip("needs 2 GPUs")
        mesh = platform.split("-")[1]
        cases = GPU_MESHES[mesh]
        env = dict(os.environ, JAX_FLASH_CHECK_DTYPE="bfloat16", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["JAX_FLASH_CHECK_MESH"] = mesh
    errors = ERROR_CASES[int(mesh.split("x")[1])]
    cases = [f"{axis_type}:{c}" for c in [*cases, *errors]]
    proc = subprocess.run([sys.executable, "-P", str(CHECK), *cases], env=env, capture_output=True, text=True,
                          timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == cases, proc.stderr[-5000:]
    sizes = dict(zip(("dp", "tp"), (int(n) for n in mesh.split("x"))))
    return dict(platform=platform, errors=errors, sizes=sizes,
                cases={r["case"].split(":", 1)[1]: r for r in results})


@pytest.fixture(scope="module", params=RUNS, ids=[f"{t}-{p}" for t, p in RUNS])
def results(request):
    return _run(*request.param)


def _spec(text, sizes):
    """"P('dp', None, 'tp', None)" -> ("dp", None, "tp"): mesh axes of size 1 (in `sizes`) and trailing Nones dropped
    (they shard nothing: jax may print a spec with or without them)."""
    entries = []
    for e in re.findall(r"\(.*?\)|[^,\s()]+", text[2:-1]):
        axes = [a for a in re.findall(r"'(\w+)'", e) if sizes.get(a, 1) > 1]
        entries.append(tuple(axes) if len(axes) > 1 else axes[0] if axes else None)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _elements(shapes):
    """The element count of the largest array shape in HLO type text such as '(bf16[4,32,8,32]{...}, ...)'."""
    return max(math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", shapes))


@pytest.mark.parametrize("case", CASES)
def test_values_and_collectives(results, case):
    if case not in results["cases"]:
        pytest.skip(f"not run on {results['platform']}")
    r = results["cases"][case]
    assert r["ok"], r.get("trace", r.get("error"))
    if results["platform"] == "cpu":
        assert r["fwd_err"] <= FWD_TOL, r
        assert r["grad_err"] <= GRAD_TOL, r
    else:
        assert r["fwd_ref_err"] <= BF16_FACTOR * r["base_fwd_ref_err"] + BF16_FLOOR, r
        assert r["grad_ref_err"] <= BF16_FACTOR * r["base_grad_ref_err"] + BF16_FLOOR, r
    sizes = results["sizes"]
    assert _spec(r["out_spec"], sizes) == _spec(r["want_spec"], sizes), r  # the output keeps q's sharding
    spec, hq, hkv, *_ = case.split(":")
    allowed_grad = set()
    if spec == "hd":  # head_dim sharded: gathered for the kernel (q, k, v; in the gradient also o and do)
        assert set(r["fwd_collectives"]) <= {"all-gather"} and set(r["grad_collectives"]) <= {"all-gather"}, r
        return
    if "sp" in spec:  # sequence: K and V all-gathered (whole sequences), dK and dV summed over it (or scattered)
        assert set(r["fwd_collectives"]) == {"all-gather"}, r
        assert r["fwd_collectives"]["all-gather"] <= 2, r
        assert r["fwd_gathered"], r
        batch = 4 // results["sizes"]["dp"] if spec.startswith("dp") else 4
        for shape in r["fwd_gathered"]:  # K or V: the whole sequence of the local batch's kv heads
            assert _elements(shape) == batch * 64 * int(hkv) * 32, r
        allowed_grad = {"all-gather", "all-reduce", "reduce-scatter"}  # XLA may turn psum + slice into one
    else:  # batch and heads: no collective at all ...
        assert r["fwd_collectives"] == {}, r
        if "tp" in spec and hkv == "1":  # ... but one kv head's dK/dV sums its query heads' shares over "tp"
            allowed_grad = {"all-reduce"}
    assert set(r["grad_collectives"]) <= allowed_grad, r


def test_indivisible_kv_heads(results):
    if not results["errors"]:
        pytest.skip("the head axis has size 1")
    for case, message in results["errors"].items():
        r = results["cases"][case]
        assert not r["ok"], r
        assert message in r["error"], r["error"]


def _run_cpu_cases(cases):
    """{case: result} of sharding_check.py's `cases` on 8 fake CPU devices (mesh 2x4), each of which must have run."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               JAX_FLASH_CHECK_MESH="2x4")
    proc = subprocess.run([sys.executable, "-P", str(CHECK), *cases], env=env, capture_output=True, text=True,
                          timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert list(results) == cases, proc.stderr[-5000:]
    for case, r in results.items():
        assert r["ok"], (case, r.get("trace"))
    return results


def test_sinks_gradient_is_typed_as_the_sinks():
    """With query heads (or the batch) sharded and the sinks an array replicated on the mesh, or inside the user's
    jax.shard_map (sinks replicated there), the gradient with respect to q and the sinks equals the unsharded call's
    and on Explicit axes the sinks' cotangent comes back replicated (a head-sharded one is refused by JAX's
    custom_vjp there, a varying one by shard_map's type check): tests/sharding_check.py's sinks cases on 8 fake CPU
    devices."""
    cases = [f"sinks:{c}" for c in ("Auto:tp:mesh", "Explicit:tp:mesh", "Explicit:dp_tp:mesh", "Auto:dp:shardmap",
                                    "Explicit:dp:shardmap")]
    results = _run_cpu_cases(cases)
    for case, r in results.items():
        assert r["dq_err"] <= GRAD_TOL and r["dsinks_err"] <= GRAD_TOL, (case, r)
        if "Explicit" in case:  # (on Auto axes XLA picks the cotangent's sharding)
            assert _spec(r["dsinks_spec"], {"dp": 2, "tp": 4}) == (), (case, r)


def test_mesh_mixing_explicit_and_auto_axes_gathers_the_auto_ones_with_a_warning():
    """A mesh of an Explicit "dp" and an Auto "tp" axis (JAX's custom_partitioning fails on it): q, k and v sharded
    over either, both or none give the unsharded call's values and gradients, and the process warns once that the
    Auto axes are not partitioned: tests/sharding_check.py's mixed cases on 8 fake CPU devices."""
    cases = [f"mixed:{c}" for c in ("tp", "dp_tp", "dp", "repl")]
    results = _run_cpu_cases(cases)
    for case, r in results.items():
        assert r["out_err"] <= FWD_TOL and r["grad_err"] <= GRAD_TOL, (case, r)
    assert sum(r["warned"] for r in results.values()) == 1, results


def test_single_device_path_unchanged():
    """One device in the process: the kernel is called directly (no shard_map, no custom_partitioning)."""
    assert jax.device_count() == 1
    q = jax.numpy.ones((2, 16, 4, 32), jax.numpy.float32)
    text = str(jax.make_jaxpr(jax_flash.dot_product_attention)(q, q, q))
    assert "custom_partitioning" not in text and "shard_map" not in text and "custom_vmap" not in text
    assert sharding._path(q, q, q)[0] == "local"


@pytest.mark.parametrize("mask", [dict(is_causal=True), dict(window=(5, 3)), dict(is_causal=True, window=(9, 0))])
def test_xla_fallback_with_offsets(mask):
    """The platforms without a kernel run a query part at its global rows through jax.nn with a dense mask: equal
    to the CPU kernel's part, forward and backward (rows that see no key: 0, as the kernel)."""
    import dataclasses

    import numpy as np

    from jax_flash import attention

    rng = np.random.default_rng(1)
    b, t, s, hq, hkv, d = 2, 16, 48, 4, 2, 32
    q, do = (jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32) for _ in range(2))
    q_lens, kv_lens = jnp.array([40, 20], jnp.int32), jnp.array([48, 25], jnp.int32)
    q_off = jnp.array([16, 32], jnp.int32)
    window = mask.get("window")
    kernel_cfg = attention._Config(scale=0.2, is_causal=mask.get("is_causal", False), window=window,
                                   kernel_platforms=("cpu",))
    xla_cfg = dataclasses.replace(kernel_cfg, kernel_platforms=())
    o1, lse1 = attention._local_forward(kernel_cfg, q, k, v, q_lens, kv_lens, q_offsets=q_off)
    o2, lse2 = attention._local_forward(xla_cfg, q, k, v, q_lens, kv_lens, q_offsets=q_off)
    np.testing.assert_allclose(o2, o1, atol=2e-5)
    finite = np.isfinite(np.asarray(lse1))
    np.testing.assert_array_equal(finite, np.isfinite(np.asarray(lse2)))
    np.testing.assert_allclose(np.asarray(lse2)[finite], np.asarray(lse1)[finite], atol=2e-5)
    g1 = attention._local_backward(kernel_cfg, q, k, v, o1, lse1, do, q_lens, kv_lens, q_offsets=q_off)
    g2 = attention._local_backward(xla_cfg, q, k, v, o2, lse2, do, q_lens, kv_lens, q_offsets=q_off)
    for a, c in zip(g2, g1):
        np.testing.assert_allclose(a, c, atol=1e-4)
