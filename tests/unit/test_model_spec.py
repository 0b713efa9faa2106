"""Model specs: presets match the reference geometry; bad spec files and model sections get clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testbed.errors import FieldError, UserError
from testbed.models.spec import (
    GQALayer,
    LinearLayer,
    MLALayer,
    ModelSection,
    SWALayer,
    list_presets,
    load_model_spec,
    parse_model_section,
    parse_model_spec,
)
from testbed.validation import Fields

REQUIRED_PRESETS = {
    "kimi-linear-48b", "mimo-v2-flash", "qwen3.5-397b", "qwen3-next-80b", "ring-2.5-1t",
    "minimax-m2.5", "qwen3-235b", "deepseek-v3", "llama-3.1-70b", "paper-1t-hybrid",
}


def reference_models(test_data: Path) -> list[dict]:
    return json.loads((test_data / "model-configs.json").read_text())


def preset_for(entry: dict):
    """The preset whose hf_repo is the reference entry's."""
    matches = [load_model_spec(n) for n in list_presets() if load_model_spec(n).hf_repo == entry["hf_repo"]]
    assert len(matches) == 1, f"expected exactly one preset for {entry['hf_repo']}, found {len(matches)}"
    return matches[0]


def test_every_required_preset_is_listed() -> None:
    assert REQUIRED_PRESETS <= set(list_presets())


def test_every_reference_model_has_a_preset_with_its_layer_pattern(test_data: Path) -> None:
    for entry in reference_models(test_data):
        spec = preset_for(entry)
        pattern = entry["layer_pattern"]
        assert len(spec.layers) == entry["num_hidden_layers"], spec.name
        counts = spec.count_by_kind()
        assert counts.get("linear", 0) == pattern["num_linear"], spec.name
        assert counts.get("swa", 0) == pattern["num_swa"], spec.name
        full = [i for i, layer in enumerate(spec.layers) if layer.kind in ("gqa", "mla")]
        want = list(range(len(spec.layers))) if pattern["full_attention_layers_0idx"] == "all" else pattern["full_attention_layers_0idx"]
        assert full == want, spec.name


def test_preset_geometries_match_the_reference_fields(test_data: Path) -> None:
    for entry in reference_models(test_data):
        spec = preset_for(entry)
        full = next(layer for layer in spec.layers if layer.kind in ("gqa", "mla"))
        if isinstance(full, MLALayer):
            assert (full.kv_lora_rank, full.rope_dim) == (entry["full"]["kv_lora_rank"], entry["full"]["qk_rope_head_dim"])
        else:
            assert isinstance(full, GQALayer)
            assert (full.kv_heads, full.k_head_dim, full.v_head_dim) == (
                entry["full"]["num_kv_heads"], entry["full"]["head_dim_k"], entry["full"]["head_dim_v"])
        if entry["linear"]:
            lin = next(layer for layer in spec.layers if isinstance(layer, LinearLayer))
            assert [lin.heads, lin.key_dim, lin.value_dim] == entry["linear"]["recurrent_state_shape_per_layer"]
            conv = entry["linear"]["conv_state_shape_per_layer"]
            assert ([lin.conv_kernel - 1, lin.conv_channels] if lin.conv_kernel else None) == conv
        if entry["swa"]:
            swa = next(layer for layer in spec.layers if isinstance(layer, SWALayer))
            assert (swa.window, swa.kv_heads, swa.k_head_dim, swa.v_head_dim) == (
                entry["swa"]["window"], entry["swa"]["num_kv_heads"], entry["swa"]["head_dim_k"], entry["swa"]["head_dim_v"])


def test_paper_1t_hybrid_fits_table_5_within_2_percent_with_kda_mla_3_to_1() -> None:
    spec = load_model_spec("paper-1t-hybrid")
    counts = spec.count_by_kind()
    assert counts == {"linear": 45, "mla": 15}
    assert all(spec.layers[i].kind == "mla" for i in range(3, 60, 4))
    table5_mib = {1024: 190.8, 8192: 308.9, 32768: 701.3, 131072: 2316.3}
    for tokens, mib in table5_mib.items():
        got = spec.kv_bytes(tokens).total_bytes / 2**20
        assert abs(got / mib - 1) < 0.02, (tokens, got, mib)


