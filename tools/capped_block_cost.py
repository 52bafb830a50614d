"""Cost of a short query block of the capped d128 forward's three-warpgroup tiles (192-row blocks), against a full
one: the input `tools/schedule_model.py rows --split-tail C` needs (NOTES session 63, issue 18 Next 1).

Every call has one query block per query head (Sq = the block's rows), --rounds x the SM count query heads over one
kv head (GQA: K and V stay in L2, so the blocks are compute-bound as in a long sequence), --keys keys, a soft cap and
no mask: the kernel runs whole rounds of equal blocks, and a block's time is the call's time over the rounds. Prints
each height's time per block and its ratio to the 192-row block's.

    python tools/capped_block_cost.py --rows 64,128,192 --keys 4096
"""

import argparse

import jax
import jax.numpy as jnp

import jax_flash
from bench_segment_ops import _time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128,192", help="query rows per block (comma-separated); 192 is the reference")
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4, help="blocks per SM")
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sms", type=int, default=None, help="SM count (default: the GPU's)")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if 192 not in rows:
        ap.error("--rows must include 192 (the full block the others are compared with)")
    sms = a.sms or getattr(jax.devices()[0], "core_count", None)
    if not sms:
        ap.error("no SM count: run on a GPU or pass --sms")
    heads = a.rounds * sms
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    k, v = (jax.random.normal(key, (1, a.keys, 1, 128), jnp.bfloat16) for key in keys[1:])
    f = jax.jit(lambda q, k, v: jax_flash.dot_product_attention(q, k, v, logits_soft_cap=a.softcap))
    per_block = {}
    for r in rows:
        q = jax.random.normal(keys[0], (1, r, heads, 128), jnp.bfloat16)
        per_block[r] = _time(f, q, k, v, reps=a.reps, samples=a.samples) / a.rounds
    print(f"{jax.devices()[0].device_kind}, {sms} SMs, {heads} query heads / 1 kv head, {a.keys} keys, "
          f"soft cap {a.softcap}")
    print(f"{'rows':>6} {'us per block':>13} {'/ 192 rows':>11}")
    for r in rows:
        print(f"{r:>6} {1e6 * per_block[r]:>13.2f} {per_block[r] / per_block[192]:>11.3f}")


if __name__ == "__main__":
    main()
