"""The cumulative forget gates a growing cache keeps for a FoX decay (urpe.hf.forget_history):
the sums equal torch's cumsum of every log f bit for bit (what the kernel summed before a step
read them), grow without a copy per step, follow crops and gradients, and a decoding step's
CrossDecay (the float64 sums, read rounded to the call's dtype) reads what Decay over the whole
history read."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import urpe
from tests.hf_families import VOCAB
from tests.test_hf_decay import fox_model
from urpe.hf.forget_history import Cumulative
from urpe.kernels import CrossDecay, Decay, dense_term


def _log_forget(length: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.nn.functional.logsigmoid(torch.randn(2, 3, length, generator=g) + 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sums_equal_cumsum_of_the_whole_history_bit_for_bit(dtype):
    log_forget = _log_forget(80, dtype)
    kept = Cumulative(log_forget.new_zeros(2, 3, 0, dtype=torch.float64))
    buffers, start = set(), 0
    for n in [5, 1, 1, 3] + [1] * 70:  # a prompt, steps, a chunk, then many steps
        kept.extend(log_forget[..., start : start + n])
        start += n
        buffers.add(kept.buffer.data_ptr())
        want = log_forget[..., :start].cumsum(-1)  # (B, H, T), as the kernel sums Decay's
        assert torch.equal(kept.values.to(dtype), want)
        term = kept.decoding_term(dtype)  # [c of the last token | c of every token], float64
        assert term.dtype == torch.float64 and torch.equal(term[..., 0].to(dtype), want[..., -1])
        decay = Decay(log_forget[..., :start]).dense(1, start)  # (B, H, 1, T)
        assert torch.equal(dense_term(CrossDecay(term), 1, start, dtype), decay)
    assert len(buffers) <= 4  # grown geometrically: 80 tokens, not a buffer per step


def test_a_truncated_history_decodes_from_its_new_last_token():
    log_forget = _log_forget(9)
    kept = Cumulative(log_forget[..., :7].to(torch.float64).cumsum(-1))
    kept.truncate(5)
    kept.extend(log_forget[..., 5:6])
    want = torch.cat([log_forget[..., :5], log_forget[..., 5:6]], -1).cumsum(-1)
    assert torch.equal(kept.values.float(), want)
    assert torch.equal(kept.decoding_term(torch.float32)[..., 0].float(), want[..., -1])


def test_decoding_after_a_crop_equals_the_full_forward():
    model = fox_model("llama")
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :7], past_key_values=cache, use_cache=True)
        cache.crop(-2)
        step = model(ids[:, 5:6], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], model(ids[:, :6]).logits[:, -1])


def test_float32_generation_with_a_cache_equals_generation_without():
    """float32 (the sums kept in float64, read in float32 as the kernel's cumsum gave them):
    greedy tokens equal, every step's logits close."""
    model = fox_model("llama", dtype=torch.float32)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    cached = model.generate(ids, **common)
    uncached = model.generate(ids, **common, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits))


def test_gradients_through_a_cache_equal_the_full_forward():
    """With gradients the sums are kept out of place: a prefill and two steps through a cache
    give the forget gates the gradient of the full forward."""
    model = fox_model("llama")
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    forget = [p for n, p in model.named_parameters() if "urpe_forget" in n]

    def gradients(logits):
        model.zero_grad()
        logits.square().mean().backward()
        return [p.grad.clone() for p in forget]

    full = gradients(model(ids).logits)
    cache = DynamicCache(config=model.config)
    stepped = torch.cat(
        [
            model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
            for a, b in ((0, 5), (5, 6), (6, 7))
        ],
        1,
    )
    for got, want in zip(gradients(stepped), full, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_reads_the_sums_where_they_lie(dtype):
    """A decoding step's term is a view of the kept float64 rows (a buffer's capacity apart),
    written one sum per step, not a conversion of the history: the C++ kernel reads those rows
    as they lie and gives what it gives for a contiguous copy in the call's dtype, without and
    with a gradient."""
    log_forget = _log_forget(40, dtype)
    kept = Cumulative(log_forget.new_zeros(2, 3, 0, dtype=torch.float64))
    kept.extend(log_forget[..., :30])
    terms = set()
    for t in range(30, 40):
        kept.extend(log_forget[..., t : t + 1])
        term = kept.decoding_term(dtype)  # (B, H, 1 + T)
        terms.add(term.data_ptr())
    assert len(terms) == 2  # the buffer read by every step, grown once (at 33 tokens)
    assert not term.is_contiguous() and term.stride(-1) == 1
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=dtype) for n in (1, 40, 40))
    with torch.no_grad():
        got = urpe.attention(q, k, v, bias=CrossDecay(term), backend="cpp")
        copied = CrossDecay(term.to(dtype).contiguous())
        want = urpe.attention(q, k, v, bias=copied, backend="cpp")
    assert torch.equal(got, want)
    rows = torch.zeros(2, 3, 64, dtype=dtype)
    rows[..., :41] = term
    rows.requires_grad_()
    strided = rows.narrow(-1, 0, 41)  # rows 64 apart, as the cache keeps them
    urpe.attention(q, k, v, bias=CrossDecay(strided), backend="cpp").sum().backward()
    reference = term.to(dtype).contiguous().requires_grad_()
    urpe.attention(q, k, v, bias=CrossDecay(reference), backend="reference").sum().backward()
    torch.testing.assert_close(rows.grad[..., :41], reference.grad)


