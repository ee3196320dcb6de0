"""Per-rank memory plan and decode roofline, computed before any weight is read.

    plan = make_plan("qwen3-235b-a22b-nvfp4", drafter="eagle3-qwen3-235b",
                     nodes=[Node("spark-a", m), Node("spark-b", m)], tp=2, context=32768,
                     hardware="dgx-spark")
    plan.check()   # raises DoesNotFit (a UserError, exit status 1) with the rendered plan

Entry points, before reading any weight (every rank computes the same plan):

    plan = check_before_load(RunConfig(target=..., topology=...), world_size)
"""

from hetero_run.runtime.planner.accounting import RankTensor, Role, rank_tensors, role_of
from hetero_run.runtime.planner.hardware import Hardware, hardware_preset, measure_bandwidth
from hetero_run.runtime.planner.inventory import ModelSource, model_presets, resolve
from hetero_run.runtime.planner.kv import kv_bytes_per_token
from hetero_run.runtime.planner.memory import Node, RankPlan
from hetero_run.runtime.planner.plan import DoesNotFit, Plan, make_plan
from hetero_run.runtime.planner.roofline import Roofline, expected_tokens_per_round, experts_touched
from hetero_run.runtime.planner.run import check_before_load, plan_run, relative_to_file, topology_nodes
from hetero_run.runtime.planner.tensor_info import TensorInfo

__all__ = [
    "DoesNotFit", "Hardware", "ModelSource", "Node", "Plan", "RankPlan", "RankTensor", "Role", "Roofline",
    "TensorInfo", "check_before_load", "expected_tokens_per_round", "experts_touched", "hardware_preset",
    "kv_bytes_per_token", "make_plan", "measure_bandwidth", "model_presets", "plan_run", "rank_tensors",
    "relative_to_file", "resolve", "role_of", "topology_nodes",
]
