"""Stage 2: the model learns to run as inference will. Main attention uses the gate's top-k keys, K/V
pass through ASQ (block-wise, straight-through), upper layers read the cache bridge, and the base
trains (`full`, `lora` or `frozen`).

Loss = lm * LM loss + gate_kl * KL(main attention || gate) on the selected set (gate input detached,
so the base learns from the LM loss only, as in DSA) + asq * ASQ distortion. With
`gsm.gsm_enabled: false` the same recipe is the dense control.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gsm_train.attention import (
    GSMRecords,
    configure_gsm,
    gsm_adapters,
    gsm_collect,
    gsm_parameters,
    gsm_settings,
    inject_gsm,
)
from gsm_train.config.schema import RecipeConfig
from gsm_train.data.chat_data import IGNORE_INDEX, inputs_and_labels
from gsm_train.export.lora import inject_lora, lora_parameters
from gsm_train.export.save_load import build_settings, check_base, load_tensors, read_export
from gsm_train.modules import GSMError
from gsm_train.plots import plot_recall_per_layer
from gsm_train.training.distributed import all_reduce_sum

_MASS_KEYS = ("gate", "oracle", "queries")
ASQ_STATS = ("recon_rel_error", "cluster_usage", "dead_clusters")  # logged as asq_<name> at each evaluation


# what the export's gate tensors fix: their sizes, and which pairs rotate (its rope_freq_index)
GATE_FIELDS = ("gate_head_dim", "heads", "gate_query_heads", "gate_rotated_pairs")


def refuse_other_gate_shape(export: dict[str, Any], config: RecipeConfig) -> None:
    """GSMError naming the field and the fix where the `init_from` export's gates and the recipe's would
    differ in a field its tensors fix (`GATE_FIELDS`), e.g. a gate of 4 query heads continued by a recipe
    of 1: the gate is trained as its export built it, so the recipe must say the same."""
    theirs, ours = build_settings(export)[0].sparse_attention, config.gsm.sparse_attention
    if not (theirs.enabled and ours.enabled):
        return
    for field in GATE_FIELDS:
        trained, asked = (getattr(sparse, field) for sparse in (theirs, ours))
        if trained != asked:
            shown = "null" if trained is None else trained  # as an override spells it
            raise GSMError(
                f"init_from {config.init_from}: its gates have sparse_attention.{field}={shown}, the recipe's "
                f"{'null' if asked is None else asked}, but the export's gate tensors (their sizes, which pairs "
                f"rotate) continue as trained; set gsm.sparse_attention.{field}={shown}"
            )


def _mean(values: list[Tensor]) -> Tensor | None:
    return torch.stack(values).mean() if values else None


class JointStage:
    """Joint fine-tuning of GSM modules and base under the inference-time attention path."""

    name = "joint"
    graph_blocker = None  # top-k sizes come from the host, KL rows are drawn on the device, scalars read after

    def attach(self, model: nn.Module, config: RecipeConfig) -> None:
        """GSM modules as the recipe says, gate (and any other) tensors from `init_from`, LoRA if asked."""
        export = read_export(config.init_from) if config.init_from else None  # read once, checked in full
        if export is not None:
            check_base(export.config, model, export.folder)
            refuse_other_gate_shape(export.config, config)
        inject_gsm(model, config.gsm, mode=config.gsm.sparse_attention.mode)
        if export is not None:  # e.g. the gate_only export: no tensor is required (modules new here
            # start fresh), and gates of layers kept dense here have no place
            load_tensors(model, export, lambda name: False, allow_unexpected=True)
        if config.train.base == "lora":
            inject_lora(model, config.train.lora)

    def prepare(self, model: nn.Module, config: RecipeConfig) -> None:
        self.config = config
        self.attach(model, config)
        configure_gsm(model, detach_gate_input=True)
        model.requires_grad_(False)
        # the gate learns from its KL alone (its input is detached, its selection has no gradient)
        parts = ("compressor", "bridge") + (("gate",) if config.train.loss_weights.gate_kl > 0 else ())
        trained = [param for _, param in gsm_parameters(model, parts)] if config.gsm.gsm_enabled else []
        if config.train.base == "full":
            gsm_ids = {id(param) for _, param in gsm_parameters(model)}
            trained += [param for param in model.parameters() if id(param) not in gsm_ids]
        elif config.train.base == "lora":
            trained += [param for _, param in lora_parameters(model)]
        for param in trained:
            param.requires_grad_(True)
        if not any(p.requires_grad for p in model.parameters()):
            raise GSMError(
                "stage joint has nothing to train: train.base is frozen and no GSM module trains "
                "(GSM is off, or only the gate is on and train.loss_weights.gate_kl is 0); set train.base "
                "to full or lora, turn GSM on, or give the gate a KL weight"
            )

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        weights = self.config.train.loss_weights
        with gsm_collect(
            model,
            distill=weights.gate_kl > 0,
            distill_on_selection=True,
            distill_queries=self.config.train.distill_queries,
        ) as records:
            inputs, labels = inputs_and_labels(batch)
            lm = model(input_ids=inputs, labels=labels, use_cache=False).loss
        kl = _mean(records.gate_kl_means())
        asq = _mean(records.asq_losses())
        loss = weights.lm * lm
        scalars = {"lm_loss": lm.detach()}
        for name, term, weight in (("gate_kl", kl, weights.gate_kl), ("asq_loss", asq, weights.asq)):
            if term is not None:
                loss = loss + weight * term
                scalars[name] = term.detach()
        return loss, scalars

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: list[Tensor]) -> dict[str, Any]:
        """Perplexity with GSM as inference runs it, gate captured mass, ASQ error and bridge alphas."""
        was_training = model.training
        model.eval()
        k, min_keys = self.config.logging.recall_k, self.config.logging.recall_min_keys
        recall = (k, min_keys) if self.config.gsm.gsm_enabled else None
        device = next(model.parameters()).device
        sums = torch.zeros(8, dtype=torch.float64, device=device)  # nll, tokens, gate, oracle, queries, ASQ x3
        layers = list(gsm_settings(model).gate_layers) if recall is not None else []
        per_layer = torch.zeros(len(layers), len(_MASS_KEYS), dtype=torch.float64, device=device)
        for batch in batches:
            inputs, labels = inputs_and_labels(batch)
            with gsm_collect(model, recall=recall) as records:
                loss = model(input_ids=inputs, labels=labels, use_cache=False).loss
            tokens = (labels[:, 1:] != IGNORE_INDEX).sum()  # the tokens the loss averages over
            sums[0] += torch.where(tokens > 0, loss.double() * tokens, 0.0)  # no token in the loss: NaN loss
            sums[1] += tokens
            per_layer += self._layer_mass(records, layers, device)
            mass = records.captured_mass_total()
            if mass is not None:
                sums[2:5] += torch.stack([mass[key] for key in ("gate", "oracle", "queries")])
            sums[5:8] += torch.tensor(self._asq_stats(model), dtype=torch.float64, device=device)
        model.train(was_training)
        sums, per_layer = all_reduce_sum(sums).cpu(), all_reduce_sum(per_layer).cpu()
        metrics = {"ppl": math.exp(sums[0] / sums[1]), "eval_tokens": int(sums[1])}
        if sums[4] > 0:
            queries = per_layer[:, 2].clamp_min(1)
            metrics |= {
                f"gate_mass_k{k}": float(sums[2] / sums[4]),
                f"oracle_mass_k{k}": float(sums[3] / sums[4]),
                f"recall_ratio_k{k}": float(sums[2] / sums[3]),
                "layers": layers,
                f"gate_mass_k{k}_per_layer": (per_layer[:, 0] / queries).tolist(),
                f"oracle_mass_k{k}_per_layer": (per_layer[:, 1] / queries).tolist(),
            }
        if self.config.gsm.kv_compression.enabled and self.config.gsm.kv_compression.method == "asq":
            for index, key in enumerate(ASQ_STATS):
                metrics[f"asq_{key}"] = float(sums[5 + index] / len(batches)) if batches else float("nan")
        alphas = self._bridge_alphas(model)
        if alphas:
            metrics |= {"bridge_alpha_mean": sum(alphas) / len(alphas), "bridge_alphas": alphas}
        return metrics

    @staticmethod
    def _layer_mass(records: GSMRecords, layers: list[int], device: torch.device) -> Tensor:
        """[len(layers), 3] captured-mass sums (gate, oracle, queries) of each layer in `records`."""
        rows = [
            torch.stack([record.captured_mass[key] for key in _MASS_KEYS]).to(device)
            if (record := records.layers.get(layer)) is not None and record.captured_mass
            else torch.zeros(len(_MASS_KEYS), dtype=torch.float64, device=device)
            for layer in layers
        ]
        return torch.stack(rows) if rows else torch.zeros(0, len(_MASS_KEYS), dtype=torch.float64, device=device)

    @staticmethod
    def _asq_stats(model: nn.Module) -> list[float]:
        """Mean over the ASQ compressors of the last forward's ASQ_STATS (zeros without a full block)."""
        compressors = [asq for _, adapter in gsm_adapters(model) for asq in (adapter.asq_k, adapter.asq_v)]
        stats = [
            c.last_stats
            for c in compressors
            if getattr(c, "last_stats", None) and math.isfinite(float(c.last_stats["recon_rel_error"]))
        ]
        return [sum(float(s[key]) for s in stats) / len(stats) if stats else 0.0 for key in ASQ_STATS]

    @staticmethod
    def _bridge_alphas(model: nn.Module) -> list[float]:
        bridges = [adapter.bridge for _, adapter in gsm_adapters(model)]
        return [
            float(b.alpha.full_tensor() if hasattr(b.alpha, "full_tensor") else b.alpha)
            for b in bridges
            if b is not None
        ]

    def report(self, run_dir: Path, metrics: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
        """report.json, and with the gate's recall measured, recall_per_layer.png (as stage 1 writes)."""
        report = {"stage": self.name, "gsm_enabled": self.config.gsm.gsm_enabled, "final": metrics, "history": history}
        k = self.config.logging.recall_k
        plotted = {}
        if f"gate_mass_k{k}_per_layer" in metrics:
            plot = run_dir / "recall_per_layer.png"
            gate, oracle = metrics[f"gate_mass_k{k}_per_layer"], metrics[f"oracle_mass_k{k}_per_layer"]
            plotted = {"plot": str(plot_recall_per_layer(metrics["layers"], gate, oracle, k, plot))}
        (run_dir / "report.json").write_text(json.dumps(report | plotted, indent=2))
        keys = [key for key in metrics if key == "ppl" or key.startswith("recall_ratio") or key == "bridge_alpha_mean"]
        return {key: metrics[key] for key in keys} | {"report": str(run_dir / "report.json")} | plotted