def test_steps_read_late_or_after_a_crop_read_the_last_sum():
    """Steps write their sums into the front slot and their own; a read after many of them, a
    crop (to a few tokens, or to none) and a grown buffer still see the last token's."""
    log_forget = _log_forget(60)
    want = log_forget.to(torch.float64).cumsum(-1)  # (B, H, T), summed as the kernel sums
    kept = Cumulative(log_forget.new_zeros(2, 3, 0, dtype=torch.float64))
    kept.extend(log_forget[..., :4])
    for t in range(4, 20):  # past the first capacity (16): grown with steps unread
        kept.extend(log_forget[..., t : t + 1])
    assert torch.equal(kept.decoding_term(torch.float32)[..., 0], want[..., 19])
    for t in range(20, 25):
        kept.extend(log_forget[..., t : t + 1])
    term = kept.decoding_term(torch.float64)
    assert torch.equal(term, torch.cat([want[..., 24:25], want[..., :25]], -1))
    kept.truncate(22)
    kept.extend(log_forget[..., 22:23])
    assert torch.equal(kept.values, want[..., :23])
    assert torch.equal(kept.decoding_term(torch.float64)[..., 0], want[..., 22])
    kept.truncate(0)  # cropped to nothing: a one-token step sums from 0
    kept.step(log_forget[..., :1].mT)  # (B, 1, H), as the projection gives it
    assert torch.equal(kept.decoding_term(torch.float64), want[..., :1].expand(2, 3, 2))


def test_a_deep_copied_history_steps_apart_from_its_original():
    """copy.deepcopy (a prompt cache reused) copies the buffers with the views kept on them
    (the front, the last token's pair): each copy then sums its own tokens."""
    import copy

    log_forget = _log_forget(12)
    kept = Cumulative(log_forget[..., :6].to(torch.float64).cumsum(-1))
    kept.extend(log_forget[..., 6:7])
    kept.decoding_term(torch.float32)
    copied = copy.deepcopy(kept)
    for t in range(7, 12):
        kept.extend(log_forget[..., t : t + 1])
        copied.extend(log_forget[..., t : t + 1] * 2)
    other = torch.cat([log_forget[..., :7], log_forget[..., 7:] * 2], -1)
    for history, logs in ((kept, log_forget), (copied, other)):
        want = logs.to(torch.float64).cumsum(-1)
        assert torch.equal(history.values, want)
        assert torch.equal(history.decoding_term(torch.float32)[..., 0], want[..., -1])


def test_a_cache_cut_behind_urpe_s_back_decodes_as_the_full_forward():
    """Keys cut off a DynamicCache's layers directly (not through `crop`): a step takes the
    full route, which cuts the kept sums to the cache's length first."""
    model = fox_model("llama")
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        model(ids[:, 6:7], past_key_values=cache, use_cache=True)  # a step: the fast route
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :4], layer.values[:, :, :4]
        step = model(ids[:, 4:5], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(step[:, -1], model(ids[:, :5]).logits[:, -1])


# Greedy tokens of `_greedy` before the steps read the float64 sums in place (a float32 copy
# of them was kept then): rounding each sum as it is read must leave them unchanged.
GREEDY_BEFORE = [
    [47, 3, 24, 27, 19, 7, 27, 41, 39, 15, 58, 48, 55, 1, 37, 0, 8, 47, 3, 12, 51, 3, 12, 51],
    [52, 29, 4, 23, 10, 21, 58, 47, 3, 24, 27, 54] + [52] * 12,
]


def _greedy(model, **options):
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                  do_sample=False, pad_token_id=0)  # fmt: skip
    return model.generate(ids, **common, **options)


def test_float32_greedy_tokens_are_those_generated_before():
    model = fox_model("llama", dtype=torch.float32)
    assert _greedy(model)[:, 7:].tolist() == GREEDY_BEFORE


def test_float32_steps_read_the_float64_sums_as_their_float32_copy_bit_for_bit(monkeypatch):
    """Every decoding step's logits equal those of steps handed the sums converted to float32
    first (what they read before), bit for bit."""
    model = fox_model("llama", dtype=torch.float32)
    options = dict(output_logits=True, return_dict_in_generate=True)
    wide = _greedy(model, **options)
    view = Cumulative.decoding_term
    monkeypatch.setattr(
        Cumulative, "decoding_term", lambda self, dtype: view(self, dtype).to(dtype)
    )
    copied = _greedy(model, **options)
    assert torch.equal(wide.sequences, copied.sequences)
    assert torch.equal(torch.stack(wide.logits), torch.stack(copied.logits))


def test_float32_copied_and_cropped_caches_decode_as_the_full_forward():
    """A prompt's cache deep-copied (each copy then decodes its own tokens), and the copy
    cropped back and decoded again: every step's logits equal the full forward's."""
    import copy

    model = fox_model("llama", dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    mine, theirs = torch.randint(2, VOCAB, (2, 2, 12), generator=g)
    theirs[:, :6] = mine[:, :6]  # one prompt
    again = torch.cat([theirs[:, :8], mine[:, 8:]], -1)  # their tokens to 8, then mine

    def decode(cache, tokens, start):
        for t in range(start, tokens.shape[1]):
            step = model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits
            full = model(tokens[:, : t + 1]).logits
            torch.testing.assert_close(step[:, -1], full[:, -1])

    with torch.no_grad():
        prompt = DynamicCache(config=model.config)
        model(mine[:, :6], past_key_values=prompt, use_cache=True)
        copied = copy.deepcopy(prompt)
        decode(prompt, mine, 6)
        decode(copied, theirs, 6)
        copied.crop(-4)  # back to 8 tokens
        decode(copied, again, 8)
