"""The pydantic models of configs and plans: frozen, hashable, strict, closed; errors name the key."""
import pytest

from hethub_jax.config import ConfigError, load_config
from hethub_jax.models.config import PRESETS, LlamaConfig, RopeScaling, get_preset
from hethub_jax.parallel.plan import Plan, StageSpec
from hethub_jax.typed import FieldTypeError

PLAN = {"islands": [{"name": "a", "platform": "cpu", "devices_per_process": 2}],
        "stages": [{"island": "a", "first_layer": 0, "last_layer": 2}, {"island": "a", "first_layer": 3, "last_layer": 5}],
        "global_batch_size": 4, "microbatch_size": 2}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_llama_config_round_trip_and_hash(name):
    cfg = get_preset(name)
    again = LlamaConfig.from_dict(cfg.to_dict())
    assert again == cfg and hash(again) == hash(cfg) and again is not cfg
    assert {cfg: 1}[again] == 1  # usable as a dict key / static argument of a jitted function
    assert cfg.replace(num_hidden_layers=2).num_hidden_layers == 2 and cfg.num_hidden_layers != 2
    with pytest.raises(Exception):
        cfg.hidden_size = 3


def test_rope_scaling_is_a_frozen_hashable_model():
    rs = get_preset("llama3-8b").rope_scaling
    assert isinstance(rs, RopeScaling) and rs.rope_type == "llama3" and rs["factor"] == rs.factor == 8.0
    assert hash(rs) == hash(RopeScaling(**rs.to_dict()))
    with pytest.raises(KeyError):
        RopeScaling(rope_type="linear", factor=2.0)["low_freq_factor"]
    assert RopeScaling.model_validate({"type": "linear", "factor": 2}).to_dict() == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(Exception):
        rs.factor = 1.0


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_size="64"), r"LlamaConfig\.hidden_size must be an integer, got '64'"),
    (dict(tie_word_embeddings=1), r"LlamaConfig\.tie_word_embeddings must be true or false"),
    (dict(num_hidden_layers=2.0), r"LlamaConfig\.num_hidden_layers must be an integer, got 2\.0"),
])
def test_wrong_types_are_type_errors_naming_the_field(kw, match):
    with pytest.raises(FieldTypeError, match=match) as e:
        LlamaConfig(**kw)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


def test_json_int_accepted_where_a_float_is_expected():
    assert LlamaConfig(rope_theta=10000).rope_theta == 10000.0
    assert Plan.from_dict(PLAN | {"islands": [PLAN["islands"][0] | {"slowdown": 3}]}).islands[0].slowdown == 3.0
    with pytest.raises(ValueError, match=r"islands\[0\]\.slowdown must be a finite number, got '3'"):
        Plan.from_dict(PLAN | {"islands": [PLAN["islands"][0] | {"slowdown": "3"}]})  # JSON: no YAML floats


def test_yaml_1_1_floats_only_where_a_float_is_expected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {learning_rate: 3e-3, eps: 1e-8}\nmodel: {preset: tiny, rms_norm_eps: 1e-5}\n")
    cfg = load_config(path)  # PyYAML reads 3e-3 as the string '3e-3'
    assert (cfg.optim.learning_rate, cfg.optim.eps, cfg.model.rms_norm_eps) == (3e-3, 1e-8, 1e-5)
    path.write_text("train: {steps: 1e2}\n")
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer >= 1, got '1e2'"):
        load_config(path)


def test_plan_models_hashable_frozen_and_positions_not_in_json():
    p = Plan.from_dict(PLAN)
    assert hash(p) == hash(Plan.from_dict(PLAN)) and p == Plan.from_json(p.to_json())
    assert [s.index for s in p.replicas[0].stages] == [0, 1] and p.replicas[0].stages[1].is_last
    assert "index" not in p.to_dict()["replicas"][0]["stages"][0] and "description" not in p.to_dict()
    assert StageSpec(island="a", first_layer=0, last_layer=1).index == 0  # a stage on its own
    with pytest.raises(ValueError, match=r"unknown key 'index' in replicas\[0\]\.stages\[0\]"):
        Plan.from_dict(PLAN | {"stages": [PLAN["stages"][0] | {"index": 1}, PLAN["stages"][1]]})
    with pytest.raises(Exception):
        p.microbatch_size = 1
    q = p.replace(global_batch_size=8)
    assert q.global_batch_size == 8 and p.global_batch_size == 4 and q.replicas == p.replicas
    with pytest.raises(ValueError, match=r"global_batch_size must be an integer, got '8'"):
        p.replace(global_batch_size="8")


def test_nested_errors_name_the_path():
    bad = PLAN | {"stages": [PLAN["stages"][0], PLAN["stages"][1] | {"devices": [0, "1"]}]}
    with pytest.raises(ValueError, match=r"replicas\[0\]\.stages\[1\]\.devices\[1\] must be an integer, got '1'"):
        Plan.from_dict(bad)
    with pytest.raises(ValueError, match=r"^plan must be a JSON object"):
        Plan.from_dict([PLAN])
    with pytest.raises(ValueError, match=r"^model: LlamaConfig\.rope_scaling \(llama3\) is missing"):
        load_config(None, ["model.rope_scaling={rope_type: llama3, factor: 8}"])
