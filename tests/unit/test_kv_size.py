"""`kv-size` and `ModelSpec.kv_bytes` equal the reference byte tables for every preset, bf16 and fp32 state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.models.spec import ModelSpec, list_presets, load_model_spec

LENGTHS = {"1K": 1024, "8K": 8192, "32K": 32768, "128K": 131072}


def _reference(test_data: Path) -> list[dict]:
    return json.loads((test_data / "model-configs.json").read_text())


def _preset(hf_repo: str) -> ModelSpec:
    specs = [s for s in map(load_model_spec, list_presets()) if s.hf_repo == hf_repo]
    assert len(specs) == 1, hf_repo
    return specs[0]


def _md_table(text: str, heading: str) -> dict[str, list[int]]:
    """Rows of the markdown table after `heading`: first cell -> the integer cells (commas removed)."""
    lines = text[text.index(heading):].splitlines()[1:]
    rows: dict[str, list[int]] = {}
    for line in lines:
        if not line.strip():
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("Model", "") or set(cells[0]) <= set("-"):
            continue
        rows[cells[0]] = [int(re.sub(r"[,+]", "", c.split()[0])) for c in cells[1:]]
    return rows


def _entry_for_md_name(entries: list[dict], md_name: str) -> dict:
    matches = [e for e in entries if e["model"].startswith(md_name)]
    assert len(matches) == 1, md_name
    return matches[0]


def test_every_preset_matches_the_json_totals_bf16_and_fp32_state(test_data: Path) -> None:
    entries = _reference(test_data)
    assert len(entries) == 9
    for entry in entries:
        spec = _preset(entry["hf_repo"])
        for label, tokens in LENGTHS.items():
            assert entry["token_counts"][label] == tokens
            assert spec.kv_bytes(tokens).total_bytes == entry["total_bytes_bf16"][label], (spec.name, label)
            fp32 = spec.kv_bytes(tokens, state_dtype="float32").total_bytes
            assert fp32 == entry["total_bytes_conv_bf16_recurrent_fp32"][label], (spec.name, label)
        b = spec.kv_bytes(4096)
        assert b.fixed_state_bytes == entry["fixed_state_bytes_per_request_bf16"], spec.name
        assert spec.full_attention_bytes_per_token == entry["kv_bytes_per_token_full_attention_bf16"], spec.name
        assert spec.kv_bytes(4096, "float32").fixed_state_bytes == entry["fixed_state_bytes_per_request_conv_bf16_recurrent_fp32"]
        window = entry["swa_window_tokens"] or 0
        assert b.window_bytes == min(4096, window) * entry["swa_bytes_per_token_bf16"], spec.name


def test_every_preset_matches_the_markdown_exact_byte_tables(test_data: Path) -> None:
    text = (test_data / "model-configs.md").read_text()
    entries = _reference(test_data)
    exact = _md_table(text, "Exact byte totals (bf16):")
    assert len(exact) == 9
    fp32_rows = _md_table(text, "| Model | bf16 state | conv bf16 + recurrent fp32 |")
    assert len(fp32_rows) == 4
    for md_name, totals in exact.items():
        spec = _preset(_entry_for_md_name(entries, md_name)["hf_repo"])
        delta = fp32_rows.get(md_name, [0, 0, 0])[2]
        for tokens, total in zip(LENGTHS.values(), totals):
            assert spec.kv_bytes(tokens).total_bytes == total, (md_name, tokens)
            assert spec.kv_bytes(tokens, "float32").total_bytes == total + delta, (md_name, tokens)
        if md_name in fp32_rows:
            bf16_state, fp32_state, _ = fp32_rows[md_name]
            assert spec.kv_bytes(1).fixed_state_bytes == bf16_state
            assert spec.kv_bytes(1, "float32").fixed_state_bytes == fp32_state


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["kv-size", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("state_dtype,key", [(None, "total_bytes_bf16"), ("float32", "total_bytes_conv_bf16_recurrent_fp32")])
def test_cli_json_total_bytes_for_every_preset(capsys: pytest.CaptureFixture[str], test_data: Path, state_dtype: str | None, key: str) -> None:
    for entry in _reference(test_data):
        name = _preset(entry["hf_repo"]).name
        for label in LENGTHS:
            extra = ["--state-dtype", state_dtype] if state_dtype else []
            rc, out, _ = _run(capsys, "--model", name, "--tokens", label, "--json", *extra)
            assert rc == 0
            r = json.loads(out)
            assert r["total_bytes"] == entry[key][label], (name, label)
            assert r["total_bytes"] == r["full_attention_bytes"] + r["fixed_state_bytes"] + r["window_bytes"]
            assert sum(v["bytes"] for v in r["by_kind"].values()) == r["total_bytes"]


def test_cli_text_shows_parts_and_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "--model", "kimi-linear-48b", "--tokens", "32K")
    assert rc == 0
    assert re.search(r"full attention\s+264,241,152 B", out)
    assert re.search(r"fixed state\s+22,446,080 B", out)
    assert re.search(r"total\s+286,687,232 B", out)
    assert re.search(r"linear\s+20 layers\s+22,446,080 B", out)
    assert re.search(r"mla\s+7 layers\s+264,241,152 B", out)
    rc, out, _ = _run(capsys, "--model", "mimo-v2-flash", "--tokens", "32768")
    assert re.search(r"sliding window\s+25,559,040 B", out)


def test_cli_reads_a_spec_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "two.yaml"
    f.write_text("name: two\nlayers:\n  - {kind: gqa, kv_heads: 1, head_dim: 4}\n  - {kind: linear, heads: 1, key_dim: 2}\n")
    rc, out, _ = _run(capsys, "--model", str(f), "--tokens", "10", "--json")
    r = json.loads(out)
    assert (rc, r["full_attention_bytes"], r["fixed_state_bytes"], r["total_bytes"]) == (0, 10 * 8 * 2, 8, 168)


BAD_ARGS = [
    (["--tokens", "1K"], "--model is required"),
    (["--model", "kimi-linear-48b"], "--tokens is required"),
    (["--model", "gpt-17", "--tokens", "1K"], "not a preset and no such file"),
    (["--model", "kimi-linear-48b", "--tokens", "lots"], "--tokens: 'lots' is not a whole number of tokens"),
    (["--model", "kimi-linear-48b", "--tokens", "-5"], "--tokens"),
    (["--model", "kimi-linear-48b", "--tokens", "1K", "--state-dtype", "int8"],
     "--state-dtype: 'int8' is not a state dtype; use one of: float32, bfloat16, float16, float8_e4m3fn"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_cli_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    assert err.startswith("prfaas kv-size: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_spec_file_names_file_and_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nlayers:\n  - {kind: gqa, kv_heads: 2, head_dim: 9}\n")
    rc, _, err = _run(capsys, "--model", str(f), "--tokens", "1K")
    assert rc == 2
    assert f"{f}: layers[0].head_dim:" in err and "even" in err


def test_every_preset_appears_in_the_help_listing() -> None:
    from testbed.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["kv-size"]  # type: ignore[union-attr]
    for name in list_presets():
        assert name in sub.description


@pytest.mark.parametrize("given,dtype,state_bytes", [("float16", "float16", 2), ("fp8", "float8_e4m3fn", 1), ("fp32", "float32", 4)])
def test_state_dtype_takes_what_a_spec_file_and_a_scenario_take(capsys: pytest.CaptureFixture[str], given: str, dtype: str,
                                                                 state_bytes: int) -> None:
    """--state-dtype is read by spec.parse_state_dtype, as a spec file's and model.state_dtype are: it refused float16
    and fp8 (its own table) before 2026-12-07."""
    spec = load_model_spec("kimi-linear-48b")
    rc, out, _ = _run(capsys, "--model", "kimi-linear-48b", "--tokens", "1K", "--state-dtype", given, "--json")
    r = json.loads(out)
    assert (rc, r["state_dtype"]) == (0, dtype)
    recurrent = sum(layer.heads * layer.key_dim * layer.value_dim for layer in spec.layers if layer.kind == "linear")
    assert r["fixed_state_bytes"] == spec.kv_bytes(1024, "bfloat16").fixed_state_bytes + recurrent * (state_bytes - 2)


def test_a_state_dtype_that_takes_a_request_past_the_wire_bound_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--state-dtype float32 doubles the state of a spec at spec.MAX_REQUEST_KV_BYTES (2^62 B at 16M tokens in bf16)."""
    f = tmp_path / "edge.yaml"
    f.write_text("name: edge\ngeometries:\n  big: {kind: linear, heads: 1048576, key_dim: 1048576, value_dim: 1048576}\n"
                 "layers: [big, big]\n")
    rc, _, _ = _run(capsys, "--model", str(f), "--tokens", "1")
    assert rc == 0
    rc, _, err = _run(capsys, "--model", str(f), "--tokens", "1", "--state-dtype", "fp32")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("prfaas kv-size: error: --state-dtype float32: a request of 16,777,216 tokens (units.MAX_TOKENS, the longest) "
                          "caches 9.22e+18 bytes")
