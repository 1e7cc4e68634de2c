"""The zero-bubble schedules train exactly the single-process model (10 steps, pp = 2).

Each runs torch.distributed.pipelining's own schedule class (`runtime.parallel.pp`), which
splits every backward into an input-gradient and a weight-gradient action; the reference is
the single-process run of `runtime.reference.reference_run` on the same data, compared as in
tests/runtime/test_equivalence.py (losses and final parameters within 1e-4 relative, fp32).
"""

from __future__ import annotations

import pytest

from runtime.reference import reference_run
from tests.runtime.test_equivalence import STEPS, run_and_compare


@pytest.fixture(scope="module")
def reference_state(tiny_model, tiny_plan):
    """The single-process run of the default tiny plan: (losses, final parameters)."""
    return reference_run(tiny_model(), tiny_plan(), STEPS)


def test_zbv_pp2_matches_single_process(write_plan, tiny_plan, tmp_path, reference_state):
    # tiny-gpt's 4 layers as 4 chunks in a V: rank 0 holds chunks 0 and 3, rank 1 chunks 1
    # and 2; 4 micro-batches of 2
    plan = tiny_plan(pp=2, schedule="zb-v", virtual_stages=2)
    run_and_compare(write_plan, tmp_path, "pp2-zbv", plan, reference_state)


@pytest.mark.slow
@pytest.mark.parametrize("name, changes", [
    pytest.param("pp2-zbh1", {"pp": 2, "schedule": "zb-h1"}, id="pp2-zb-h1"),
    pytest.param("pp2-izb", {"pp": 2, "schedule": "interleaved-zb", "virtual_stages": 2},
                 id="pp2-interleaved-zb"),
    pytest.param("pp2-dualpipev", {"pp": 2, "schedule": "dualpipe-v", "virtual_stages": 2},
                 id="pp2-dualpipe-v"),
])
def test_more_zero_bubble_schedules_match_single_process(write_plan, tiny_plan, tmp_path,
                                                         reference_state, name, changes):
    run_and_compare(write_plan, tmp_path, name, tiny_plan(**changes), reference_state)


@pytest.mark.slow
def test_tied_embeddings_under_zbv_match_single_process(write_plan, tiny_model, tiny_plan,
                                                        tmp_path):
    # both copies of the tied matrix (chunks 0 and 3) live on pipeline rank 0: summed there
    model = tiny_model(tied_embeddings=True)
    plan = tiny_plan(pp=2, schedule="zb-v", virtual_stages=2)
    run_and_compare(write_plan, tmp_path, "pp2-zbv-tied", plan,
                    reference_run(model, plan, STEPS), model=model)