def test_preset_lookup_is_case_insensitive_and_files_work(tmp_path: Path) -> None:
    assert load_model_spec("Kimi-Linear-48B").name == "kimi-linear-48b"
    f = tmp_path / "mine.yaml"
    f.write_text(yaml.safe_dump({"geometries": {"a": {"kind": "gqa", "kv_heads": 2, "head_dim": 64}}, "layers": ["a", "a"]}))
    spec = load_model_spec(str(f))
    assert spec.name == "mine" and len(spec.layers) == 2
    assert spec.kv_bytes(10).total_bytes == 2 * 10 * 2 * 2 * 64 * 2


def test_inline_layers_and_repeat_expand_in_order() -> None:
    spec = parse_model_spec({
        "name": "mix",
        "geometries": {"l": {"kind": "linear", "heads": 2, "key_dim": 4}, "m": {"kind": "mla", "kv_lora_rank": 8, "rope_dim": 2}},
        "layers": [{"repeat": 2, "pattern": ["l", "m"]}, {"kind": "swa", "window": 4, "kv_heads": 1, "head_dim": 4}, "l"],
    })
    assert [layer.kind for layer in spec.layers] == ["linear", "mla", "linear", "mla", "swa", "linear"]
    lin = spec.layers[0]
    assert isinstance(lin, LinearLayer) and lin.value_dim == 4 and lin.qk_heads == 2 and lin.conv_channels == 0


def test_layer_bytes_of_each_kind() -> None:
    spec = parse_model_spec({
        "name": "k", "kv_dtype": "bf16", "state_dtype": "fp32",
        "layers": [
            {"kind": "linear", "heads": 2, "qk_heads": 1, "key_dim": 4, "value_dim": 8, "conv_kernel": 3},
            {"kind": "gqa", "kv_heads": 2, "k_head_dim": 6, "v_head_dim": 4},
            {"kind": "mla", "kv_lora_rank": 8, "rope_dim": 2},
            {"kind": "swa", "window": 5, "kv_heads": 1, "head_dim": 4},
        ],
    })
    # linear: state 2x4x8 fp32 + conv (3-1) x (2*1*4 + 2*8) bf16
    assert spec.layer_bytes(0, 100) == 2 * 4 * 8 * 4 + 2 * 24 * 2
    assert spec.layer_bytes(1, 10) == 10 * 2 * (6 + 4) * 2
    assert spec.layer_bytes(2, 10) == 10 * (8 + 2) * 2
    assert spec.layer_bytes(3, 3) == 3 * 1 * 8 * 2
    assert spec.layer_bytes(3, 100) == 5 * 1 * 8 * 2
    assert spec.layer_bytes(0, 100, state_dtype="bfloat16") == 2 * 4 * 8 * 2 + 2 * 24 * 2
    b = spec.kv_bytes(100)
    assert b.full_attention_bytes == spec.layer_bytes(1, 100) + spec.layer_bytes(2, 100)
    assert b.fixed_state_bytes == spec.layer_bytes(0, 100)
    assert b.window_bytes == spec.layer_bytes(3, 100)
    assert b.total_bytes == sum(b.by_kind.values())


GOOD_LINEAR = {"kind": "linear", "heads": 4, "key_dim": 8}

