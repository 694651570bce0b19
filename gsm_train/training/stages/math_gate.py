"""Domain gate fine-tune: start from an exported adapter (`init_from`) and adapt only its gate heads
to domain text (e.g. GSM8K); the base, ASQ and bridge stay exactly as loaded. Same loss, metrics
and report as stage 1 (gate warm-up)."""

from __future__ import annotations

from torch import nn

from gsm_train.attention import set_gsm_mode
from gsm_train.config.schema import RecipeConfig
from gsm_train.export.save_load import load_gsm
from gsm_train.training.stages.gate_warmup import GateWarmupStage


class MathGateStage(GateWarmupStage):
    """Gate-only fine-tune of an exported adapter; the modules come from the export, not the recipe."""

    name = "math_gate"
    graph_blocker = "its adapter may carry ASQ and the bridge in dense mode, a step not verified under capture"

    def attach(self, model: nn.Module, config: RecipeConfig) -> None:
        load_gsm(model, config.init_from)  # modules and tensors only: the model keeps its own forward
        set_gsm_mode(model, "dense")
