"""Instructions a tiny Llama executes to generate, with and without urpe: callgrind counts.

Wall-time ratios of generation move between processes of the same code by more than the
targets' margins on a shared VM (BENCHMARKS.md, issue 42). Instruction counts do not: this runs
one model per process under valgrind's callgrind, on one thread, zeroes the counters after a
warm-up generate, and counts two generates apart: the prompt alone (1 new token), then the prompt
and N new tokens. Their difference is N decoding steps.

    python benchmarks/count_instructions.py --models base gate fox --batch 1
    python benchmarks/count_instructions.py --models base gate --prompt 2048 --new-tokens 32
    python benchmarks/count_instructions.py --models base gate --compiled

Models: "base" (the benchmarks' tiny Llama), "gate" (`add_urpe()`), "fox" (`add_urpe(decay=
"fox")`), "fox-python" (the same with FoX's decoding step in Python, not the C++ call).
`--compiled`: transformers' fast path instead (a static cache, the decoding steps through
torch.compile with inductor; the warm-up compiles, outside the counts, and takes minutes
more). Needs valgrind and callgrind_control. The C++ kernel is built for AVX2
(`URPE_CPP_TARGET=haswell`, its own cache entry): valgrind runs no AVX-512 code. Each model
takes minutes (valgrind runs ~50x slower); the models run one after another.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("base", "gate", "fox", "fox-python")
READY, PROMPT_DONE, ALL_DONE = "urpe-count: ready", "urpe-count: prompt", "urpe-count: done"


def _child(
    model: str, batch: int, prompt_length: int, new_tokens: int, go: Path, compiled: bool
) -> None:
    """In the process valgrind runs: build the model, warm up, then the two counted generates,
    each started when the parent has zeroed the counters (it creates `go` + a suffix)."""
    import copy

    import torch
    import transformers

    import urpe.hf
    import urpe.hf.forget_history as forget_history

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=prompt_length + new_tokens + 1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    if model != "base":
        decay = "fox" if model.startswith("fox") else None
        llama = urpe.hf.add_urpe(copy.deepcopy(llama), decay=decay).eval()
    if model == "fox-python":
        forget_history.forget_step = lambda: None
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 512, (batch, prompt_length), generator=generator)

    def generate(n: int) -> None:
        with torch.no_grad():
            llama.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    if compiled:
        _static_compiled(llama)
    generate(new_tokens + 1)  # (a static cache is made for the longest generate, then reused)
    for step, (n, done) in enumerate(((1, PROMPT_DONE), (new_tokens + 1, ALL_DONE))):
        print(READY, flush=True)
        _wait(Path(f"{go}.{step}"))
        generate(n)
        print(done, flush=True)
    _wait(Path(f"{go}.end"))


def _static_compiled(llama) -> None:
    """transformers' fast path: a static cache, decoding steps compiled (inductor); on the CPU
    transformers compiles only when told to (`_compile_all_devices`)."""
    from transformers import CompileConfig

    config = CompileConfig(backend="inductor", dynamic=False)
    config._compile_all_devices = True
    llama.generation_config.cache_implementation = "static"
    llama.generation_config.compile_config = config


def _wait(path: Path) -> None:
    while not path.exists():
        time.sleep(0.1)


def _count(args, model: str, folder: Path) -> tuple[int, int]:
    """(instructions of the prompt's generate, of the prompt + N tokens'), for one model."""
    out = folder / f"{model}.callgrind"
    go = folder / f"{model}.go"
    for stale in (*folder.glob(f"{out.name}*"), *folder.glob(f"{go.name}*")):
        stale.unlink()  # (a kept folder's earlier run: its dumps would be read as this one's)
    env = dict(os.environ, URPE_CPP_TARGET="haswell", OMP_NUM_THREADS="1")
    if args.compiled:  # inductor's code for AVX2 too (its compiler runs outside valgrind)
        env.update(TORCHINDUCTOR_CPP_MARCH="haswell", ATEN_CPU_CAPABILITY="avx2")
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
        __file__, "--child", model, "--batch", str(args.batch), "--prompt", str(args.prompt),
        "--new-tokens", str(args.new_tokens), "--go", str(go),
        *(["--compiled"] if args.compiled else []),
    ]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                             text=True)  # fmt: skip
    counts = []
    try:
        for step in range(2):
            _expect(child, READY)
            _control(child.pid, "-z")
            Path(f"{go}.{step}").touch()
            _expect(child, PROMPT_DONE if step == 0 else ALL_DONE)
            _control(child.pid, "-d")
            counts.append(_newest_summary(folder, out.name))
        Path(f"{go}.end").touch()
        child.wait(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    return counts[0], counts[1]


def _expect(child: subprocess.Popen, line: str) -> None:
    for got in child.stdout:
        if got.strip() == line:
            return
    raise RuntimeError(f"the model's process ended before {line!r} (exit {child.wait()})")


def _control(pid: int, option: str) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, capture_output=True)


def _newest_summary(folder: Path, name: str) -> int:
    """The instruction total of the newest dump callgrind wrote for `name` (name.1, name.2...)."""
    for _ in range(100):
        dumps = sorted(folder.glob(f"{name}.*"), key=lambda p: int(p.suffix[1:]))
        if dumps:
            found = re.search(r"^summary: (\d+)", dumps[-1].read_text(), re.MULTILINE)
            if found:
                return int(found.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no dump for {name}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Instructions a tiny Llama executes to generate, with and without urpe "
        "(callgrind, one thread): the prompt alone, and N decoding steps.",
        epilog=__doc__.split("\n\n")[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["base", "gate", "fox"])
    parser.add_argument("--batch", type=_positive, default=1)
    parser.add_argument("--prompt", type=_positive, default=64, help="prompt tokens")
    parser.add_argument("--new-tokens", type=_positive, default=32, help="decoding steps")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="static cache and torch.compile (inductor), as transformers' fast path",
    )
    parser.add_argument(
        "--keep-dumps",
        metavar="FOLDER",
        help="keep callgrind's dumps here (MODEL.callgrind.1: the prompt, .2: the prompt and the "
        "steps), for callgrind_annotate; default: a temporary folder, removed",
    )
    parser.add_argument("--child", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        _child(args.child, args.batch, args.prompt, args.new_tokens, Path(args.go), args.compiled)
        return 0
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        print(f"count_instructions: needs {' and '.join(missing)} (e.g. apt install valgrind)")
        return 2
    # the kernel built natively first (valgrind runs no compiler children's work any faster)
    env = dict(os.environ, URPE_CPP_TARGET="haswell")
    subprocess.run([sys.executable, "-m", "urpe.kernels.cpp"], check=True, env=env)
    how = "static cache + torch.compile" if args.compiled else "eager, dynamic cache"
    print(
        f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, one thread, {how}"
    )
    results = {}
    keep = args.keep_dumps
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory() as folder:
        for model in args.models:
            print(f"{model:>10}: counting under valgrind (minutes)...", flush=True)
            started = time.perf_counter()
            try:
                prompt, total = _count(args, model, Path(folder))
            except (RuntimeError, subprocess.SubprocessError) as error:
                print(f"count_instructions: {model}: {error}")
                return 1
            results[model] = (prompt, total - prompt)
            print(
                f"{model:>10}: prompt {prompt / 1e6:,.1f} M, {args.new_tokens} steps "
                f"{(total - prompt) / 1e6:,.1f} M ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    if "base" in results:
        base_prompt, base_steps = results["base"]
        for model, (prompt, steps) in results.items():
            print(f"{model:>10} / base: prompt {prompt / base_prompt:.3f}x, steps "
                  f"{steps / base_steps:.3f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
