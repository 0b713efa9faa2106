"""Runnable hybrid models: exact cache geometry, chunk-wise = recurrent, decode = longer prefill, determinism."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

from testbed.kv.cache import TENSOR_NAMES, KVCache, LayerKV
from testbed.models.layers import linear_attention_chunked, linear_attention_recurrent
from testbed.models.spec import list_presets, load_model_spec, parse_model_spec
from testbed.models.torch_model import CacheMismatch, build_model, synthetic_cache, tiny_spec, vocab_size

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))
from model_factory import HYBRID, LAYERS, small_spec  # noqa: E402


def prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def cache_bytes_match_spec(model, cache: KVCache) -> None:
    assert cache.nbytes == model.spec.kv_bytes(cache.tokens).total_bytes
    for i, layer in enumerate(cache.layers):
        want = model.spec.layer_tensors(i, cache.tokens)
        assert layer.layer_index == i and layer.kind == model.spec.layers[i].kind
        assert tuple(layer.tensors) == tuple(want) == tuple(n for n in TENSOR_NAMES[layer.kind] if n in want)
        for name, ts in want.items():
            t = layer.tensors[name]
            assert tuple(t.shape) == ts.shape and t.is_contiguous()


# ------------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("rule", ["delta", "decay"])
@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("chunk", [8, 4], ids=["one-step-chain", "two-step-chain"])  # key width 8 <= / > chunk
def test_chunkwise_linear_attention_equals_token_by_token_recurrence(rule: str, start: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(3)
    h, t, dk, dv = 3, 37, 8, 5
    q = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=gen), dim=-1)
    v = torch.randn(h, t, dv, generator=gen)
    g = -torch.rand(h, t, generator=gen) * 0.5
    beta = torch.rand(h, t, generator=gen) if rule == "delta" else None
    s0 = torch.randn(h, dk, dv, generator=gen) * 0.1
    o_c, s_c = linear_attention_chunked(q, k, v, g, beta, s0, start, chunk, torch.float32)
    o_r, s_r = linear_attention_recurrent(q, k, v, g, beta, s0, start, chunk, torch.float32)
    assert torch.allclose(o_c, o_r, atol=1e-4, rtol=0)
    assert torch.allclose(s_c, s_r, atol=1e-4, rtol=0)
    assert float(o_r.abs().max()) > 0.1  # not trivially zero


@pytest.mark.parametrize("rule", ["delta", "decay"])
@pytest.mark.parametrize("segment_elems", [1 << 22, 1], ids=["one-segment", "chunk-by-chunk"])
@pytest.mark.parametrize("chunk", [8, 4], ids=["one-step-chain", "two-step-chain"])
def test_chunkwise_form_with_bf16_state_rounds_where_the_recurrence_does_and_captures_the_checkpoint(
        rule: str, segment_elems: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched-chunk form rounds the state at the same absolute boundaries as the token-by-token
    reference (bf16 here, so a misplaced rounding shows), whether the chunks run as one segment or one by one."""
    import testbed.models.layers as layers

    monkeypatch.setattr(layers, "_LINEAR_SEGMENT_ELEMS", segment_elems)
    gen = torch.Generator().manual_seed(5)
    h, t, dk, dv, start = 2, 45, 8, 8, 3
    q = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(h, t, dk, generator=gen), dim=-1)
    v = torch.randn(h, t, dv, generator=gen)
    g = -torch.rand(h, t, generator=gen) * 0.3
    beta = torch.rand(h, t, generator=gen) if rule == "delta" else None
    s0 = (torch.randn(h, dk, dv, generator=gen) * 0.3).to(torch.bfloat16).float()
    saved: list[torch.Tensor] = []
    o_c, s_c = linear_attention_chunked(q, k, v, g, beta, s0, start, chunk, torch.bfloat16, 32, saved)
    o_r, s_r = linear_attention_recurrent(q, k, v, g, beta, s0, start, chunk, torch.bfloat16)
    _, s_at = linear_attention_recurrent(q[:, :29], k[:, :29], v[:, :29], g[:, :29],
                                         beta[:, :29] if beta is not None else None, s0, start, chunk, torch.bfloat16)
    assert torch.allclose(o_c, o_r, atol=1e-2, rtol=0) and float((o_c - o_r).abs().mean()) < 1e-3
    assert torch.allclose(s_c, s_r, atol=1e-2, rtol=0)
    assert len(saved) == 1 and saved[0].dtype == torch.bfloat16  # position 32 = start + 29
    assert torch.allclose(saved[0].float(), s_at, atol=1e-2, rtol=0)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                    window: int | None, scale: float) -> torch.Tensor:
    """The definition: every score materialised, masked, softmaxed."""
    t, s = q.shape[0], k.shape[0]
    scores = torch.einsum("tkgd,skd->kgts", q, k) * scale
    qp, kp = torch.arange(q_start, q_start + t)[:, None], torch.arange(k_start, k_start + s)[None, :]
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    return torch.einsum("kgts,skv->tkgv", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("case", [
    (40, 40, 0, 0, None, 2, 12, 8),   # a prompt attending to itself (one causal call), grouped, q/k wider than v
    (10, 50, 47, 7, None, 2, 12, 8),  # continuing a cached prefix (masked query blocks)
    (40, 40, 0, 0, 6, 2, 8, 8),       # sliding window
    (1, 50, 56, 7, None, 3, 12, 16),  # one decode query, v wider than q/k
    (1, 9, 56, 48, 9, 2, 8, 8),       # one decode query over a full window
], ids=["causal", "prefix", "window", "decode", "decode-window"])
@pytest.mark.parametrize("mode", ["default", "small-blocks", "masked-only"])
def test_fused_attention_equals_the_materialised_definition(case: tuple, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path of `attend` (one causal call, the prefix + own-part merge by log-sum-exp, masked query
    blocks; masked-only: as on a device without the CPU flash kernel) against the definition."""
    import testbed.models.layers as layers

    if mode != "default":
        monkeypatch.setattr(layers, "_ATTN_BLOCK_ELEMS", 64)
    if mode == "masked-only":
        monkeypatch.setattr(layers, "_FLASH_CPU", None)
    t, s, q_start, k_start, window, g, d, dv = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(t, 2, g, d, generator=gen), torch.randn(s, 2, d, generator=gen), torch.randn(s, 2, dv, generator=gen)
    got = layers.attend(q, k, v, q_start, k_start, window, d**-0.5)
    assert got.shape == (t, 2, g, dv)
    assert torch.allclose(got, naive_attention(q, k, v, q_start, k_start, window, d**-0.5), atol=1e-5, rtol=0)


def _pinned_torch() -> str:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    return re.search(r'"torch==([^"]+)"', pyproject).group(1)


def test_a_prompt_continuing_a_cached_prefix_uses_the_flash_merge_with_the_pinned_torch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The prefix merge calls a private aten op; a torch that drops or changes it would fall back to the
    masked path (correct, ~1.7x dearer per score). With the pinned torch the fast path must be the one
    taken, in `attend` and in every MLA layer of a resumed prefill, with no fallback warning, and equal
    the definition."""
    import testbed.models.layers as layers

    pinned = _pinned_torch()
    if torch.__version__.split("+")[0] != pinned:
        pytest.skip(f"torch {torch.__version__} is not the pinned {pinned}: the fast path is required of the pinned torch only")
    assert layers._FLASH_CPU is not None, f"torch {pinned} lacks aten._scaled_dot_product_flash_attention_for_cpu"
    real, causal_flags = layers._FLASH_CPU, []

    def spy(*args, **kwargs):
        causal_flags.append(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(layers, "_FLASH_CPU", spy)
    monkeypatch.setattr(layers, "_FLASH_FALLBACK_WARNED", False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(10, 2, 2, 12, generator=gen), torch.randn(50, 2, 12, generator=gen), torch.randn(50, 2, 8, generator=gen)
    with caplog.at_level(logging.WARNING, logger=layers.__name__):
        got = layers.attend(q, k, v, 47, 7, None, 12**-0.5)
        assert causal_flags == [False, True]  # the prefix unmasked, the prompt's own part causal
        assert torch.allclose(got, naive_attention(q, k, v, 47, 7, None, 12**-0.5), atol=1e-5, rtol=0)
        model = build_model(load_model_spec("kimi-linear-48b"), "tiny", seed=0, device="cpu")
        ids = prompt(56, model.vocab_size)
        _, prefix = model.prefill(ids[:32])
        causal_flags.clear()
        resumed, _ = model.prefill(ids[32:], cache=prefix)  # 24 new tokens: MLA expands (not absorbed)
        full, _ = model.prefill(ids)
    n_mla = sum(layer.kind == "mla" for layer in model.spec.layers)
    assert n_mla == 7 and causal_flags[:2 * n_mla] == [False, True] * n_mla
    assert torch.allclose(resumed, full[32:], atol=2e-2, rtol=0)  # bf16 caches, 27 layers: the merge's rounding shows
    assert torch.equal(resumed.argmax(-1), full[32:].argmax(-1))
    assert not [r for r in caplog.records if r.name == layers.__name__]


@pytest.mark.parametrize("broken", ["missing", "signature"])
def test_without_the_flash_kernel_the_prefix_merge_falls_back_visibly(broken: str, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A torch without the op (or with another signature): the masked path gives the same result and one
    warning names the op and says what it costs, once per process."""
    import testbed.models.layers as layers

    def changed(*args, **kwargs):
        raise TypeError("_scaled_dot_product_flash_attention_for_cpu() got an unexpected keyword argument 'scale'")

    monkeypatch.setattr(layers, "_FLASH_CPU", None if broken == "missing" else changed)
    monkeypatch.setattr(layers, "_FLASH_FALLBACK_WARNED", False)
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(10, 2, 2, 12, generator=gen), torch.randn(50, 2, 12, generator=gen), torch.randn(50, 2, 8, generator=gen)
    with caplog.at_level(logging.WARNING, logger=layers.__name__):
        for _ in range(3):
            got = layers.attend(q, k, v, 47, 7, None, 12**-0.5)
            assert torch.allclose(got, naive_attention(q, k, v, 47, 7, None, 12**-0.5), atol=1e-5, rtol=0)
    warned = [r.getMessage() for r in caplog.records if r.name == layers.__name__]
    assert len(warned) == 1
    assert "_scaled_dot_product_flash_attention_for_cpu" in warned[0] and "masked path" in warned[0]
    assert ("not available" if broken == "missing" else "failed (TypeError") in warned[0]
    assert layers._FLASH_CPU is None  # a refused call is not retried


def test_tiny_hybrid_prefill_chunked_and_recurrent_give_the_same_greedy_tokens() -> None:
    """The serving model (tiny paper-1t-hybrid, bf16 caches): the chunked prefill and the token-by-token
    reference agree within bf16 rounding and the decode from either picks the same tokens."""
    model = build_model(load_model_spec("paper-1t-hybrid"), "tiny", seed=0, device="cpu")
    ids = prompt(70, model.vocab_size).to(model.device)
    with torch.inference_mode():
        chunked, layers_c, _ = model._run(ids, None, False, None)
        recurrent, layers_r, _ = model._run(ids, None, True, None)
        assert torch.allclose(chunked, recurrent, atol=5e-2, rtol=0)
        caches = [KVCache("r", model.spec.name, 70, list(ls)) for ls in (layers_c, layers_r)]
        tokens = []
        for cache in caches:
            out = [int(chunked[-1].argmax())]
            for _ in range(8):
                out.append(int(model.decode(out[-1], cache).argmax()))
            tokens.append(out)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("kind", ["delta", "decay"])
def test_linear_layer_prefill_chunked_equals_recurrent_in_the_model(kind: str) -> None:
    model = build_model(small_spec([kind], "float32", "float32"), "faithful", seed=0, device="cpu")
    mixer = model.blocks[0].mixer
    x = torch.randn(150, model.hidden_size, generator=torch.Generator().manual_seed(0))
    y_c, kv_c, _ = mixer(x, 0, None, recurrent=False)
    y_r, kv_r, _ = mixer(x, 0, None, recurrent=True)
    assert 150 % model.variant.chunk_tokens and 150 > 2 * model.variant.chunk_tokens  # several chunks, the last partial
    assert torch.allclose(y_c, y_r, atol=1e-4, rtol=0)
    for name in kv_c.tensors:
        assert torch.allclose(kv_c.tensors[name], kv_r.tensors[name], atol=1e-4, rtol=0)


@pytest.mark.parametrize("start", [0, 13])
def test_a_long_linear_call_in_token_segments_equals_one_call(start: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide linear layers run long calls in chunk-aligned token segments (cache-sized); each resumes from
    the last one's cache entry, so outputs, the cache and the prefix checkpoint equal one call's."""
    import testbed.models.layers as layers

    model = build_model(small_spec(["delta"]), "faithful", seed=0, device="cpu")  # bf16 caches: rounding shows
    mixer = model.blocks[0].mixer
    x = torch.randn(start + 150, model.hidden_size, generator=torch.Generator().manual_seed(2))
    prev = mixer(x[:start], 0, None)[1] if start else None
    whole = mixer(x[start:], start, prev, checkpoint_at=128)
    monkeypatch.setattr(layers, "_LINEAR_SEGMENT_ACTIVATIONS", sum(mixer.widths) * model.variant.chunk_tokens)
    calls = []
    monkeypatch.setattr(mixer, "_forward", lambda *a, _f=mixer._forward: calls.append(a[1]) or _f(*a))
    split = mixer(x[start:], start, prev, checkpoint_at=128)
    assert len(calls) == 3 and all(pos % model.variant.chunk_tokens == 0 for pos in calls[1:])  # 2-3 chunks of 64
    assert torch.allclose(whole[0], split[0], atol=1e-6, rtol=0)
    for a, b in ((whole[1], split[1]), (whole[2], split[2])):
        assert list(a.tensors) == list(b.tensors)
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_linear_state_is_fixed_size_whatever_the_length() -> None:
    model = build_model(small_spec(["delta"]), "faithful", seed=0, device="cpu")
    sizes = {model.prefill(prompt(n, model.vocab_size))[1].nbytes for n in (1, 3, 70)}
    assert sizes == {4 * 8 * 6 * 2 + 3 * (2 * 2 * 8 + 4 * 6) * 2}


# ---------------------------------------------------------------------------------------- SWA


def test_swa_cache_never_exceeds_its_window() -> None:
    model = build_model(small_spec(["swa", "gqa"]), "faithful", seed=0, device="cpu")
    window = LAYERS["swa"]["window"]
    for n in (1, window - 1, window, window + 7):
        _, cache = model.prefill(prompt(n, model.vocab_size))
        assert cache.layers[0].tensors["k"].shape[0] == min(n, window)
        assert cache.layers[1].tensors["k"].shape[0] == n
        for step in range(window + 2):
            model.decode(step % model.vocab_size, cache)
            assert cache.layers[0].tensors["k"].shape[0] == min(cache.tokens, window)
            assert cache.layers[0].tensors["v"].shape[0] == min(cache.tokens, window)
        cache_bytes_match_spec(model, cache)


def test_swa_only_sees_its_window() -> None:
    """Tokens more than `window` positions back cannot change an SWA-only model's next logits."""
    spec = parse_model_spec({"name": "swa1", "kv_dtype": "float32", "layers": [LAYERS["swa"]]})
    model = build_model(spec, "faithful", seed=0, device="cpu")
    a = prompt(20, model.vocab_size, seed=1)
    b = a.clone()
    b[:20 - LAYERS["swa"]["window"]] = prompt(20 - LAYERS["swa"]["window"], model.vocab_size, seed=2)
    assert not torch.equal(a, b)
    la, _ = model.prefill(a)
    lb, _ = model.prefill(b)
    assert torch.allclose(la[-1], lb[-1], atol=1e-5)
    assert not torch.allclose(la[5], lb[5], atol=1e-3)


# --------------------------------------------------------------------- decode, prefix, determinism


@pytest.mark.parametrize("kinds", [["delta"], ["decay"], ["gqa"], ["mla"], ["swa"], HYBRID], ids=lambda k: "+".join(k))
def test_decode_from_a_cache_equals_a_longer_prefill(kinds: list[str]) -> None:
    """fp32 caches: the recurrent/absorbed decode path is the same function as the chunked prefill."""
    model = build_model(small_spec(kinds, "float32", "float32"), "faithful", seed=0, device="cpu")
    ids = prompt(134, model.vocab_size)
    full, _ = model.prefill(ids)
    _, cache = model.prefill(ids[:125])
    for i in range(125, 134):  # crosses the chunk boundary at 128
        logits = model.decode(int(ids[i]), cache)
        assert torch.allclose(logits, full[i], atol=1e-4, rtol=0), i
    assert cache.tokens == 134
    cache_bytes_match_spec(model, cache)


def test_decode_with_bf16_caches_stays_close_to_prefill_and_picks_the_same_tokens() -> None:
    model = build_model(small_spec(HYBRID), "faithful", seed=0, device="cpu")
    ids = prompt(134, model.vocab_size)
    full, _ = model.prefill(ids)
    _, cache = model.prefill(ids[:125])
    for i in range(125, 134):
        logits = model.decode(int(ids[i]), cache)
        assert torch.allclose(logits, full[i], atol=2e-2, rtol=0)
        assert int(logits.argmax()) == int(full[i].argmax())


def test_float8_state_runs_prefill_decode_and_a_batched_step_in_the_spec_bytes() -> None:
    """A state dtype is any cache dtype (spec.STATE_DTYPES, docs/models.md): float8 state is rounded and cached as the
    others are, and a decode step picks the token a longer prefill picks."""
    model = build_model(small_spec(HYBRID, state_dtype="float8_e4m3fn"), "faithful", seed=0, device="cpu")
    ids = prompt(40, model.vocab_size)
    full, _ = model.prefill(ids)
    _, cache = model.prefill(ids[:37], request_id="a")
    _, other = model.prefill(ids[:20], request_id="b")
    for i in range(37, 40):
        logits = model.decode(int(ids[i]), cache)
        assert torch.isfinite(logits).all() and int(logits.argmax()) == int(full[i].argmax())
    model.decode_batch([1, 2], [cache, other])
    for c in (cache, other):
        assert {layer.tensors["state"].dtype for layer in c.layers if layer.kind == "linear"} == {torch.float8_e4m3fn}
        cache_bytes_match_spec(model, c)


def test_prefill_resumed_from_a_block_aligned_prefix_equals_a_full_prefill() -> None:
    """Default bf16 caches: the prefix hit continues exactly where the full prefill would be."""
    model = build_model(small_spec(HYBRID), "tiny", seed=0, device="cpu")
    ids = prompt(40, model.vocab_size)
    full, full_cache = model.prefill(ids)
    boundary = 2 * model.variant.chunk_tokens
    _, prefix = model.prefill(ids[:boundary])
    resumed, cache = model.prefill(ids[boundary:], cache=prefix)
    assert cache.tokens == 40
    assert torch.allclose(resumed, full[boundary:], atol=1e-4, rtol=0)
    for a, b in zip(cache.layers, full_cache.layers):
        for name in a.tensors:
            assert torch.allclose(a.tensors[name].float(), b.tensors[name].float(), atol=1e-3, rtol=0)


def test_prefill_and_decode_never_write_into_a_given_cache() -> None:
    model = build_model(small_spec(HYBRID), "tiny", seed=0, device="cpu")
    _, prefix = model.prefill(prompt(16, model.vocab_size))
    snapshot = [{n: t.clone() for n, t in layer.tensors.items()} for layer in prefix.layers]
    model.prefill(prompt(5, model.vocab_size, seed=4), cache=prefix)
    shared = KVCache("r", prefix.model, prefix.tokens, list(prefix.layers))
    model.decode(3, shared)
    assert prefix.tokens == 16 and shared.tokens == 17
    for layer, snap in zip(prefix.layers, snapshot):
        for name, t in layer.tensors.items():
            assert torch.equal(t, snap[name])


def test_same_seed_gives_bit_identical_logits_and_another_seed_does_not() -> None:
    spec = load_model_spec("kimi-linear-48b")
    ids = prompt(19, 256)
    a, ca = build_model(spec, "tiny", seed=5, device="cpu").prefill(ids)
    b, cb = build_model(spec, "tiny", seed=5, device="cpu").prefill(ids)
    c, _ = build_model(spec, "tiny", seed=6, device="cpu").prefill(ids)
    assert torch.equal(a, b)
    assert all(torch.equal(x.tensors[n], y.tensors[n]) for x, y in zip(ca.layers, cb.layers) for n in x.tensors)
    assert not torch.allclose(a, c, atol=1e-2)


def test_on_layer_streams_each_layer_in_order_as_returned() -> None:
    model = build_model(small_spec(HYBRID), "tiny", seed=0, device="cpu")
    seen: list[LayerKV] = []
    _, cache = model.prefill(prompt(9, model.vocab_size), on_layer=seen.append, request_id="req-1")
    assert [layer.layer_index for layer in seen] == list(range(len(HYBRID)))
    assert all(s is c for s, c in zip(seen, cache.layers))
    assert cache.request_id == "req-1" and cache.model == model.spec.name


def test_generate_is_greedy_decoding() -> None:
    model = build_model(small_spec(HYBRID), "tiny", seed=0, device="cpu")
    ids = prompt(10, model.vocab_size)
    out = model.generate(ids, 4)
    logits, cache = model.prefill(ids)
    want = [int(logits[-1].argmax())]
    while len(want) < 4:
        want.append(int(model.decode(want[-1], cache).argmax()))
    assert out == want and len(out) == 4
    assert model.generate(ids, 0) == []


# ------------------------------------------------------------------------------ variants, presets


@pytest.mark.parametrize("name", ["kimi-linear-48b", "mimo-v2-flash", "qwen3-next-80b", "deepseek-v3"])
def test_faithful_variant_caches_exactly_the_spec_bytes(name: str) -> None:
    spec = load_model_spec(name)
    model = build_model(spec, "faithful", seed=0, device="cpu")
    assert model.spec == spec
    _, cache = model.prefill(prompt(9, model.vocab_size))
    assert cache.nbytes == spec.kv_bytes(9).total_bytes
    cache_bytes_match_spec(model, cache)
    before = cache.nbytes
    model.decode(1, cache)
    window_growth = spec.kv_bytes(10).window_bytes - spec.kv_bytes(9).window_bytes
    assert cache.nbytes - before == spec.full_attention_bytes_per_token + window_growth


@pytest.mark.parametrize("name", list_presets())
def test_tiny_variant_of_every_preset_keeps_the_layer_pattern_and_runs(name: str) -> None:
    spec = load_model_spec(name)
    model = build_model(spec, "tiny", seed=0, device="cpu")
    assert model.vocab_size == vocab_size(spec, "tiny")
    assert [layer.kind for layer in model.spec.layers] == [layer.kind for layer in spec.layers]
    assert model.spec == tiny_spec(spec) and model.source_spec == spec
    logits, cache = model.prefill(prompt(6, model.vocab_size))
    assert logits.shape == (6, model.vocab_size) and torch.isfinite(logits).all()
    model.decode(2, cache)
    cache_bytes_match_spec(model, cache)


def test_synthetic_cache_has_the_spec_geometry_and_the_model_accepts_it() -> None:
    model = build_model(small_spec(HYBRID), "faithful", seed=0, device="cpu")
    cache = synthetic_cache(model.spec, 11, request_id="s")
    assert cache.nbytes == model.spec.kv_bytes(11).total_bytes
    model.check_cache(cache)
    assert torch.isfinite(model.decode(0, cache)).all()


def test_a_cache_that_does_not_fit_is_refused_with_a_clear_error() -> None:
    model = build_model(small_spec(HYBRID), "tiny", seed=0, device="cpu")
    _, cache = model.prefill(prompt(8, model.vocab_size))
    with pytest.raises(CacheMismatch, match="cache has 5 layers"):
        model.decode(1, dataclasses.replace(cache, layers=cache.layers[:-1]))
    wrong_tokens = dataclasses.replace(cache, layers=list(cache.layers), tokens=9)
    with pytest.raises(CacheMismatch, match=r"layer 1 \(gqa\) tensor k: \(8, 2, 2\) bfloat16, expected \(9, 2, 2\)"):
        model.decode(1, wrong_tokens)
    swapped = list(cache.layers)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(CacheMismatch, match="cache layer 0 is 'gqa'"):
        model.prefill([1], cache=dataclasses.replace(cache, layers=swapped))
    as_fp32 = [LayerKV(x.layer_index, x.kind, {n: t.float() for n, t in x.tensors.items()}) for x in cache.layers]
    with pytest.raises(CacheMismatch, match="float32, expected"):
        model.decode(1, dataclasses.replace(cache, layers=as_fp32))


def test_bad_token_ids_and_variants_are_refused() -> None:
    from testbed.errors import UserError

    model = build_model(small_spec(["gqa"]), "tiny", seed=0, device="cpu")
    with pytest.raises(ValueError, match="within 0..255"):
        model.prefill([0, 256])
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill([])
    with pytest.raises(UserError, match="faithful, tiny"):
        build_model(small_spec(["gqa"]), "huge")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: needs a CUDA device (this host has none); the CPU path is tested above")
def test_cuda_model_matches_the_cpu_model() -> None:
    spec = small_spec(HYBRID, "float32", "float32")
    ids = prompt(20, 512)
    cpu, _ = build_model(spec, "faithful", seed=0, device="cpu").prefill(ids)
    gpu, cache = build_model(spec, "faithful", seed=0, device="cuda").prefill(ids)
    assert cache.layers[0].tensors["state"].is_cuda
    assert torch.allclose(cpu, gpu.cpu(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("kinds", [["gqa"], ["swa"], ["mla"]], ids=lambda k: k[0])
def test_attention_in_query_blocks_equals_one_block(kinds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Long prompts attend in query blocks to bound memory; the blocks must not change the result."""
    import testbed.models.layers as layers

    model = build_model(small_spec(kinds, "float32"), "faithful", seed=0, device="cpu")
    ids = prompt(40, model.vocab_size)
    whole, _ = model.prefill(ids)
    monkeypatch.setattr(layers, "_ATTN_BLOCK_ELEMS", 64)  # a few queries per block
    blocked, _ = model.prefill(ids)
    assert torch.allclose(whole, blocked, atol=1e-5, rtol=0)


def test_linear_chunks_divide_the_prefix_cache_block_so_block_boundaries_are_exact_resume_points() -> None:
    from testbed.blocks import BLOCK_TOKENS

    from testbed.models.torch_model import VARIANTS

    assert all(BLOCK_TOKENS % v.chunk_tokens == 0 for v in VARIANTS.values())


@pytest.mark.parametrize("name", ["paper-1t-hybrid", "mimo-v2-flash"])  # KDA + MLA; SWA + GQA
def test_a_batched_decode_step_gives_each_request_the_tokens_and_cache_of_its_own_decode(name: str) -> None:
    """Continuous batching: requests of different lengths decoded together get the same greedy tokens, and
    caches within float rounding, as each decoded alone."""
    if name not in list_presets():
        pytest.fail(f"preset {name} missing: {list_presets()}")
    model = build_model(load_model_spec(name), "tiny", seed=3, device="cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in (9, 40, 17, 64)]
    alone, together, caches = [], [], []
    for p in prompts:
        alone.append(model.generate(p, 6))
        logits, cache = model.prefill(p)
        caches.append(cache)
        together.append([int(logits[-1].argmax())])
    solo = [model.prefill(p)[1] for p in prompts]
    for _ in range(5):
        logits = model.decode_batch([t[-1] for t in together], caches)
        for t, row in zip(together, logits):
            t.append(int(row.argmax()))
    assert together == alone
    for toks, c, s in zip(together, caches, solo):
        for tok in toks[:-1]:
            model.decode(tok, s)
        assert c.tokens == s.tokens
        for a, b in zip(c.layers, s.layers):
            for k, t in a.tensors.items():
                assert t.shape == b.tensors[k].shape and t.dtype == b.tensors[k].dtype
                assert torch.allclose(t.float(), b.tensors[k].float(), rtol=2e-2, atol=2e-2), (a.layer_index, k)
