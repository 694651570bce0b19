"""Training stages, one file each; `STAGES` maps a recipe's `stage` to its class."""

from gsm_train.stages.gate_warmup import GateWarmupStage

STAGES = {"gate_warmup": GateWarmupStage}

__all__ = ["STAGES", "GateWarmupStage"]
