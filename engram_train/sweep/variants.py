"""Matched variants of one base MoE: the same total parameters, spent on experts or on Engram.

The pure MoE (`moe`) holds every sparse parameter in routed experts; its expert count is set by
the total-parameter budget. `engram_rho<r>` removes round(r x experts) routed experts (top-k
unchanged, so a token's activated expert parameters stay the same) and sizes the Engram tables
so that the total matches the MoE's within `TOTAL_TOLERANCE`. Two controls sit on the first
Engram variant: `_one_row` (one row per head: the memory is gone, the projections stay) and
`_frozen` (the tables keep their init). Every count comes from the model the trainer builds,
on the meta device (`engram_train.training.param_count`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from engram_train.config import EngramConfig, resolve
from engram_train.errors import EngramError
from engram_train.models.presets import CONF_DIR

TOTAL_TOLERANCE = 0.01
DEFAULT_RHOS = (0.2, 0.4, 0.6)
CONTROLS = ("one_row", "frozen")
CONTROL_FIELDS = {"one_row": "engram_one_row_per_head", "frozen": "engram_freeze_tables"}

Counter = Callable[[dict], dict]


class SweepError(EngramError, ValueError):
    """A sweep that cannot be derived or run; the message names the option and the fix."""


@dataclass
class Variant:
    name: str
    rho: float | None  # the share asked for; None for the pure MoE
    model: dict  # the complete model section, as conf/model/*.yaml holds it
    counts: dict = field(default_factory=dict)
    control: str | None = None
    experts_removed: int = 0

    @property
    def rho_actual(self) -> float | None:
        """Share of the MoE's routed experts that this variant removed (whole experts)."""
        if self.rho is None:
            return None
        return self.experts_removed / (self.model["num_moe_experts"] + self.experts_removed)

    def summary(self) -> dict:
        c = self.counts
        return {
            "variant": self.name, "rho": self.rho, "rho_actual": self.rho_actual,
            "control": self.control, "total_params": c["total"], "active_params": c["activated"],
            "routed_experts": self.model["num_moe_experts"],
            "engram_tables": c["engram_tables"], "engram_dense": c["engram_dense"],
            "engram_vocab_size": list(self.model["engram_vocab_size"])
            if resolve(self.model)["use_engram"] else None,
        }


def load_preset(preset: str | os.PathLike) -> dict:
    """A model section from a preset name (`conf/model/<name>.yaml`) or a YAML path; a
    `defaults:` list is merged as Hydra does for the presets (entries from the same folder)."""
    path = Path(preset)
    if not path.suffix:
        path = Path(CONF_DIR) / "model" / f"{preset}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (Path(CONF_DIR) / "model").glob("*.yaml"))
        raise SweepError(f"--preset {preset!r}: no such preset or YAML file (presets: {names})")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    merged: dict = {}
    for entry in raw.pop("defaults", []) or []:
        if entry == "_self_":
            continue
        merged.update(load_preset(path.parent / f"{entry}.yaml"))
    merged.update(raw)
    return merged


def apply_overrides(model: dict, dotlist: Sequence[str]) -> dict:
    """`model.key=value` overrides (YAML values, as Hydra parses them) on a model section."""
    out = dict(model)
    for item in dotlist:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("model.") or "." in key[len("model."):]:
            raise SweepError(f"model override {item!r}: write model.<key>=<value>")
        out[key[len("model."):]] = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
    return out


def _engram_fields(base: dict) -> dict:
    """The base's Engram shape (layers, N, heads, width, ...), defaults where it has none."""
    schema = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
              for f in dataclasses.fields(EngramConfig)}
    # the table sizes are set per variant; the tokenizer is the run's
    merged = {**schema, "engram_vocab_size": [2] * 2,
              "engram_tokenizer_name_or_path": "${data.tokenizer}", **base}
    fields = {k: merged[k] for k in schema}
    fields["engram_layer_ids"] = list(fields["engram_layer_ids"])
    fields["engram_vocab_size"] = list(fields["engram_vocab_size"])
    bad = [i for i in fields["engram_layer_ids"] if i >= base["num_layers"]]
    if bad:
        raise SweepError(
            f"engram_layer_ids {fields['engram_layer_ids']} name layers the base's "
            f"{base['num_layers']} do not have: pass model.engram_layer_ids=[...]")
    fields.update(use_engram=True, engram_one_row_per_head=False, engram_freeze_tables=False)
    return fields


