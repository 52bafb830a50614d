"""nan and inf in query, key or value on CPU: they propagate through jax_flash as through jax.nn's xla path.

A row with a nan or +inf visible logit outputs nan, a -inf logit weighs 0, a non-finite value makes the rows that
see it non-finite in that column, and gradients follow; without a mask jax_flash and jax.nn agree entry for entry.
With a mask there is one deliberate difference (attention_checks.check_nonfinite): jax.nn adds masked (row, key)
pairs into its sums with weight 0, so that 0 * nan carries a non-finite K or V to rows that cannot see it (V: every
valid row, and rows past the query length too) and a non-finite Q row into the dK of keys it cannot see. jax_flash
skips the key blocks a query block cannot see, so it does that at most within a tile, never for keys that no row
sees (K/V padding past key_value_seq_lengths) nor from rows that see no key (Q padding past query_seq_lengths),
and rows that see no key keep their output 0 and zero dq.

tests/test_gpu.py runs the same cases on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

# (fields of conftest.Case, dtype). More (batch, kv head) pairs than threads: the fused backward; one pair: the split
# one (on a machine with two or more cores). 200 rows and keys: two forward query blocks, several key tiles.
GQA = dict(batch=2, seqlen_q=200, seqlen_k=200, heads_q=4, heads_kv=2, head_dim=32)
MQA = dict(batch=1, seqlen_q=200, seqlen_k=200, heads_q=4, heads_kv=1, head_dim=32)
SHAPES = {"gqa_float32": (GQA, jnp.float32), "gqa_bfloat16": (GQA, jnp.bfloat16), "mqa_float32": (MQA, jnp.float32)}
POSITION = (0, 120, 0, 5)  # (batch, row or key, head, dim) of the non-finite value: late in the first query block


def assert_patterns_equal(ours, base):
    for name, x, b in zip(("output", "dq", "dk", "dv"), ours, base):
        np.testing.assert_array_equal(x, b, err_msg=f"{name}: non-finite entries differ from jax.nn's")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", "qkv")
@pytest.mark.parametrize("shape_dtype", SHAPES.values(), ids=SHAPES.keys())
def test_nonfinite_input_propagates_like_jax_nn(shape_dtype, where, value, is_causal, attention_checks):
    shape, dtype = shape_dtype
    case = attention_checks.Case(**shape, is_causal=is_causal)
    inputs = attention_checks.nonfinite_inputs(case, dtype, where, value, POSITION, seed=1)
    ours, base = attention_checks.check_nonfinite(case, *inputs)
    assert ours[0].any(), "the non-finite input reaches no output"
    if not is_causal:
        assert_patterns_equal(ours, base)


@pytest.mark.parametrize("name", ["row_all_plus_inf", "row_all_minus_inf", "column_plus_inf", "column_minus_inf"])
def test_infinite_logits_like_jax_nn(name, attention_checks):
    case = attention_checks.Case(batch=1, seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=2, head_dim=16)
    inputs = attention_checks.infinite_logit_inputs(case, jnp.float32, name, seed=2)
    ours, base = attention_checks.check_nonfinite(case, *inputs)
    assert_patterns_equal(ours, base)
    assert ours[0].any() == (name != "column_minus_inf")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_rows_that_see_no_key_stay_zero(dtype, attention_checks):
    """nan in the query of rows that see no key (all of batch 0: key/value length 0; rows 120 on of batch 1: the
    window ends at the key/value length) and in keys and values that rows see or that no row sees: those rows output
    exactly 0 with zero dq, keys past the length get zero dk and dv (check_nonfinite), and the nan reaches the rows
    that see it."""
    case = attention_checks.Case(batch=2, seqlen_q=150, seqlen_k=100, heads_q=4, heads_kv=2, head_dim=16,
                                 window=(30, 5), kv_lens=(0, 90))
    q, k, v, do = attention_checks.make_inputs(case, dtype, seed=3)
    q = q.at[0].set(np.nan).at[1, 130, 2, 3].set(np.nan)
    for index in ((1, 80, 1, 4), (1, 95, 0, 0)):  # seen by rows 75 to 110; past the key/value length
        k, v = k.at[index].set(np.nan), v.at[index].set(np.nan)
    ours, _ = attention_checks.check_nonfinite(case, q, k, v, do)
    assert ours[0][1, 75:111].any(), "the nan of key 80 does not reach the rows that see it"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_nan_padding_does_not_reach_valid_entries(dtype, attention_checks):
    """Padding filled with nan (query rows past query_seq_lengths, keys and values past key_value_seq_lengths)
    gives exactly the results of zero padding, all finite; jax.nn's dq is nan there (0 * nan)."""
    case = attention_checks.Case(batch=2, seqlen_q=200, seqlen_k=190, heads_q=4, heads_kv=2, head_dim=32,
                                 is_causal=True, q_lens=(200, 130), kv_lens=(97, 190))
    q, k, v, do = attention_checks.check_nan_padding(case, dtype, seed=4)
    _, base = attention_checks.check_nonfinite(case, q, k, v, do)
    assert base[1].any(), "jax.nn's dq was expected to pick up the nan padding"


def test_residual_of_a_nan_row_is_nan(attention_checks):
    case = attention_checks.Case(batch=1, seqlen_q=33, seqlen_k=33, heads_q=2, heads_kv=2, head_dim=16)
    q, k, v, _ = attention_checks.nonfinite_inputs(case, jnp.float32, "q", "nan", (0, 7, 1, 2), seed=5)
    _, lse = jax_flash.dot_product_attention(q, k, v, return_residual=True)
    _, base = jax.nn.dot_product_attention(q, k, v, return_residual=True, implementation="xla")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(base))
    assert np.isnan(lse[0, 7, 1]) and np.isnan(lse).sum() == 1
