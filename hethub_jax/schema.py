"""JSON Schemas of the plan and of the training config file, generated from their pydantic models.

``python -m hethub_jax.schema`` writes ``docs/schema/plan.schema.json`` and
``docs/schema/config.schema.json``; ``python -m hethub_jax.schema --check`` exits 1 if they are not
current (``tests/test_schema.py`` runs that check). The schemas describe keys and types; the
cross-field rules (layers cover the model, TP divides the heads, ...) are checked by
``Plan.validate`` and ``hethub_jax.config.from_dict``, not by the schema.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["plan_schema", "config_schema", "render", "write", "main", "SCHEMA_DIR"]

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "docs" / "schema"
_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def plan_schema() -> dict[str, Any]:
    """The plan JSON (``docs/plan_format.md``): :class:`hethub_jax.parallel.plan.Plan`'s schema, with
    the top-level ``"stages"`` shorthand (one replica) as an alternative to ``"replicas"``."""
    from hethub_jax.parallel.plan import Plan

    s = Plan.model_json_schema()
    s["properties"]["stages"] = copy.deepcopy(s["$defs"]["ReplicaSpec"]["properties"]["stages"])
    s["properties"]["stages"]["description"] = "shorthand for \"replicas\": [{\"stages\": ...}]"
    s["required"] = [k for k in s["required"] if k != "replicas"]
    s["oneOf"] = [{"required": ["replicas"]}, {"required": ["stages"]}]
    return {"$schema": _DRAFT, **s}


def config_schema() -> dict[str, Any]:
    """The training config YAML (``docs/training.md``): sections ``model`` (a preset name, or a
    mapping of :class:`~hethub_jax.models.config.LlamaConfig` fields with an optional ``preset``),
    ``data``, ``optim``, ``train``; every section optional."""
    from pydantic.json_schema import models_json_schema

    from hethub_jax.config import TrainSettings
    from hethub_jax.data import DataConfig
    from hethub_jax.models.config import PRESETS, LlamaConfig
    from hethub_jax.optim import OptimConfig

    models = [LlamaConfig, DataConfig, OptimConfig, TrainSettings]
    _, top = models_json_schema([(m, "validation") for m in models])
    defs = top["$defs"]
    decay = defs["OptimConfig"]["properties"]["decay_steps"]  # in the file, null means train.steps
    defs["OptimConfig"]["properties"]["decay_steps"] = {
        "anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": decay["title"],
        "description": "null: train.steps"}
    presets = {"type": "string", "enum": sorted(PRESETS)}
    model_map = {"type": "object", "additionalProperties": False,
                 "description": "a preset with these fields replaced, or LlamaConfig fields",
                 "properties": {"preset": presets, **defs["LlamaConfig"]["properties"]}}
    sections = {"model": {"anyOf": [presets, model_map, {"type": "null"}], "default": "tiny"}}
    for name, m in (("data", DataConfig), ("optim", OptimConfig), ("train", TrainSettings)):
        sections[name] = {"anyOf": [{"$ref": f"#/$defs/{m.__name__}"}, {"type": "null"}]}
    return {"$schema": _DRAFT, "title": "hethub-jax training config", "type": "object",
            "additionalProperties": False, "properties": sections, "$defs": defs}


def render() -> dict[str, str]:
    """File name -> JSON text of every schema."""
    return {name: json.dumps(fn(), indent=2, sort_keys=True) + "\n"
            for name, fn in (("plan.schema.json", plan_schema), ("config.schema.json", config_schema))}


def write(directory: Path = SCHEMA_DIR, check: bool = False) -> list[str]:
    """Write the schemas into ``directory``; with ``check``, write nothing. Returns the names of the
    files that were (or, with ``check``, would be) changed."""
    changed = []
    for name, text in render().items():
        path = Path(directory) / name
        if not path.exists() or path.read_text() != text:
            changed.append(name)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hethub_jax.schema", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=SCHEMA_DIR, help="output directory (default docs/schema)")
    p.add_argument("--check", action="store_true", help="exit 1 if a schema file is missing or stale")
    args = p.parse_args(argv)
    changed = write(args.dir, check=args.check)
    for name in changed:
        print(f"{'stale' if args.check else 'wrote'}: {args.dir / name}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
