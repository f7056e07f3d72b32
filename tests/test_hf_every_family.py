"""add_urpe on every causal-LM family the installed transformers registers (slow), and on
every encoder-decoder and masked-LM family (the last test).

tests/hf_families.py checks ten families closely. This sweeps the rest, as a user would meet
them: each family's default config made tiny (random weights, nothing downloaded), then either
add_urpe refuses it by name (`UnsupportedModelError`), or
- at init its logits are the base model's (the gate starts at ones),
- with random gate tables they are not (the gate is in the attention the model runs), and
- a greedy generate's per-step logits (the KV cache, the gate's rows for one query) equal one
  forward over the generated sequence, wherever the base model's do,
- `save_pretrained` and `urpe.hf.from_pretrained` give the same model back, and
- with random gate tables, a forward and a generate's per-step logits, and (float64) the
  gradients of the tables and of every weight, equal those of the base model running a plain
  attention written here from the definition (softmax, times
  C_ij = table[h, clamp(j - i, -K, K) + K], times V), with the same tables.
The same with a FoX decay (`decay="fox"`, its forget gates kept beside the cache), except the
first point: its gates start near 1, not at 1.
A family whose default config does not shrink to these sizes, or whose base model fails on the
inputs, is skipped with the reason: that is the sweep's reach, not urpe's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
)
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

import urpe.hf

pytestmark = pytest.mark.slow

VOCAB, PROMPT, NEW = 97, 11, 6
# Each family's names for the sizes; only those its config already has are set.
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    n_embd=64, n_layer=2, n_head=4, n_positions=128, d_model=64, ffn_dim=96, num_layers=2,
    num_heads=4, pad_token_id=0,
    # encoder-decoder families' decoders (BART, Marian, ...)
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=96, decoder_ffn_dim=96, d_ff=96, d_kv=16, num_decoder_layers=2,
    # partial rotary (GPT-J, CodeGen), latent attention (DeepSeek), mixtures of experts
    rotary_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16,
    q_lora_rank=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
)  # fmt: skip
MOST_PARAMETERS = 20_000_000  # more: the default config did not shrink (sizes under other names)


def _tiny_config(model_type: str):
    config = AutoConfig.for_model(model_type)
    layers = getattr(config, "num_hidden_layers", None)
    for name, value in TINY.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except (AttributeError, TypeError, ValueError):
                pass  # (a derived property, or a value this family validates otherwise)
    # per-layer lists (layer_types, mlp_layer_types, heads per layer, ...) cut to the new depth
    for name, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and layers and len(value) == layers > 2:
            try:
                setattr(config, name, list(value)[: TINY["num_hidden_layers"]])
            except (AttributeError, TypeError, ValueError):
                pass
    return config


def _base_model(model_type: str, auto=AutoModelForCausalLM):
    """The family's tiny model with the `auto` class's head (SDPA attention, else its eager
    attention), or a pytest.skip naming why there is none."""
    try:
        config = _tiny_config(model_type)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in auto.from_config(config).parameters())
        if parameters > MOST_PARAMETERS:
            pytest.skip(f"{model_type}: its config keeps {parameters:,} parameters at these sizes")
        torch.manual_seed(0)
        try:
            model = auto.from_config(config, attn_implementation="sdpa")
        except ValueError:  # (a family without SDPA attention: Gemma 2, Mamba, ...)
            model = auto.from_config(config, attn_implementation="eager")
        return model.eval()
    except pytest.skip.Exception:
        raise
    except Exception as error:  # (the sweep's reach: configs that need more than these sizes)
        pytest.skip(f"{model_type}: no tiny model from its default config ({error!r:.120})")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - 7, (2, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in row 0
    return ids, mask


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _cached_against_full(model, ids, mask) -> float:
    """Largest difference between a greedy generate's per-step logits and one forward over
    the sequence it generated, in the unpadded row (the padded row's positions differ between
    the two where a family numbers positions from the mask)."""
    sequences, steps = _greedy(model, ids, mask)
    full = _logits(model, sequences, torch.ones_like(sequences))
    return (full[1, PROMPT - 1 : PROMPT - 1 + NEW] - steps[1]).abs().max().item()


def _greedy(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy generate of NEW tokens: (sequences (B, PROMPT + NEW), per-step logits
    (B, NEW, V))."""
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


def _gated(base, decay):
    """add_urpe on a copy of `base`, or None where it refuses the family by its class's name."""
    try:
        return urpe.hf.add_urpe(copy.deepcopy(base), decay=decay).eval()
    except urpe.hf.UnsupportedModelError as error:
        assert type(base).__name__ in str(error)
        return None


