"""benchmarks/gpu_check.py (issue 12 item 7): without CUDA it checks nothing, says so and exits 0; its checks
run for real on the CPU (workers in torch mode on 127.0.0.1, KV over the real transport, prefix reuse)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda: this host has CUDA, so the no-CUDA path does not apply")
def test_without_cuda_nothing_is_checked_it_says_so_and_exits_0(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    assert gpu_check().main(["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["result"] for r in doc["rows"]] == ["not checked"] * 5
    assert "Nothing was checked: no CUDA device" in doc["summary"] and "Nothing was checked" in capsys.readouterr().out


def test_under_python_O_it_refuses_to_run_rather_than_pass_every_check() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-O", str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "python -O removes" in r.stdout, r.stdout + r.stderr


def test_the_same_checks_pass_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = gpu_check().main(["--device", "cpu", "--variant", "tiny", "--tokens", "530", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert [r["result"] for r in doc["rows"]] == ["pass"] * 5
    assert "= local" in doc["rows"][3]["detail"] and "near tie" not in doc["rows"][3]["detail"]  # one device: exact
    import re

    within = re.search(r"received cache = local prefill's within ([0-9.e+-]+);", doc["rows"][3]["detail"])
    assert within and float(within.group(1)) < 1e-5
    assert "512 of" in doc["rows"][4]["detail"] and "= a full prefill's" in doc["rows"][4]["detail"]
    assert "near tie" not in doc["rows"][4]["detail"]


def test_tokens_are_judged_teacher_forced_and_only_one_near_tie_may_differ() -> None:
    """Checks 4 and 5 (float32 caches) accept a worker's token that is not the local greedy choice only within
    NEAR_TIE_LOGITS of the top logit, once; a token from a wrong cache fails, naming its step."""
    mod = gpu_check()
    model = mod.build_model(mod.float32_spec(mod.load_model_spec("kimi-linear-48b")), "tiny", 1, "cpu")
    ids = mod.prompt(200, model.vocab_size, 3)
    greedy = model.generate(ids, 4)
    assert mod.greedy_margins(model, ids, greedy) == [0.0] * 4
    assert mod.judge_tokens(greedy, [0.0] * 4, "local") == f"tokens {greedy} = local"
    logits, cache = model.prefill(ids)
    for tok in greedy[:3]:
        logits = model.decode(tok, cache)[None]
    worst = int(logits[-1].argmin())  # the last token replaced by the local model's least likely one
    margins = mod.greedy_margins(model, ids, greedy[:3] + [worst])
    assert margins[:3] == [0.0] * 3
    assert margins[3] == pytest.approx(float(logits[-1].max() - logits[-1].min()), abs=1e-5) and margins[3] > 1.0
    with pytest.raises(AssertionError, match=r"step 3: token %d is [0-9.]+ below the top logit" % worst):
        mod.judge_tokens(greedy[:3] + [worst], margins, "local")
    tie = mod.NEAR_TIE_LOGITS / 2
    assert mod.judge_tokens([7, 8, 9], [0.0, tie, 0.0], "local").startswith(
        "tokens [7, 8, 9] = local but for 1 near tie(s) (step 1: 0.0005 below the top")
    with pytest.raises(AssertionError, match="step 1"):
        mod.judge_tokens([7, 8], [0.0, mod.NEAR_TIE_LOGITS * 1.01], "local")
    with pytest.raises(AssertionError, match="at 2 steps, each a near tie"):
        mod.judge_tokens([7, 8, 9], [tie, 0.0, tie], "local")


def test_a_wrong_prefix_block_that_changes_tokens_fails_the_token_judge() -> None:
    """Check 5's case: the first 512-token block from another prompt. Decoded from that cache, the tokens differ
    (seed chosen so that they do: a wrong distant block often leaves a random-weight model's greedy tokens as they
    were, which no token check can see; the cache comparison below is what catches those) and the judge fails them."""
    mod = gpu_check()
    model = mod.build_model(mod.float32_spec(mod.load_model_spec("kimi-linear-48b")), "tiny", 1, "cpu")
    ids = mod.prompt(600, model.vocab_size, 100)
    wrong = mod.prompt(512, model.vocab_size, 500) + ids[512:]
    got = model.generate(wrong, 6)
    assert got != model.generate(ids, 6)
    with pytest.raises(AssertionError, match="below the top logit|each a near tie"):
        mod.judge_tokens(got, mod.greedy_margins(model, ids, got), "a full prefill's")
    assert mod.near_tie_tolerance(0.0) == 1e-5 and mod.near_tie_tolerance(2e-6) == pytest.approx(2e-5)
    assert mod.near_tie_tolerance(1.0) == mod.NEAR_TIE_LOGITS


def test_a_decode_that_joins_a_wrong_prefix_fails_check_5_by_its_cache(tmp_path: Path, monkeypatch) -> None:
    """The decode worker (in this process) joins its held 512-token prefix with a wrong copy of it (noise of the same
    shape): tokens may still match, but the cache the decode joined is compared with a local prefill and check 5 fails."""
    mod = gpu_check()
    from testbed.serving import compute

    join = compute.join_prefix

    def wrong_prefix(prefix, delta):
        if prefix is not None:
            for layer in prefix.layers:
                layer.tensors = {k: torch.randn_like(t) for k, t in layer.tensors.items()}
        return join(prefix, delta)

    monkeypatch.setattr(compute, "join_prefix", wrong_prefix)
    out = tmp_path / "r.json"
    rc = mod.main(["--device", "cpu", "--variant", "tiny", "--tokens", "530", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 1 and [r["result"] for r in doc["rows"]] == ["pass"] * 4 + ["FAIL"]
    assert "the cache the decode joined (its 512-token prefix + what it received) vs a full local prefill" in doc["rows"][4]["detail"]


def test_the_workers_spec_file_has_float32_caches_and_the_same_geometry(tmp_path: Path) -> None:
    mod = gpu_check()
    spec = mod.load_model_spec("kimi-linear-48b")
    f32 = mod.load_model_spec(str(mod.float32_spec_file("kimi-linear-48b", tmp_path)))
    assert f32 == dataclasses.replace(mod.float32_spec(spec), source=f32.source)  # all but where it was read from
    assert f32.kv_bytes(1000).total_bytes == 2 * spec.kv_bytes(1000).total_bytes  # bf16 -> float32
    user = tmp_path / "mine.yaml"  # a user's spec: an inline layer with its own bf16 state
    user.write_text("name: mine\nkv_dtype: bfloat16\nstate_dtype: bfloat16\ngeometries:\n"
                    "  g: {kind: gqa, kv_heads: 2, k_head_dim: 8, v_head_dim: 8}\n"
                    "layers:\n  - g\n  - {kind: linear, rule: decay, heads: 2, key_dim: 8, value_dim: 8, state_dtype: bfloat16}\n")
    mine = mod.load_model_spec(str(mod.float32_spec_file(str(user), tmp_path)))
    assert mine == dataclasses.replace(mod.float32_spec(mod.load_model_spec(str(user))), source=mine.source)
    assert [mine.layer_state_dtype(i) for i in range(2)] == ["float32", "float32"]


def test_the_device_comparison_uses_float32_caches_and_is_exact_on_one_device(monkeypatch) -> None:
    """Check 3 compares the model with float32 caches (bf16 roundings would hide a device bug in ~5e-3 of noise):
    the same device twice gives 0, and the models it builds carry float32 caches."""
    mod = gpu_check()
    built = []
    build = mod.build_model
    monkeypatch.setattr(mod, "build_model", lambda spec, *a: built.append(spec) or build(spec, *a))

    spec = mod.load_model_spec("kimi-linear-48b")
    linear = next(i for i, g in enumerate(spec.layers) if hasattr(g, "state_dtype"))
    layers = list(spec.layers)
    layers[linear] = dataclasses.replace(layers[linear], state_dtype="bfloat16")  # a layer's own dtype must go too
    spec = dataclasses.replace(spec, layers=tuple(layers))
    assert spec.kv_dtype == "bfloat16" and spec.layer_state_dtype(linear) == "bfloat16"
    assert mod.max_logit_difference(spec, "tiny", list(range(40)), ("cpu", "cpu")) == 0.0
    assert mod.float32_spec(spec).layer_state_dtype(linear) == "float32"
    assert [(s.kv_dtype, s.state_dtype) for s in built] == [("float32", "float32")] * 2
    assert all(s.layer_state_dtype(i) == "float32" for s in built for i in range(len(s.layers)))
