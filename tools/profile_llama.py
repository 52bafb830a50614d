"""One LLaMA-block train step (examples/llama_block.py's bench step: one llama3-8b block, forward and backward to
the gradients of the parameters and the input, under jax.jit) for Nsight Compute: every kernel of the step through
tools/kernel_list.sh, to see where two attentions' block steps differ beside the attention kernels. --impl picks
the attention (jax_flash, cudnn, xla, fa3_jax, tokamax). Runs the step --runs times after compiling it.

    SCRIPT=tools/profile_llama.py bash tools/kernel_list.sh "jax_flash fa3_jax" --batch 2 --seq 4096
"""

import argparse
import os
import runpy
import types

import jax
import jax.numpy as jnp


def _example():
    """examples/llama_block.py's functions (its block, input and train step)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return types.SimpleNamespace(**runpy.run_path(os.path.join(here, "..", "examples", "llama_block.py")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="jax_flash", choices=("jax_flash", "cudnn", "xla", "fa3_jax", "tokamax"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--runs", type=int, default=2, help="runs after the compile")
    a = ap.parse_args()
    ex = _example()
    cfg = ex.CONFIGS[a.config]
    block = ex.make_block(cfg, jnp.bfloat16, 0)
    x = ex.block_input(cfg, a.batch, a.seq, jnp.bfloat16, 1)
    step, params = ex.block_step(block, a.impl)
    jax.block_until_ready(step(params, x))
    for _ in range(a.runs):
        jax.block_until_ready(step(params, x))


if __name__ == "__main__":
    main()