def _moe(base: dict, counter: Counter, budget: int | None) -> Variant:
    """The pure MoE; with a budget, the expert count whose total comes nearest to it."""
    engram_keys = set(_engram_fields(base)) - {"use_engram"}
    moe = {k: v for k, v in base.items() if k not in engram_keys}
    moe["use_engram"] = False
    counts = counter(moe)
    experts, topk = int(moe["num_moe_experts"]), int(moe["moe_router_topk"])
    if budget is not None:
        per_expert = counts["routed_experts"] / experts
        experts = round(experts + (budget - counts["total"]) / per_expert)
        if experts < topk + 1:
            raise SweepError(
                f"--total-params {budget:,} leaves {experts} routed experts, fewer than top-k "
                f"{topk} + 1: raise the budget (the base's own MoE has {counts['total']:,})")
        moe["num_moe_experts"] = experts
        counts = counter(moe)
    return Variant("moe", None, moe, counts)


def _fit_tables(moe: Variant, rho: float, shape: dict, counter: Counter) -> Variant:
    """Remove round(rho x experts) routed experts and size the tables to refill the total."""
    experts, topk = moe.model["num_moe_experts"], moe.model["moe_router_topk"]
    removed = round(rho * experts)
    if removed < 1 or experts - removed < topk:
        raise SweepError(
            f"rho={rho} of {experts} routed experts removes {removed}: need at least 1 and at "
            f"most {experts - topk} (top-k {topk} must stay); choose another rho or raise "
            "--total-params (more experts)")
    model = dict(moe.model, num_moe_experts=experts - removed, **shape)
    orders = model["max_ngram_size"] - 1
    slope = len(model["engram_layer_ids"]) * orders * model["n_embed_per_ngram"]
    model["engram_vocab_size"] = [2] * orders
    gap = moe.counts["total"] - counter(model)["total"]
    size = 2
    for _ in range(4):  # the prime walk makes the count a near-linear step function of size
        size = max(2, round(size + gap / slope))
        model["engram_vocab_size"] = [size] * orders
        counts = counter(model)
        gap = moe.counts["total"] - counts["total"]
        if abs(gap) <= slope:
            break
    if size == 2 or abs(gap) > TOTAL_TOLERANCE * moe.counts["total"]:
        raise SweepError(
            f"rho={rho}: the {removed} removed experts do not pay for Engram's projections "
            f"(tables cannot match the total within {TOTAL_TOLERANCE:.0%}); raise rho or "
            "--total-params, or narrow model.n_embed_per_ngram")
    return Variant(f"engram_rho{rho:g}", rho, model, counts, experts_removed=removed)


def derive_variants(
    base: dict,
    counter: Counter,
    budget: int | None = None,
    rhos: Sequence[float] = DEFAULT_RHOS,
    controls: Sequence[str] = CONTROLS,
) -> list[Variant]:
    """`moe`, one `engram_rho<r>` per rho, and the controls on the first rho's variant."""
    for key in ("num_moe_experts", "moe_router_topk", "num_layers"):
        if not base.get(key):
            raise SweepError(f"the base preset has no {key}: start from a MoE preset")
    unknown = sorted(set(controls) - set(CONTROLS))
    if unknown:
        raise SweepError(f"controls {unknown} are unknown: choose from {list(CONTROLS)}")
    if controls and not rhos:
        raise SweepError("the controls sit on an Engram variant: give at least one rho")
    shape = _engram_fields(base)
    moe = _moe(base, counter, budget)
    variants = [moe] + [_fit_tables(moe, float(r), shape, counter) for r in rhos]
    if rhos:
        first = variants[1]
        for control in controls:
            model = dict(first.model, **{CONTROL_FIELDS[control]: True})
            variants.append(Variant(f"{first.name}_{control}", first.rho, model, counter(model),
                                    control, first.experts_removed))
    return variants


@contextlib.contextmanager
def meta_counter(base_cfg_overrides: Sequence[str], vocab_size: int) -> Iterator[Counter]:
    """A counter of model sections (the project's param_count on the meta device), run in this
    process as one rank; torch.distributed is set up on entry and torn down on exit."""
    from engram_train.logs import quiet_known_warnings

    quiet_known_warnings()
    from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed
    from engram_train.training.param_count import compose_config, run_config_counts
    from engram_train.training.run_config import ConfigError

    cfg = compose_config(list(base_cfg_overrides))
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    initialize_distributed(ParallelSizes())

    def count(model: dict) -> dict:
        cfg.model = OmegaConf.create(model)
        try:
            return run_config_counts(cfg, None, vocab_size)
        except ConfigError as e:
            raise SweepError(f"a derived variant is not a valid model: {e}") from None

    try:
        yield count
    finally:
        destroy_distributed()
