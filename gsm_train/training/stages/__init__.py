"""Training stages, one file each; `STAGES` maps a recipe's `stage` to its class."""

from gsm_train.training.stages.gate_warmup import GateWarmupStage
from gsm_train.training.stages.joint import JointStage
from gsm_train.training.stages.math_gate import MathGateStage

STAGES = {"gate_warmup": GateWarmupStage, "joint": JointStage, "math_gate": MathGateStage}

__all__ = ["STAGES", "GateWarmupStage", "JointStage", "MathGateStage"]