@pytest.mark.parametrize("decay", [None, "fox"])
@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_add_urpe_refuses_by_name_or_runs_the_gate(model_type, decay, tmp_path):
    base = _base_model(model_type)
    ids, mask = _inputs()
    try:
        expected = _logits(base, ids, mask)
        base_drift = _cached_against_full(base, ids, mask)
    except Exception as error:
        pytest.skip(f"{model_type}: the base model fails on these inputs ({error!r:.120})")
    gated = _gated(base, decay)
    if gated is None:
        return
    real = mask.bool()
    if decay is None:  # (FoX's forget gates start near 1, not at 1)
        torch.testing.assert_close(
            _logits(gated, ids, mask)[real], expected[real], atol=1e-5, rtol=0
        )
    added = {name for name, _ in gated.named_parameters()} - {n for n, _ in base.named_parameters()}
    assert added, "add_urpe added no parameters"
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in gated.named_parameters():
            if name in added:
                parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    changed = (_logits(gated, ids, mask)[real] - expected[real]).abs().max().item()
    assert changed > 1e-4, "random tables left the logits as they were"
    if base_drift < 1e-4:  # (a causal model: its cache gives a full forward's logits)
        assert _cached_against_full(gated, ids, mask) < 1e-4
    try:
        gated.save_pretrained(tmp_path)
        loaded = urpe.hf.from_pretrained(tmp_path, AutoModelForCausalLM).eval()
    except Exception as error:  # (a config the family's own validation refuses on saving)
        if "URPE gate" in str(error):
            raise
        pytest.skip(f"{model_type}: its tiny config does not save and load ({error!r:.120})")
    assert torch.equal(_logits(loaded, ids, mask), _logits(gated, ids, mask))


REFERENCE = "urpe_test_reference"
TABLE = "_test_gate_table"  # where the reference model's modules keep the gated model's table


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **_):
    """softmax(q k^T * scaling + mask) * C, times v, materialised; q (B, H, Lq, D), k and v
    (B, Hkv, Lk, D); the queries are the last Lq of the Lk positions (a cache's slots)."""
    heads, lq, lk = query.shape[1], query.shape[2], key.shape[2]
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    value = value.repeat_interleave(heads // value.shape[1], dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ key.transpose(-1, -2) * scaling  # (B, H, Lq, Lk)
    if attention_mask is not None:
        scores = scores + attention_mask[..., :lk]
    weights = scores.softmax(-1)
    table = getattr(module, TABLE, None)  # (H, 2K + 1)
    if table is not None:
        reach = (table.shape[-1] - 1) // 2
        offsets = torch.arange(lk) - (torch.arange(lq) + lk - lq)[:, None]  # j - i, (Lq, Lk)
        weights = weights * table[:, offsets.clamp(-reach, reach) + reach]
    return (weights @ value).transpose(1, 2).contiguous(), weights  # (B, Lq, H, Dv)


@pytest.fixture(scope="module")
def reference_attention():
    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    yield REFERENCE


def _per_step_logits(model, ids, mask) -> torch.Tensor:
    return _greedy(model, ids, mask)[1]  # (B, NEW, V)


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_the_gate_is_the_gate_of_a_plain_reference_attention(model_type, reference_attention):
    base = _base_model(model_type)
    ids, mask = _inputs()
    try:
        _logits(base, ids, mask)
    except Exception as error:
        pytest.skip(f"{model_type}: the base model fails on these inputs ({error!r:.120})")
    try:  # float64, where the family's own layers take it (grouped expert products do not)
        _logits(copy.deepcopy(base).double(), ids, mask)
        base = base.double()
    except RuntimeError:
        pass
    gated = _gated(base, None)
    if gated is None:
        pytest.skip(f"{model_type}: refused (the test above)")
    reference = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(3)
    gated_modules = dict(gated.named_modules())
    for name, module in reference.named_modules():
        gate = getattr(gated_modules[name], "urpe_gate", None)
        if gate is not None:
            with torch.no_grad():
                gate.table.add_(0.5 * torch.randn(gate.table.shape, generator=generator))
            setattr(module, TABLE, gate.table.detach().clone().requires_grad_())
    try:
        reference.set_attn_implementation(reference_attention)
    except (ValueError, TypeError) as error:
        pytest.skip(f"{model_type}: takes no custom attention function ({error!r:.120})")
    real = mask.bool()
    try:
        expected = _logits(reference, ids, mask)
        expected_steps = _per_step_logits(reference, ids, mask)
    except Exception as error:
        pytest.skip(f"{model_type}: the reference attention does not fit it ({error!r:.120})")
    # float64: assert_close's own tolerance; float32: one family's SDPA and this attention
    # already differ by 4.5e-5 without a gate (inkling_text)
    tolerance = {} if base.dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_logits(gated, ids, mask)[real], expected[real], **tolerance)
    torch.testing.assert_close(_per_step_logits(gated, ids, mask), expected_steps, **tolerance)
    # Backward: the gradients of the tables and of every base weight, for one weighted sum of
    # the logits (eval mode: no dropout). In float64 only: in float32, inkling_text's SDPA and
    # this attention already route tokens to different experts without any gate.
    if base.dtype != torch.float64:
        return
    weights = torch.randn(expected[real].shape, generator=generator, dtype=expected.dtype)
    tables = [getattr(m, TABLE) for m in reference.modules() if hasattr(m, TABLE)]
    gated_tables = [p for n, p in gated.named_parameters() if n.endswith("urpe_gate.table")]
    for model in (gated, reference):  # (the reference's tables are fresh leaves: no grad yet)
        model.zero_grad(set_to_none=True)
        ((model(input_ids=ids, attention_mask=mask).logits[real] * weights).sum()).backward()
    for got, want in zip(gated_tables, tables, strict=True):
        torch.testing.assert_close(got.grad, want.grad, **tolerance)
    reference_weights = dict(reference.named_parameters())
    for name, parameter in gated.named_parameters():
        if name in reference_weights and parameter.grad is not None:
            torch.testing.assert_close(parameter.grad, reference_weights[name].grad, **tolerance)


