"""A small Hugging Face Llama with and without `urpe.hf.add_urpe`, for the model benchmark.

The model is built from a config (random weights, nothing downloaded); "urpe" is a copy of
"base" with a URPE gate per layer (ones at init, so both generate the same tokens). The generation
groups also time "base copy", a second copy of the base model (`copy.deepcopy`, as "urpe" is
made): the same code and weights, so its ratio to "base" is the comparison's noise floor (where
a process happens to place two models' tensors moves their speed by up to ~10%, BENCHMARKS.md).
Three groups:

    hf_generate   greedy `generate` (eager, transformers' dynamic cache)
    hf_compiled   the same with transformers' own fast path: a static cache, and the decoding
                  steps through `torch.compile` (generation_config.compile_config; on the CPU
                  transformers compiles only when told to, `_compile_all_devices`)
    hf_train      a training step: forward, backward (the LM loss), AdamW
"""

from __future__ import annotations

import copy

import torch

from .generation import per_batch
from .model_sizes import DecoderSize, Sizes
from .timed import Timed

BASELINE = "base"
CONTROL = "base copy"  # the same model again: what "urpe / base" reads with nothing added


def llama_pair(size: DecoderSize, context: int, seed: int = 0) -> dict:
    """{"base": LlamaForCausalLM (SDPA attention), "urpe": the same weights + add_urpe}."""
    import transformers

    import urpe.hf

    config = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.dim,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=context,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config)
    return {"base": base, "urpe": urpe.hf.add_urpe(copy.deepcopy(base))}


def _llama(d: DecoderSize) -> str:
    return (
        f"Llama, {d.layers} layers, width {d.dim}, FFN {d.ffn}, {d.heads} heads, "
        f"{d.kv_heads} KV heads, vocab {d.vocab}, random weights"
    )


def _static_compiled(model, backend: str) -> None:
    """Generation through transformers' fast path: a static cache, decoding steps compiled
    (`mode` is transformers' default for inductor; other backends take none)."""
    from transformers import CompileConfig

    options = {} if backend == "inductor" else dict(mode=None)
    compile_config = CompileConfig(backend=backend, dynamic=False, **options)
    compile_config._compile_all_devices = True  # transformers compiles on GPUs only otherwise
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = compile_config


def _greedy(model, prompt: torch.Tensor, new_tokens: int):
    mask = torch.ones_like(prompt)

    def generate() -> None:
        model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )

    return generate


def _generation(sizes: Sizes, progress, compile_backend: str | None) -> Timed:
    d = sizes.decoder
    pair = llama_pair(d, context=2 * (sizes.prompt + sizes.new_tokens))
    models = {BASELINE: pair[BASELINE], CONTROL: copy.deepcopy(pair[BASELINE]), **pair}
    for model in models.values():
        model.eval()
        if compile_backend is not None:
            _static_compiled(model, compile_backend)
    how = (
        f"static cache, decoding steps compiled ({compile_backend})"
        if compile_backend
        else "eager, dynamic cache"
    )
    about = (
        f"{sizes.new_tokens} tokens after a {sizes.prompt}-token prompt, greedy "
        f"(min_new_tokens={sizes.new_tokens}); {_llama(d)}; {how}. {CONTROL}: a second copy "
        "of the base model, the comparison's noise floor."
    )
    note = " (compiles)" if compile_backend else ""
    return per_batch(sizes, models, _greedy, about, progress, warmups=2, note=note)


def hf_generation(sizes: Sizes, progress) -> Timed:
    return _generation(sizes, progress, None)


def hf_compiled_generation(sizes: Sizes, progress, compile_backend: str = "inductor") -> Timed:
    return _generation(sizes, progress, compile_backend)


def _train_step(model, tokens: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()

    return step


def hf_training(sizes: Sizes, progress) -> Timed:
    d = sizes.decoder
    batch, length = sizes.train
    models = llama_pair(d, context=length)
    tokens = torch.randint(0, d.vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    calls = {(name, "train"): _train_step(model.train(), tokens) for name, model in models.items()}
    for call in calls.values():
        call()
    about = f"{_llama(d)}; forward, backward (LM loss), AdamW step."
    return Timed(cases={"train": calls}, shapes={"train": f"B={batch}, L={length}"}, about=about)
