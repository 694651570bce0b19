"""Stage 1 (gate warm-up; `stage: gate_warmup`): the base stays frozen and runs dense; only the
Sparse Gate Heads learn, by distilling the head-averaged main attention (KL per layer, in query
chunks). Also used by the domain gate fine-tune, which starts from an exported adapter instead of a
fresh injection."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gsm_train.attention import gsm_collect, gsm_parameters, gsm_settings, inject_gsm
from gsm_train.config.schema import RecipeConfig
from gsm_train.data.chat_data import input_ids
from gsm_train.modules import GSMError
from gsm_train.plots import plot_recall_per_layer
from gsm_train.training.distributed import all_reduce_sum

_RECALL_KEYS = ("gate", "oracle", "queries")


class GateWarmupStage:
    """Train only the gate heads: loss = mean over sparse layers of KL(target || gate) per counted query."""

    name = "gate_warmup"
    distill_queries = 0
    graph_blocker = None  # its step never reads device values on the host: train.cuda_graph may capture it

    def prepare(self, model: nn.Module, config: RecipeConfig) -> None:
        if not (config.gsm.gsm_enabled and config.gsm.sparse_attention.enabled):
            raise GSMError(
                "stage gate_warmup (stage 1, gate warm-up) trains the Sparse Gate Heads, but "
                "gsm.gsm_enabled or gsm.sparse_attention.enabled is false; set both to true"
            )
        self.recall = (config.logging.recall_k, config.logging.recall_min_keys)
        self.distill_queries = config.train.distill_queries
        self.attach(model, config)
        model.requires_grad_(False)
        for _, param in gsm_parameters(model, ("gate",)):
            param.requires_grad_(True)

    def attach(self, model: nn.Module, config: RecipeConfig) -> None:
        """Fresh gate heads as the recipe's gsm block says."""
        inject_gsm(model, config.gsm, mode="dense")

    def _forward(self, model: nn.Module, batch: Tensor) -> None:
        model(input_ids=input_ids(batch), use_cache=False, logits_to_keep=1)

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        with gsm_collect(model, distill=True, distill_queries=self.distill_queries) as records:
            self._forward(model, batch)
        per_layer = records.gate_kl_means()
        if not per_layer:
            raise GSMError("no layer produced a gate loss: every layer is dense or has no gate")
        return torch.stack(per_layer).mean(), {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: list[Tensor]) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        layers = list(gsm_settings(model).gate_layers)
        sums = torch.zeros(
            len(layers), len(_RECALL_KEYS) + 2, dtype=torch.float64, device=next(model.parameters()).device
        )
        for batch in batches:
            with gsm_collect(model, distill=True, recall=self.recall) as records:
                self._forward(model, batch)
            for row, layer in enumerate(layers):
                recall, (total, count) = records.layers[layer].captured_mass, records.layers[layer].gate_kl
                sums[row] += torch.stack([*(recall[k] for k in _RECALL_KEYS), total.double(), count.double()])
        model.train(was_training)
        sums = all_reduce_sum(sums).cpu()
        queries = sums[:, 2].clamp_min(1)
        gate_mass, oracle_mass = sums[:, 0] / queries, sums[:, 1] / queries
        ratio = gate_mass / oracle_mass.clamp_min(1e-12)
        kl = sums[:, 3] / sums[:, 4].clamp_min(1)
        k = self.recall[0]
        return {
            "layers": layers,
            f"gate_mass_k{k}": float(gate_mass.mean()),
            f"oracle_mass_k{k}": float(oracle_mass.mean()),
            f"recall_ratio_k{k}": float(ratio.mean()),
            "kl": float(kl.mean()),
            f"gate_mass_k{k}_per_layer": gate_mass.tolist(),
            f"oracle_mass_k{k}_per_layer": oracle_mass.tolist(),
            f"recall_ratio_k{k}_per_layer": ratio.tolist(),
            "kl_per_layer": kl.tolist(),
            "queries_measured": int(sums[0, 2]),
        }

    def report(self, run_dir: Path, metrics: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
        k = self.recall[0]
        plot = run_dir / "recall_per_layer.png"
        plot_recall_per_layer(
            metrics["layers"], metrics[f"gate_mass_k{k}_per_layer"], metrics[f"oracle_mass_k{k}_per_layer"], k, plot
        )
        report = {"stage": self.name, "final": metrics, "history": history, "plot": str(plot)}
        (run_dir / "report.json").write_text(json.dumps(report, indent=2))
        return {key: metrics[key] for key in (f"recall_ratio_k{k}", f"gate_mass_k{k}", f"oracle_mass_k{k}", "kl")} | {
            "report": str(run_dir / "report.json"),
            "plot": str(plot),
        }
