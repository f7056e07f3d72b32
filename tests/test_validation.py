"""Bad input gets one clear error naming the argument."""

import pytest
import torch

import urpe


def qkv(b=2, h=3, l=5, d=4):
    return (torch.randn(b, h, l, d) for _ in range(3))


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have shape \(\.\.\., H, L, D\)"):
        urpe.attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match="q, k, v must share their leading"):
        urpe.attention(q, k, v[0])
    with pytest.raises(ValueError, match="q, k, v must share their leading"):
        urpe.attention(q, k[:1], v[:1])


def test_mismatched_heads_and_dims():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch and heads.*enable_gqa=True"):
        urpe.attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="multiple"):
        urpe.attention(q, k[:, :2], v[:, :2], enable_gqa=True)
    with pytest.raises(ValueError, match="k and v must have the same heads"):
        urpe.attention(q, k, v[:, :1], enable_gqa=True)
    with pytest.raises(ValueError, match="k head dim"):
        urpe.attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="v length"):
        urpe.attention(q, k, v[:, :, :4])


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="share a dtype"):
        urpe.attention(q, k.double(), v)
    with pytest.raises(TypeError, match="floating point"):
        urpe.attention(q.long(), k.long(), v.long())


def test_unknown_normalization():
    with pytest.raises(ValueError, match="normalization must be one of"):
        urpe.attention(*qkv(), normalization="sparsemax")


def test_toeplitz_table_of_even_width():
    with pytest.raises(ValueError, match="width must be odd"):
        urpe.Toeplitz(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"shape \(H, 2K\+1\)"):
        urpe.Toeplitz(torch.zeros(3))
    with pytest.raises(TypeError, match="Tensor"):
        urpe.Toeplitz([1.0, 2.0, 3.0])


def test_term_heads_and_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="bias table has 2 heads"):
        urpe.attention(q, k, v, bias=urpe.Toeplitz(torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="gate of shape"):
        urpe.attention(q, k, v, gate=torch.ones(2, 3, 5, 4))
    with pytest.raises(ValueError, match="gate index has shape"):
        urpe.attention(q, k, v, gate=urpe.Relation(torch.ones(3, 2), torch.zeros(2, 4, 5).long()))
    with pytest.raises(TypeError, match="Relation index must be an integer"):
        urpe.Relation(torch.ones(3, 2), torch.zeros(2, 5, 5))
    with pytest.raises(TypeError, match="bias must be a Tensor, urpe.Toeplitz, urpe.Relation or"):
        urpe.attention(q, k, v, bias=3.0)


def test_key_padding_mask_checks():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
        urpe.attention(q, k, v, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"key_padding_mask of shape \(2, 4\) does not broadcast"):
        urpe.attention(q, k, v, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must broadcast.*got rank 3"):
        urpe.attention(q, k, v, key_padding_mask=torch.zeros(1, 2, 5, dtype=torch.bool))


def test_attn_mask_checks():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="attn_mask must be bool .* or floating point"):
        urpe.attention(q, k, v, torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 5\) does not broadcast"):
        urpe.attention(q, k, v, torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a Tensor"):
        urpe.attention(q, k, v, [[True]])


def test_relation_index_shape_and_range():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"bias index of shape \(3, 5, 5\) does not broadcast"):
        urpe.attention(q, k, v, bias=urpe.Relation(torch.ones(3, 2), torch.zeros(3, 5, 5).long()))
    index = torch.zeros(2, 5, 5, dtype=torch.long)
    index[0, 0, 0] = -1
    with pytest.raises(ValueError, match=r"gate index must lie in \[0, 2\).*got -1"):
        urpe.attention(q, k, v, gate=urpe.Relation(torch.ones(3, 2), index))


def test_scale_seed_and_flags():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be finite"):
        urpe.attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a float"):
        urpe.attention(q, k, v, scale="1")
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        urpe.attention(q, k, v, is_causal=None)
    with pytest.raises(ValueError, match="dropout_seed must be an int or a 0-dim integer"):
        urpe.attention(q, k, v, dropout_p=0.1, dropout_seed=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="backend must be a string"):
        urpe.attention(q, k, v, backend=None)


def test_dropout_range():
    with pytest.raises(ValueError, match="dropout_p"):
        urpe.attention(*qkv(), dropout_p=1.5)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="position must be one of"):
        urpe.TransformerConfig(vocab_size=3, position="xpos")
    with pytest.raises(ValueError, match="gate must be one of"):
        urpe.TransformerConfig(vocab_size=3, gate="diag")
    with pytest.raises(ValueError, match="divisible"):
        urpe.TransformerConfig(vocab_size=3, dim=10, num_heads=3)
    with pytest.raises(ValueError, match="mixers"):
        urpe.TransformerConfig(vocab_size=3, num_layers=2, mixers={5: "conv"})


def test_model_input_errors():
    model = urpe.TransformerEncoder(
        urpe.TransformerConfig(vocab_size=5, max_len=8, dim=16, num_heads=2, num_layers=1)
    )
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.tensor([[1, 7]]))
    with pytest.raises(ValueError, match=r"tokens must be an integer tensor of shape \(B, L\)"):
        model(torch.ones(1, 3))
    with pytest.raises(ValueError, match="key_padding_mask must be bool"):
        model(torch.ones(1, 3).long(), key_padding_mask=torch.zeros(1, 3))
