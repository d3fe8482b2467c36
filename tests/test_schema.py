"""The JSON Schemas in docs/schema/ are current, and agree with the loaders on example files."""
import copy
import json
from pathlib import Path

import pytest
import yaml

from hethub_jax import schema
from hethub_jax.parallel.plan import Plan

REPO = Path(__file__).resolve().parents[1]
PLANS = sorted((REPO / "configs" / "plans").glob("*.json"))


def test_schema_files_are_current():
    stale = schema.write(check=True)
    assert stale == [], f"regenerate with `python -m hethub_jax.schema`: {stale}"


def test_schema_check_reports_a_stale_file(tmp_path):
    assert sorted(schema.write(tmp_path)) == ["config.schema.json", "plan.schema.json"]
    assert schema.write(tmp_path, check=True) == []
    (tmp_path / "plan.schema.json").write_text("{}\n")
    assert schema.main(["--dir", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_example_plans_match_the_plan_schema(path):
    jsonschema = pytest.importorskip("jsonschema")
    s = json.loads((schema.SCHEMA_DIR / "plan.schema.json").read_text())
    d = json.loads(path.read_text())
    jsonschema.validate(d, s)
    jsonschema.validate(Plan.from_dict(d).to_dict(), s)


def test_plan_schema_rejects_what_the_loader_rejects():
    jsonschema = pytest.importorskip("jsonschema")
    s = json.loads((schema.SCHEMA_DIR / "plan.schema.json").read_text())
    good = Plan.from_json(REPO / "configs" / "plans" / "tiny_2island.json").to_dict()
    short = {k: v for k, v in good.items() if k != "replicas"} | {"stages": good["replicas"][0]["stages"]}
    jsonschema.validate(short, s)  # the "stages" shorthand
    assert Plan.from_dict(short) == Plan.from_dict(good)
    for mutate in (lambda d: d.update(bogus=1), lambda d: d["replicas"][0]["stages"][0].update(tp="2"),
                   lambda d: d["islands"][0].pop("platform"), lambda d: d.update(stages=[])):
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(ValueError):
            Plan.from_dict(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)


def test_tiny_config_matches_the_config_schema():
    jsonschema = pytest.importorskip("jsonschema")
    s = json.loads((schema.SCHEMA_DIR / "config.schema.json").read_text())
    raw = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    jsonschema.validate(raw, s)
    jsonschema.validate({"model": {"preset": "tiny", "num_hidden_layers": 2}}, s)
    for bad in ({"trian": {}}, {"train": {"steps": "3"}}, {"model": {"preset": "tiny", "layers": 2}},
                {"model": "huge"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