BAD_SPECS = [
    ({"layers": ["a"]}, "name", "is required"),
    ({"name": "x"}, "layers", "non-empty list"),
    ({"name": "x", "layers": []}, "layers", "non-empty list"),
    ({"name": "x", "layers": ["nope"]}, "layers[0]", "not a geometry name"),
    ({"name": "x", "layers": [{"kind": "conv"}]}, "layers[0].kind", "use one of: linear, gqa, mla, swa"),
    ({"name": "x", "layers": [{"kind": "gqa", "kv_heads": 0, "head_dim": 8}]}, "layers[0].kv_heads", ">= 1"),
    ({"name": "x", "layers": [{"kind": "gqa", "kv_heads": 2, "head_dim": 7}]}, "layers[0].head_dim", "even"),
    ({"name": "x", "layers": [{"kind": "gqa", "kv_heads": 2, "head_dim": 8, "v_head_dim": 8}]}, "layers[0].head_dim", "either head_dim"),
    ({"name": "x", "layers": [{"kind": "gqa", "kv_heads": 2, "head_dim": 8, "heads": 3}]}, "layers[0].heads", "unknown key"),
    ({"name": "x", "layers": [{"kind": "swa", "kv_heads": 2, "head_dim": 8}]}, "layers[0].window", "is required"),
    ({"name": "x", "layers": [{"kind": "mla", "kv_lora_rank": "big", "rope_dim": 64}]}, "layers[0].kv_lora_rank", "whole number"),
    ({"name": "x", "layers": [{**GOOD_LINEAR, "qk_heads": 3}]}, "layers[0].qk_heads", "must divide heads"),
    ({"name": "x", "layers": [{**GOOD_LINEAR, "conv_kernel": 1}]}, "layers[0].conv_kernel", "use 0"),
    ({"name": "x", "layers": [{**GOOD_LINEAR, "conv_kernel": 4, "conv_channels": 100}]}, "layers[0].conv_channels", "= 96"),
    ({"name": "x", "layers": [{**GOOD_LINEAR, "rule": "mamba"}]}, "layers[0].rule", "delta, decay"),
    ({"name": "x", "kv_dtype": "int4", "layers": [GOOD_LINEAR]}, "kv_dtype", "not a cache dtype"),
    ({"name": "x", "geometries": {"a": GOOD_LINEAR}, "layers": [{"repeat": 0, "pattern": ["a"]}]}, "layers[0].repeat", ">= 1"),
    ({"name": "x", "geometries": {"a": GOOD_LINEAR}, "layers": [{"repeat": 2, "pattern": ["a", "b"]}]}, "layers[0].pattern[1]", "defined: a"),
    ({"name": "x", "geometries": {"a": {"kind": "gqa"}}, "layers": ["a"]}, "geometries.a.kv_heads", "is required"),
    ({"name": "x", "layers": [GOOD_LINEAR], "hidden": 4}, "hidden", "unknown key"),
    ({"name": "x", "geometries": {"a": GOOD_LINEAR}, "layers": [{"repeat": 5000, "pattern": ["a"]}]}, "layers", "at most 4096"),
    # past any model: an OverflowError traceback (repeat) or accepted (rope_dim 1e400-sized) before 2026-12-07
    ({"name": "x", "geometries": {"a": GOOD_LINEAR}, "layers": [{"repeat": 10**400, "pattern": ["a"]}]}, "layers[0].repeat",
     "a 401-digit number is more than 16777216"),
    ({"name": "x", "layers": [{"kind": "mla", "kv_lora_rank": 512, "rope_dim": 2 * 10**30}]}, "layers[0].rope_dim", "is more than 16777216"),
    ({"name": "x", "geometries": {"a": GOOD_LINEAR}, "layers": [{"repeat": 4000, "pattern": ["a", "a"]}]}, "layers",
     "layers[0]: 4000 x 2 layers makes more than 4096"),
    ({"name": "", "layers": [GOOD_LINEAR]}, "name", "is not a non-empty string"),
    ({"name": "x", "description": ["a"], "layers": [GOOD_LINEAR]}, "description", "is not a string"),
]


