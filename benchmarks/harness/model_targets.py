"""Issue 28's targets for the model benchmark, as data, judged under every condition measured.

A target names one record (group, case, row, mode) and the measure compared with its limit:
`ratio` (time over the group's baseline in the same case, mode and condition) or `extra_us`
(microseconds over the baseline). It holds when the measure is at most the limit under every
condition measured (idle and one core busy). A control (limit None) is judged against nothing:
the same model timed twice, whose ratio shows how far a figure moves with nothing added.
"""

from __future__ import annotations

from dataclasses import dataclass

from .whole_steps import lm_pairs

BATCHES = ("batch 1", "batch 4")


@dataclass(frozen=True)
class Target:
    target: str
    group: str
    case: str
    name: str
    mode: str
    limit: float | None  # None: a control, judged against nothing (module docstring)
    measure: str = "ratio"  # or "extra_us"

    def judge(self, records: list[dict], conditions: list[dict]) -> dict:
        """{target, measure, limit, values: {condition label: value or None}, met}."""
        values, ranges = {}, {}
        for condition in conditions:
            record = next((r for r in records if self._matches(r, condition)), None)
            label = condition_label(condition)
            values[label] = None if record is None else record[self.measure]
            # over fresh processes (`--processes`): [lowest, highest], else None
            ranges[label] = None if record is None else record.get(f"{self.measure}_range")
        measured = [v for v in values.values() if v is not None]
        met = None
        if measured and self.limit is not None:
            met = all(v <= self.limit for v in measured)
        named = dict(target=self.target, measure=self.measure, limit=self.limit)
        return dict(named, values=values, ranges=ranges, met=met)

    def _matches(self, r: dict, condition: dict) -> bool:
        fields = dict(group=self.group, case=self.case, name=self.name, mode=self.mode)
        return (
            all(r.get(k) == v for k, v in (fields | condition).items())
            and r.get(self.measure) is not None
        )


def condition_label(condition: dict) -> str:
    return "one core busy" if condition["busy"] else "idle"


# fmt: off
TARGETS = (
    Target("one decoding call, no terms: us over SDPA", "calls", "decode", "auto_none", "fwd",
           10, "extra_us"),
    Target("one decoding call, Toeplitz gate: us over SDPA", "calls", "decode", "auto_gate",
           "fwd", 25, "extra_us"),
    Target("one decoding call, Toeplitz bias: us over SDPA", "calls", "decode", "auto_bias",
           "fwd", 25, "extra_us"),
    *(Target(f"short rows fwd+bwd, {case.replace('_', ' ')}: URPE auto / SDPA", "short", case,
             "auto_urpe", "fwdbwd", 1.4) for case in ("causal", "not_causal")),
    Target("bfloat16 forward, long rows: cpp URPE / SDPA", "bf16", "bf16", "cpp_urpe", "fwd",
           1.4),
    *(Target(f"library decoder, greedy generation, {case}: URPE / RPE", "decoder", case, "urpe",
             "generate", 1.15) for case in BATCHES),
    *(Target(f"HF Llama generate, eager, {case}: add_urpe / base", "hf_generate", case, "urpe",
             "generate", 1.15) for case in BATCHES),
    *(Target(f"HF Llama generate, static cache + torch.compile, {case}: add_urpe / base",
             "hf_compiled", case, "urpe", "generate", 1.1) for case in BATCHES),
    *(Target(f"control: HF Llama generate, {how}, {case}: base copy / base", group, case,
             "base copy", "generate", None)
      for group, how in (("hf_generate", "eager"), ("hf_compiled", "compiled"))
      for case in BATCHES),
    Target("HF Llama training step: add_urpe / base", "hf_train", "train", "urpe", "train", 1.05),
    *(Target(f"end-to-end step ({size}): URPE auto / no-PE SDPA", "end_to_end", size,
             "urpe_auto", "train", 1.1) for size in ("quick", "long")),
)
# fmt: on


def targets() -> tuple[Target, ...]:
    """TARGETS and one per pair of the LM experiment's speed check (read when called: the
    experiment is imported only then)."""
    steps = tuple(
        Target(f"LM experiment step: {urpe} / {base}", "lm_speed", urpe, "urpe", "train", 1.1)
        for base, urpe in lm_pairs()
    )
    return TARGETS + steps


def judge(records: list[dict], conditions: list[dict]) -> list[dict]:
    return [t.judge(records, conditions) for t in targets()]
