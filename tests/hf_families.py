"""Tiny transformers models built from configs (random init, nothing downloaded), one per family
that urpe.hf supports, with inputs that include padding."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor

VOCAB = 61


@dataclass
class Family:
    name: str
    model_class: type
    config: object
    causal: bool  # a decoder-only LM (generate, left padding)
    seq2seq: bool = False
    encoder_only: bool = False  # outputs: last_hidden_state
    float32_eager: bool = False  # eager softmax runs in float32: compare in float32

    def build(self, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        model = self.model_class(copy.deepcopy(self.config))  # add_urpe edits model.config
        model.set_attn_implementation(attn_implementation)
        return model.to(dtype)

    def dtype(self, attn_implementation: str) -> torch.dtype:
        # Llama/Qwen2/Mistral/GPT-NeoX/GPTBigCode's eager softmax is computed in float32, and
        # in float64 its float64-min mask turns into -inf rows (NaN) under padding: float32
        # there, float64 everywhere else.
        if attn_implementation == "eager" and self.float32_eager:
            return torch.float32
        return torch.float64


def families() -> dict[str, Family]:
    t = transformers
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    # GPT-2's names for the sizes (GPTBigCode shares them), no dropout.
    gpt2_sizes = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    gpt2_sizes.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return {
        "llama": Family(
            "llama",
            t.LlamaForCausalLM,
            t.LlamaConfig(
                **small, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
            ),
            causal=True,
            float32_eager=True,
        ),
        "qwen2": Family(
            "qwen2",
            t.Qwen2ForCausalLM,
            t.Qwen2Config(
                **small, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64
            ),
            causal=True,
            float32_eager=True,
        ),
        "gpt2": Family(
            "gpt2",
            t.GPT2LMHeadModel,
            t.GPT2Config(**gpt2_sizes),
            causal=True,
        ),
        "bert": Family(
            "bert",
            t.BertModel,
            t.BertConfig(
                **small,
                num_attention_heads=4,
                max_position_embeddings=64,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            causal=False,
            encoder_only=True,
        ),
        "roberta": Family(
            "roberta",
            t.RobertaModel,
            t.RobertaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=70,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            causal=False,
            encoder_only=True,
        ),
        "mistral": Family(
            "mistral",
            t.MistralForCausalLM,
            t.MistralConfig(
                **small, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
            ),
            causal=True,
            float32_eager=True,
        ),
        "bart": Family(
            "bart",
            t.BartForConditionalGeneration,
            t.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                pad_token_id=0,
                bos_token_id=2,
                eos_token_id=1,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            ),
            causal=False,
            seq2seq=True,
        ),
        "t5": Family(
            "t5",
            t.T5ForConditionalGeneration,
            t.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=16,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
                eos_token_id=1,
            ),
            causal=False,
            seq2seq=True,
        ),
        "gpt_neox": Family(
            "gpt_neox",
            t.GPTNeoXForCausalLM,
            t.GPTNeoXConfig(
                **small,
                num_attention_heads=4,
                max_position_embeddings=64,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            ),
            causal=True,
            float32_eager=True,
        ),
        "gpt_bigcode": Family(  # multi-query attention: one key/value head
            "gpt_bigcode",
            t.GPTBigCodeForCausalLM,
            t.GPTBigCodeConfig(**gpt2_sizes),
            causal=True,
            float32_eager=True,
        ),
    }


def inputs(family: Family, batch: int = 2, length: int = 9) -> tuple[dict[str, Tensor], Tensor]:
    """Model inputs with padding, and a (B, L) bool tensor of the output positions that are real
    tokens (padded positions' outputs are not defined by either implementation)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if family.causal:
        mask[0, :3] = 0  # left padding, as for generation
    else:
        mask[0, -3:] = 0  # right padding
    ids = ids.masked_fill(mask == 0, 0)
    if family.seq2seq:
        decoder = torch.randint(2, VOCAB, (batch, 6), generator=g)
        feed = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}
        return feed, torch.ones(batch, 6, dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": mask}, mask.bool()


def outputs(family: Family, model, feed: dict[str, Tensor]) -> Tensor:
    out = model(**feed)
    return out.last_hidden_state if family.encoder_only else out.logits
