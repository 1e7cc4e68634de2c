"""Zero-bubble plans exported: torchtitan names torch's schedule class; Megatron-LM refuses."""

import tomllib

import pytest
from torch.distributed.pipelining import schedules

from planner.export import export_plan
from planner.presets import load_model
from planner.spec import Plan


@pytest.mark.parametrize("schedule, v, cls", [
    ("zb-h1", 1, schedules.ScheduleInterleavedZeroBubble),
    ("zb-v", 2, schedules.ScheduleZBVZeroBubble),
    ("dualpipe-v", 2, schedules.ScheduleDualPipeV),
])
def test_torchtitan_schedule_name_resolves_to_the_class_the_runtime_uses(schedule, v, cls):
    # Reference: torch's own name lookup (torchtitan passes the name to get_schedule_class)
    plan = Plan(tp=1, pp=2, dp=1, micro_batch=1, global_batch=8, schedule=schedule,
                virtual_stages=v)
    titan = export_plan(load_model("tiny-gpt"), plan, "torchtitan", steps=10)
    name = tomllib.loads(titan.text)["parallelism"]["pipeline_parallel_schedule"]
    assert schedules.get_schedule_class(name) is cls
    megatron = export_plan(load_model("tiny-gpt"), plan, "megatron", steps=10)
    assert f"schedule={schedule}: Megatron-LM runs 1F1B or interleaved 1F1B only" in \
        megatron.unsupported