@pytest.mark.parametrize("data,field,message", BAD_SPECS, ids=[f"{b[1]}:{b[2]}" for b in BAD_SPECS])
def test_bad_spec_is_rejected_naming_the_field(data: dict, field: str, message: str) -> None:
    with pytest.raises(FieldError) as err:
        parse_model_spec(data, "spec.yaml")
    assert err.value.field == field
    assert message in str(err.value)
    assert str(err.value).startswith("spec.yaml: ")


def test_bad_spec_files_give_one_line_user_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match=r"bad.yaml: not valid YAML at line \d+"):
        load_model_spec(str(bad))
    with pytest.raises(UserError, match="not a preset and no such file; presets: deepseek-v3"):
        load_model_spec("no-such-model")
    with pytest.raises(UserError, match="mapping"):
        bad.write_text("- 1\n- 2\n")
        load_model_spec(str(bad))


def test_model_section_resolves_preset_and_defaults() -> None:
    section = parse_model_section(Fields({"name": "ring-2.5-1t"}, "model"))
    assert isinstance(section, ModelSection)
    assert (section.compute, section.variant, section.device, section.seed, section.state_dtype) == ("torch", "tiny", "auto", None, "bfloat16")
    assert section.spec.name == "ring-2.5-1t"
    fp32 = parse_model_section(Fields({"name": "kimi-linear-48b", "state_dtype": "float32", "compute": "profile",
                                       "variant": "faithful", "device": "cpu", "seed": 7, "profile": "h200-kimi"}, "model"))
    assert fp32.spec.kv_bytes(1024).total_bytes == 51675136  # the reference's recurrent-fp32 figure
    assert (fp32.compute, fp32.variant, fp32.device, fp32.seed, fp32.profile) == ("profile", "faithful", "cpu", 7, "h200-kimi")


def test_model_section_finds_a_spec_file_beside_the_scenario(tmp_path: Path) -> None:
    (tmp_path / "my.yaml").write_text(yaml.safe_dump({"name": "my", "layers": [{"kind": "mla", "kv_lora_rank": 4, "rope_dim": 2}]}))
    section = parse_model_section(Fields({"name": "my.yaml"}, "model", str(tmp_path / "scenario.yaml")))
    assert section.spec.name == "my"


BAD_SECTIONS = [
    ({}, "model.name", "is required"),
    ({"name": "gpt-17"}, "model.name", "not a preset"),
    ({"name": "kimi-linear-48b", "compute": "gpu"}, "model.compute", "torch, profile"),
    ({"name": "kimi-linear-48b", "variant": "huge"}, "model.variant", "faithful, tiny"),
    ({"name": "kimi-linear-48b", "device": "tpu"}, "model.device", "auto, cpu, cuda"),
    ({"name": "kimi-linear-48b", "state_dtype": "int8"}, "model.state_dtype", "'int8' is not a state dtype; use one of: float32, bfloat16, float16, float8_e4m3fn"),
    ({"name": "kimi-linear-48b", "seed": -1}, "model.seed", "use a whole number from 0 to 4294967295"),
    ({"name": "kimi-linear-48b", "hidden": 12}, "model.hidden", "unknown key"),
]


@pytest.mark.parametrize("data,field,message", BAD_SECTIONS, ids=[b[1] + ":" + b[2] for b in BAD_SECTIONS])
def test_bad_model_section_is_rejected_naming_the_field(data: dict, field: str, message: str) -> None:
    with pytest.raises(FieldError) as err:
        parse_model_section(Fields(data, "model"))
    assert err.value.field == field
    assert message in str(err.value)


def test_a_scenario_file_with_a_model_section_gets_a_typed_section(tmp_path: Path) -> None:
    from testbed.sections import load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "wan": {"rate": "10Gbps"}, "model": {"name": "qwen3.5-397b", "variant": "faithful", "state_dtype": "fp32"}}))
    section = load_scenario(str(path)).section("model")
    assert isinstance(section, ModelSection)
    assert section.spec.kv_bytes(131072).total_bytes == 4218593280  # reference: Qwen3.5 at 128K, recurrent fp32
    path.write_text(yaml.safe_dump({"name": "s", "wan": {"rate": "10Gbps"}, "model": {"name": "qwen3.5-397b", "variant": "big"}}))
    with pytest.raises(FieldError, match="model.variant: 'big' is not allowed; use one of: faithful, tiny"):
        load_scenario(str(path))