OTHER_HEADS = [
    *((t, AutoModelForSeq2SeqLM) for t in sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)),
    *((t, AutoModelForMaskedLM) for t in sorted(MODEL_FOR_MASKED_LM_MAPPING_NAMES)),
]


@pytest.mark.parametrize("decay", [None, "fox"])
@pytest.mark.parametrize(
    ("model_type", "auto"), OTHER_HEADS, ids=[f"{t}-{a.__name__[12:]}" for t, a in OTHER_HEADS]
)
def test_encoder_decoders_and_masked_lms(model_type, auto, decay, tmp_path):
    """Refused by name, or: the base model's outputs at init (gate only), others with random
    tables, the same after save/load; an encoder-decoder's cached decoding (self-attention
    gated, cross-attention the model's own) equals one forward."""
    base = _base_model(model_type, auto)
    ids, mask = _inputs()
    seq2seq = auto is AutoModelForSeq2SeqLM
    feed = dict(input_ids=ids, attention_mask=mask)
    if seq2seq:
        generator = torch.Generator().manual_seed(4)
        feed["decoder_input_ids"] = torch.randint(3, VOCAB - 7, (2, 5), generator=generator)
    real = torch.ones(2, 5, dtype=torch.bool) if seq2seq else mask.bool()

    def outputs(model) -> torch.Tensor:
        with torch.no_grad():
            return model(**feed).logits[real]

    try:
        expected = outputs(base)
    except Exception as error:
        pytest.skip(f"{model_type}: the base model fails on these inputs ({error!r:.120})")
    gated = _gated(base, decay)
    if gated is None:
        return
    if decay is None:  # (T5's logits reach ~10: a relative tolerance too)
        torch.testing.assert_close(outputs(gated), expected, atol=1e-5, rtol=1e-5)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in urpe.hf.gate_parameters(gated):
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    assert (outputs(gated) - expected).abs().max() > 1e-4
    if seq2seq:
        start = gated.generation_config.decoder_start_token_id
        if start is None or start >= VOCAB:  # (none in T5's config; Marian's is its pad id)
            start = 1
        with torch.no_grad():
            out = gated.generate(
                ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                do_sample=False, pad_token_id=0, decoder_start_token_id=start,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            decoded = out.sequences[:, :-1]
            full = gated(input_ids=ids, attention_mask=mask, decoder_input_ids=decoded).logits
        torch.testing.assert_close(full[:, -NEW:], torch.stack(out.logits, 1), atol=1e-4, rtol=0)
    gated.save_pretrained(tmp_path)
    loaded = urpe.hf.from_pretrained(tmp_path, auto).eval()
    assert torch.equal(outputs(loaded), outputs(gated))
