"""`LlamaConfig`: the planner's `ModelSpec`, with the helpers the model and its users need."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from simulate.specs import MODEL_PRESETS, ModelSpec, get_model_spec


class LlamaConfig(ModelSpec):
    """Hyper-parameters of `Llama`: exactly `simulate.specs.ModelSpec` (one definition of the shapes, so the
    model that trains and the model the planner counts cannot drift apart).

    `from_name` builds one from a preset (``"tiny"``, ``"llama3.2-1b"``, ``"llama3.2-3b"``, ``"llama3.1-8b"``,
    ``"llama3.1-70b"``); keyword overrides replace single fields. Frozen: derive variants with
    ``dataclasses.replace``.
    """

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """Build the preset called ``name`` (see ``simulate.specs.MODEL_PRESETS``), then apply ``overrides``."""
        spec = get_model_spec(name)
        return cls(**{**{f.name: getattr(spec, f.name) for f in fields(spec)}, **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(MODEL_PRESETS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