def test_a_model_file_that_is_no_mapping_is_named_as_the_file_not_a_scenario(tmp_path: Path) -> None:
    """It said "scenario: must be a mapping" (the label of a scenario file) until 2026-12-07."""
    path = tmp_path / "m.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(UserError) as exc:
        load_model_spec(str(path))
    assert str(exc.value) == f"{path}: top level: must be a mapping of keys to values, got list"


@pytest.mark.parametrize("name, message", [("../x", "is not a plain name"), ("a" * 300, "at most 200 bytes")])
def test_a_spec_name_is_a_plain_name(tmp_path: Path, name: str, message: str) -> None:
    """The KV trailer carries the name in at most 255 bytes, and a measured profile names its model by it: '../x' and
    300 characters passed prfaas check, and a run's first transfer failed."""
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({"name": name, "layers": [{"kind": "mla", "kv_lora_rank": 4, "rope_dim": 2}]}))
    with pytest.raises(FieldError, match=rf"my.yaml: name: .*{message}"):
        load_model_spec(str(path))
    path.write_text(yaml.safe_dump({"layers": [{"kind": "mla", "kv_lora_rank": 4, "rope_dim": 2}]}))
    assert load_model_spec(str(path)).name == "my"  # no name: the file's
    long = tmp_path / f"{'b' * 230}.yaml"
    path.rename(long)
    with pytest.raises(FieldError, match="name: not given, and the file's name cannot stand for it"):
        load_model_spec(str(long))


def test_a_folder_named_as_a_model_is_said_to_be_a_folder(tmp_path: Path) -> None:
    (tmp_path / "my.yaml").mkdir()
    with pytest.raises(UserError, match=r"my.yaml is a folder; name a preset or a YAML spec file"):  # "no such file" before
        load_model_spec(str(tmp_path / "my.yaml"))


def test_a_missing_model_of_a_long_name_is_shown_by_its_start_and_length() -> None:
    """A 5000-character name that is no model was echoed whole (2026-12-07); it is shown as other long values are."""
    with pytest.raises(UserError) as err:
        load_model_spec("m" * 5000)
    assert f"model {'m' * 60!r}... (5000 characters): not a preset and no such file" in str(err.value)
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("layer,field,message", [
    ({**GOOD_LINEAR, "key_dim": 2**24 + 1}, "key_dim",
     "16777217 is more than 16777216, the largest size in a model spec (spec.MAX_SIZE, 2^24: past any model)"),
    ({**GOOD_LINEAR, "conv_kernel": 2**24 + 1}, "conv_kernel", "16777217 is more than 16777216, the largest size"),
    ({**GOOD_LINEAR, "conv_kernel": -1}, "conv_kernel", "-1 is not a whole number >= 0"),
    ({**GOOD_LINEAR, "heads": 2.5}, "heads", "2.5 is not a whole number >= 1"),
])
def test_a_size_is_read_by_validations_bounded_readers(layer: dict, field: str, message: str) -> None:
    """Sizes are validation.count_up_to / at_most(whole_number) with spec.MAX_SIZE (spec._whole repeated them until
    2026-12-07): the same words as every other bounded count."""
    with pytest.raises(FieldError) as err:
        parse_model_spec({"name": "x", "layers": [layer]}, "spec.yaml")
    assert err.value.field == f"layers[0].{field}"
    assert message in str(err.value)


