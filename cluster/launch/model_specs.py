"""Several models from the command line and the YAML file (docs/models.md): `--model` given more
than once with `--served-model-name` repeated in the same order, or a `models:` list of entries
(`model`, `served_model_name`, `dtype`, `quantization`, `prefill`, `decode`). The first model is
the cluster's own (`engine.model`); the others become `ClusterConfig.models`. Light: the command
line reads it before anything heavy is imported."""
from __future__ import annotations

from cluster.launch.cluster_config import ModelSpec
from cluster.launch.settings import SettingError, Values

MODEL_KEYS = ("model", "served_model_name", "dtype", "quantization", "num_prefill", "num_decode")
_ALIASES = {"prefill": "num_prefill", "decode": "num_decode"}
# What an entry's own keys set for the first model: the cluster's settings at these paths.
_FIRST_PATHS = {"model": ("engine", "model"), "served_model_name": ("served_model_name",), "dtype": ("engine", "dtype"),
                "quantization": ("engine", "quantization"), "num_prefill": ("num_prefill",),
                "num_decode": ("num_decode",)}


def model_spec(entry, where: str) -> ModelSpec:
    """A YAML `models:` entry (keys as the flags, `_` or `-`); a bare string is a model alone."""
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict) or "model" not in entry:
        raise SettingError(where, f"each entry needs `model:` (and optionally {', '.join(MODEL_KEYS[1:])})")
    fields = {_ALIASES.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in entry.items()}
    unknown = set(fields) - set(MODEL_KEYS)
    if unknown:
        raise SettingError(where, f"unknown key(s) {', '.join(sorted(unknown))}; an entry takes "
                                  f"{', '.join(MODEL_KEYS)}")
    return ModelSpec(**{**fields, "model": str(fields["model"])})


def _from_flags(repeated: dict) -> list[ModelSpec]:
    models, names = repeated.get("model", []), repeated.get("served_model_name", [])
    if len(models) <= 1:
        if len(names) > 1:
            raise SettingError("--served-model-name", f"is given {len(names)} times for one --model")
        return []
    if names and len(names) != len(models):
        raise SettingError("--served-model-name", f"is given {len(names)} times for {len(models)} --model: give one "
                                                  "per --model, in the same order (or none)")
    return [ModelSpec(str(m), names[i] if names else None) for i, m in enumerate(models)]


def several_models(args, values: Values) -> dict:
    """The derived `models` setting (path -> value) from repeated flags or the YAML list; the first
    model's own settings are put in `values` (the cluster's). Nothing for one model."""
    listed = getattr(args, "models", None)
    specs = _from_flags(getattr(args, "_repeated", {}))
    if listed is not None:
        if specs:
            raise SettingError("--model", "is given more than once and the YAML has `models:`: keep one of them")
        if ("engine", "model") in values.given and values.source[("engine", "model")].startswith("--"):
            raise SettingError("--model", "and the YAML's `models:` both name models: keep one of them")
        if not isinstance(listed, list) or not listed:
            raise SettingError("models", "must be a list of {model, served_model_name, dtype, quantization, prefill, "
                                         "decode} entries")
        specs = [model_spec(entry, f"models[{i}]") for i, entry in enumerate(listed)]
    if not specs:
        return {}
    first = specs[0]
    for key, path in _FIRST_PATHS.items():
        value = getattr(first, key)
        if value is not None:
            values.given[path] = value
            values.source[path] = "models[0]" if listed is not None else f"--{key.replace('_', '-')}"
    return {("models",): tuple(specs[1:])}
