"""The bulk fit recovers parameters it is given: runs whose reference times were simulated with
known A100 parameters are refitted from a perturbed start and reproduced (the known values are
the independent source; the rows are real vTrain configurations)."""

import dataclasses
from pathlib import Path

import pytest

from simulator.step.compute import load_efficiency
from simulator.validation.fit import cases_on_device, fit_efficiency, mape, nelder_mead
from simulator.validation.validate import predict, read_runs

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SINGLE = DATA / "vtrain" / "ground_truth_single.csv"


def test_nelder_mead_finds_the_minimum_of_a_quadratic():
    import numpy as np
    x = nelder_mead(lambda v: float(((v - np.array([1.0, -2.0])) ** 2).sum()), np.zeros(2))
    assert x == pytest.approx([1.0, -2.0], abs=1e-3)


@pytest.mark.skipif(not SINGLE.is_file(), reason=f"reference data not found at {DATA}")
def test_fit_recovers_the_parameters_that_produced_the_reference_times():
    truth = load_efficiency("a100-sxm-80gb")
    rows = read_runs(SINGLE)[:40]
    # Reference = the model's own prediction under ``truth``: a perfect fit exists.
    synthetic = [dataclasses.replace(
        c, reference_step_time_s=predict(dataclasses.replace(
            c, options=dataclasses.replace(c.options, efficiency=truth)), fast=True))
        for c in rows]
    start = dataclasses.replace(truth, kernel_s=truth.kernel_s * 2.5,
                                host_op_s=truth.host_op_s * 0.5)
    assert mape(synthetic, start, fast=True) > 0.1
    eff, _, errors = fit_efficiency([synthetic[:20], synthetic[20:]], start,
                                    free=("kernel_s", "host_op_s"), iters=200)
    assert max(errors) < 0.005
    assert eff.host_op_s == pytest.approx(truth.host_op_s, rel=0.02)


@pytest.mark.skipif(not SINGLE.is_file(), reason=f"reference data not found at {DATA}")
def test_only_rows_on_the_fitted_gpu_type_enter_the_fit():
    published = read_runs(DATA / "published_runs.csv")
    a100 = cases_on_device(published, "a100-sxm-80gb")
    h100 = cases_on_device(published, "h100-sxm-80gb")
    assert a100 and h100 and not {c.id for c in a100} & {c.id for c in h100}
    assert all(c.cluster_name != "dgx-h100" for c in a100)
    # The 2020 rows on the 40 GB part share the 80 GB entry and are fitted with it.
    assert any(c.cluster_name == "dgx-a100-40gb" for c in a100)
