"""Single-process tests of the runtime's pieces: data order, model, stage split, logs, launch."""

from __future__ import annotations

import json
import re

import pytest
import torch

from planner.spec import PlanError
from runtime.data import ByteBatches, default_corpus_bytes, read_corpus
from runtime.launch import local_torchrun_command
from runtime.model import Transformer
from runtime.parallel.pp import split_for_stage
from runtime.train import _write_summary, format_step, step_record


def small_batches(global_batch: int = 8) -> ByteBatches:
    tokens = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    return ByteBatches(tokens, seq_len=16, global_batch=global_batch, seed=3)


class TestByteBatches:
    def test_dp_slices_concatenate_to_the_global_batch(self):
        batches = small_batches()
        inputs, targets = batches.global_batch_at(2)                       # (8, 16)
        parts = [batches.local_batch_at(2, r, 4) for r in range(4)]        # 4 x (2, 16)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)

    def test_targets_are_inputs_shifted_by_one(self):
        inputs, targets = small_batches().global_batch_at(0)
        assert inputs.shape == targets.shape == (8, 16)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])

    def test_same_seed_same_order_and_steps_differ(self):
        a, b = small_batches(), small_batches()
        assert torch.equal(a.global_batch_at(5)[0], b.global_batch_at(5)[0])
        assert not torch.equal(a.global_batch_at(0)[0], a.global_batch_at(1)[0])

    def test_later_epochs_reuse_every_window(self):
        batches = small_batches()                            # 62 windows of 16 bytes
        epoch_1 = batches.samples(batches.num_windows, batches.num_windows)[0]
        assert sorted(epoch_1[:, 0].tolist()) == sorted(
            batches.samples(0, batches.num_windows)[0][:, 0].tolist())

    def test_dp_must_divide_global_batch(self):
        with pytest.raises(ValueError, match="not divisible by dp=3"):
            small_batches().local_batch_at(0, 0, 3)


def test_default_corpus_is_capped_stdlib_source():
    data = default_corpus_bytes(max_bytes=100_000)
    assert len(data) == 100_000
    assert b"import" in data


def test_short_data_file_names_the_path(tmp_path):
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"short\.txt.* 3 bytes.*seq_len \+ 1 = 65"):
        read_corpus(short, 64)


class TestTransformer:
    def test_parameter_count_is_the_spec_plus_learned_positions(self, tiny_model):
        spec = tiny_model()
        model = Transformer(spec)
        count = sum(p.numel() for p in model.parameters())
        assert count == spec.num_params() + spec.seq_len * spec.hidden

    def test_same_seed_same_init(self, tiny_model):
        a, b = Transformer(tiny_model(), seed=1), Transformer(tiny_model(), seed=1)
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))

    def test_tied_embeddings_share_one_matrix(self, tiny_model):
        model = Transformer(tiny_model(tied_embeddings=True))
        assert model.out.weight is model.tok.weight

    def test_gqa_swiglu_rmsnorm_forward_shape(self, tiny_model):
        model = Transformer(tiny_model(activation="swiglu", norm="rmsnorm", num_kv_heads=2))
        logits = model(torch.zeros(2, 10, dtype=torch.int64))
        assert logits.shape == (2, 10, 256)


class TestSplitForStage:
    def test_stages_chain_to_the_full_model(self, tiny_model, tiny_plan):
        spec, plan = tiny_model(), tiny_plan(pp=2)
        tokens = torch.randint(0, 256, (2, 12))                             # (B, T)
        full = Transformer(spec)(tokens)                                    # (B, T, V)
        first = split_for_stage(Transformer(spec), plan, 0)
        last = split_for_stage(Transformer(spec), plan, 1)
        assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
        assert first.out is None and last.tok is None
        torch.testing.assert_close(last(first(tokens)), full)

    def test_tied_embeddings_are_refused_under_pp(self, tiny_model, tiny_plan):
        with pytest.raises(PlanError, match="tied_embeddings"):
            split_for_stage(Transformer(tiny_model(tied_embeddings=True)), tiny_plan(pp=2), 0)


def test_step_line_is_stable(tiny_plan, write_plan):
    from planner.planfile import read_plan_file
    pf = read_plan_file(write_plan("line", tiny_plan()))
    record = step_record(3, 5.12345, 0.412, pf)
    assert record["tokens_per_s"] == pytest.approx(8 * 64 / 0.412)
    assert re.fullmatch(r"step: 3  loss: 5\.1235  step_time_s: 0\.412  tokens_per_s: 1243  "
                        r"mfu_pct: \d+\.\d\d", format_step(record))


def test_torchrun_command_uses_the_plan_world_size(tiny_plan, write_plan):
    path = write_plan("cmd", tiny_plan(tp=2))
    cmd = local_torchrun_command(path, steps=3, out_dir="runs/x", data="d.txt", master_port=29999)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    assert "--master-port" in cmd and "29999" in cmd
    assert cmd[cmd.index("-m", 2) + 1] == "runtime.train"
    assert cmd[cmd.index("--data") + 1] == "d.txt"


def test_step_line_carries_memory_and_per_device_throughput(tiny_plan, write_plan):
    from planner.planfile import read_plan_file
    pf = read_plan_file(write_plan("line2", tiny_plan(dp=2)))
    record = step_record(1, 5.0, 0.5, pf, peak_memory_bytes=[2**20, 3 * 2**20], comm_time_s=0.1)
    assert record["tokens_per_s_per_device"] == pytest.approx(8 * 64 / 0.5 / 2)
    assert record["peak_memory_bytes_max"] == 3 * 2**20
    assert record["device_profile"] == "localhost-cpu"
    assert format_step(record).endswith(
        "tokens_per_s_per_device: 512  peak_memory_MiB: 3.0  comm_time_s: 0.100")


def test_tiled_attention_model_matches_sdpa_model(tiny_model):
    spec = tiny_model(num_kv_heads=2)
    tokens = torch.randint(0, 256, (2, 33))                                  # (B, T)
    torch.testing.assert_close(Transformer(spec, attention="tiled")(tokens),
                               Transformer(spec)(tokens), rtol=1e-5, atol=1e-5)


def test_tied_split_is_allowed_when_the_caller_sums_the_grads(tiny_model, tiny_plan):
    last = split_for_stage(Transformer(tiny_model(tied_embeddings=True)), tiny_plan(pp=2), 1,
                           allow_tied=True)
    assert last.tok is None and last.out is not None


def test_summary_states_the_prediction_and_its_error(tmp_path, tiny_plan, write_plan):
    plan_path = write_plan("summary", tiny_plan())          # prediction: step_time_s 0.1
    _write_summary(tmp_path, {"step_time_s": 0.125, "prediction": {"step_time_s": 0.1}},
                   str(plan_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    # (predicted - measured) / measured = (0.1 - 0.125) / 0.125
    assert summary["prediction_error"] == pytest.approx(-0.2)
    assert summary["prediction"] == {"step_time_s": 0.1}
    assert (tmp_path / "plan.yaml").read_text() == plan_path.read_text()
    _write_summary(tmp_path, {"step_time_s": 0.125, "prediction": {}}, str(plan_path))
    assert json.loads((tmp_path / "summary.json").read_text())["prediction_error"] is None
