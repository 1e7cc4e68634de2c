"""The mixture-of-experts block in one process: the load-balancing loss against hand
calculations from its definition (Fedus et al. 2021, eq. 4), the router against its rules, the
block against a per-token loop, and the runtime's input checks of MoE plans."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from planner.presets import load_model
from planner.spec import Plan
from runtime.model import MLP, Transformer
from runtime.moe import AUX_LOSS_COEFF, MoE, Router, load_balancing_loss, runtime_moe_error
from runtime.parallel.ep import expert_parallel_error, resolve_ep
from runtime.train import moe_plan_error


@pytest.fixture(scope="module")
def spec():
    return load_model("tiny-moe")


def test_balanced_routing_gives_one():
    # f_i = P_i = 1/E for every expert: E · E · (1/E)^2 = 1 (Fedus et al. 2021, section 2.2)
    e, t = 4, 8
    probs = torch.full((1, t, e), 1 / e)
    indices = torch.arange(t * 2).remainder(e).view(1, t, 2)          # each expert 4 of 16
    assert float(load_balancing_loss(probs, indices)) == pytest.approx(1.0)


def test_collapsed_top1_routing_gives_num_experts():
    # every token to expert 0 with probability 1: f_0 = P_0 = 1, so E · 1 · 1 = E
    probs = torch.zeros(2, 5, 4)
    probs[..., 0] = 1.0
    indices = torch.zeros(2, 5, 1, dtype=torch.long)
    assert float(load_balancing_loss(probs, indices)) == pytest.approx(4.0)


def test_aux_loss_is_per_sequence_and_averaged():
    # sequence 1 (hand): f = (1, 0), P = (0.625, 0.375): 2 · 0.625 = 1.25
    # sequence 2 (hand): f = (0.5, 0.5), P = (0.5, 0.5): 2 · 0.5 = 1.0; mean 1.125
    probs = torch.tensor([[[0.75, 0.25], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]])
    indices = torch.tensor([[[0], [0]], [[0], [1]]])
    assert float(load_balancing_loss(probs, indices)) == pytest.approx(1.125)


def _router_spec(spec, **changes):
    # hidden = num_experts with an identity router matrix: the input rows are the logits
    return spec.replace(hidden=4, num_heads=1, num_kv_heads=1, **changes)


def test_grouped_routing_picks_from_the_best_group(spec):
    router = Router(_router_spec(spec, router_groups=2, router_group_topk=1))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    # probabilities 0.3, 0.25 | 0.4, 0.05: plain top-2 is {2, 0}; group 0 scores 0.55 > 0.45
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.4, 0.05]]))
    _, indices, gates = router(logits)
    assert sorted(indices[0].tolist()) == [0, 1]
    assert gates[0].tolist() == pytest.approx([0.3 / 0.55, 0.25 / 0.55])


def test_sigmoid_router_normalises_the_chosen_scores(spec):
    router = Router(_router_spec(spec, router="sigmoid"))
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    probs, indices, gates = router(logits)
    s = torch.sigmoid(logits[0])
    assert indices[0].tolist() == [0, 2]                       # the two largest sigmoids
    assert gates[0].tolist() == pytest.approx([float(s[0] / (s[0] + s[2])),
                                               float(s[2] / (s[0] + s[2]))])
    assert probs[0].tolist() == pytest.approx((s / s.sum()).tolist())     # DeepSeek-V3 eq. 19


def _moe(spec, seed=0):
    model = Transformer(spec, seed=seed)
    return model.layers["0"].mlp


def test_moe_equals_a_per_token_loop(spec):
    moe = _moe(spec.replace(num_shared_experts=1))
    x = torch.randn(2, 5, spec.hidden, generator=torch.Generator().manual_seed(1))
    got = moe(x)
    experts, shared, w = moe.experts, moe.shared, moe.router.weight
    want = torch.empty_like(got)
    for b in range(2):
        for t in range(5):
            token = x[b, t]                                           # (h,)
            probs = torch.softmax(w @ token, dim=0)                   # (E,)
            top = probs.topk(spec.experts_per_token)
            out = shared(token)
            for g, e in zip(top.values / top.values.sum(), top.indices, strict=True):
                inner = F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)
                out = out + g * (experts.w2[e] @ inner)
            want[b, t] = out
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_aux_loss_gradient_is_that_of_the_added_term(spec):
    # the gradient AttachAuxLoss injects equals autograd of out.sum() + α · aux (its definition)
    x = torch.randn(3, 4, spec.hidden, generator=torch.Generator().manual_seed(2))
    injected = _moe(spec)
    injected(x).sum().backward()
    explicit = _moe(spec)
    explicit.aux_grad_scale = 0.0           # no injected term: only the explicit one below
    tokens = x.reshape(-1, spec.hidden)
    probs, indices, _ = explicit.router(tokens)
    loss = explicit(x).sum() + AUX_LOSS_COEFF * load_balancing_loss(
        probs.view(3, 4, -1), indices.view(3, 4, -1))
    loss.backward()
    torch.testing.assert_close(injected.router.weight.grad, explicit.router.weight.grad)
    assert float(injected.router.weight.grad.norm()) > 0


def test_moe_layer_pattern_and_shared_experts(spec):
    # moe_first_dense_layers=1, moe_layer_freq=2: blocks 1 and 3 are MoE (planner.spec)
    model = Transformer(spec.replace(moe_first_dense_layers=1, moe_layer_freq=2,
                                     num_shared_experts=2))
    kinds = [type(model.layers[str(i)].mlp) for i in range(4)]
    assert kinds == [MLP, MoE, MLP, MoE]
    shared = model.layers["1"].mlp.shared
    assert shared.w1.weight.shape == (2 * spec.expert_hidden, spec.hidden)
    # parameter count: the spec's blocks, final norm, embedding, output (+ learned positions)
    positions = spec.seq_len * spec.hidden
    counted = model.spec.num_params() + positions
    assert sum(p.numel() for p in model.parameters()) == counted


def test_expert_init_uses_the_residual_scale(spec):
    model = Transformer(spec)
    std = float(model.layers["0"].mlp.experts.w2.detach().std())
    assert std == pytest.approx(0.02 / math.sqrt(2 * spec.num_layers), rel=0.05)


def test_runtime_rejects_what_it_does_not_execute(spec):
    plan = Plan(tp=1, pp=1, dp=2, micro_batch=1, global_batch=2)
    assert "dropless" in runtime_moe_error(spec.replace(capacity_factor=1.25))
    assert expert_parallel_error(spec, plan, 3).startswith("ep=3 does not divide num_experts=4")
    assert "dp = ep·edp" in expert_parallel_error(spec, plan, 4)
    assert "needs a mixture-of-experts model" in expert_parallel_error(
        load_model("tiny-gpt"), plan, 2)
    sp = Plan(tp=2, pp=1, dp=1, micro_batch=1, global_batch=2, sequence_parallel=True)
    assert "sequence_parallel=True" in moe_plan_error(spec, sp, None)
    assert moe_plan_error(spec, plan, 2) is None
    assert resolve_ep(plan, None) == 1 and resolve_ep(plan, 2) == 2


def test_meshplan_run_rejects_a_bad_ep_in_one_line(write_plan, tiny_plan, spec, tmp_path):
    path = write_plan("moe-bad-ep", tiny_plan(dp=2), spec)
    result = subprocess.run([sys.executable, "-m", "apps.cli", "run", str(path), "--ep", "3",
                             "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    message = " ".join((result.stdout + result.stderr).split())
    assert "ep=3 does not divide num_experts=4; use ep in [1, 2, 4]" in message
    assert "Traceback" not in message