def test_a_state_dtype_is_read_alike_in_a_spec_file_a_layer_and_a_scenario() -> None:
    """One reader (spec.parse_state_dtype), one set (every cache dtype): a spec file took fp8 and model.state_dtype
    refused it before 2026-12-07."""
    linear = {**GOOD_LINEAR, "state_dtype": "fp8"}
    spec = parse_model_spec({"name": "x", "state_dtype": "fp8", "layers": [linear, GOOD_LINEAR]}, "spec.yaml")
    assert [spec.layer_state_dtype(i) for i in range(2)] == ["float8_e4m3fn"] * 2
    section = parse_model_section(Fields({"name": "kimi-linear-48b", "state_dtype": "fp8"}, "model"))
    assert section.state_dtype == section.spec.state_dtype == "float8_e4m3fn"
    for where in ({"name": "x", "state_dtype": "int8", "layers": [GOOD_LINEAR]}, {"name": "x", "layers": [{**GOOD_LINEAR, "state_dtype": "int8"}]}):
        with pytest.raises(FieldError, match="'int8' is not a state dtype; use one of: float32, bfloat16, float16, float8_e4m3fn"):
            parse_model_spec(where, "spec.yaml")


# two linear layers of 2^60 state elements: 2^62 bytes in bf16, the most a request may cache (spec.MAX_REQUEST_KV_BYTES)
AT_THE_BOUND = {"name": "edge", "geometries": {"big": {"kind": "linear", "heads": 2**20, "key_dim": 2**20, "value_dim": 2**20}},
                "layers": ["big", "big"]}


def test_a_spec_caching_more_than_the_wire_counts_at_the_longest_request_is_refused(tmp_path: Path) -> None:
    """Each size was bounded and their product not: heads = key_dim = value_dim = 2^24 (2^73 B of state per request)
    passed, and prfaas check gave a Lambda_max of 1e-14/s (2026-12-07). A request of units.MAX_TOKENS tokens caches at
    most spec.MAX_REQUEST_KV_BYTES (2^62): the refusal names the file, the field and the bytes."""
    from testbed.models.spec import MAX_REQUEST_KV_BYTES

    huge = {"name": "huge", "layers": [{"kind": "linear", "heads": 2**24, "key_dim": 2**24, "value_dim": 2**24},
                                       {"kind": "mla", "kv_lora_rank": 512, "rope_dim": 64}]}
    with pytest.raises(FieldError) as err:
        parse_model_spec(huge, "huge.yaml")
    assert err.value.field == "layers"
    assert str(err.value).startswith("huge.yaml: layers: a request of 16,777,216 tokens (units.MAX_TOKENS, the longest) caches "
                                     "9.44e+21 bytes (full attention 1.93e+10, fixed state 9.44e+21, window 0), more than 2^62")
    assert "the largest layer, 0 (linear), caches 9.44e+21" in str(err.value) and "\n" not in str(err.value)
    edge = parse_model_spec(AT_THE_BOUND, "edge.yaml")  # at the bound, not past it
    assert edge.kv_bytes(2**24).total_bytes == MAX_REQUEST_KV_BYTES
    # a state dtype that doubles the state: the scenario's model.state_dtype
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(AT_THE_BOUND))
    with pytest.raises(FieldError) as err:
        parse_model_section(Fields({"name": "edge.yaml", "state_dtype": "float32"}, "model", str(tmp_path / "scenario.yaml")))
    assert err.value.field == "model.state_dtype" and "float32 state: a request of 16,777,216 tokens" in str(err.value)


def test_a_conv_state_wider_than_a_size_is_refused() -> None:
    """conv_channels (2 x qk_heads x key_dim + heads x value_dim) is a cached tensor's dimension, u32 on the wire: 2^49
    passed before 2026-12-07 (its bytes are within the request bound)."""
    layer = {"kind": "linear", "heads": 2**24, "key_dim": 2**24, "value_dim": 1, "qk_heads": 2**24, "conv_kernel": 2}
    with pytest.raises(FieldError) as err:
        parse_model_spec({"name": "conv", "layers": [layer]}, "conv.yaml")
    assert err.value.field == "layers[0].conv_channels"
    assert "width 2 x qk_heads x key_dim + heads x value_dim is 562949970198528, more than 16777216" in str(err.value)
