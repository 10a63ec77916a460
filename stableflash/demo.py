"""`stableflash demo`: the main job on the embedded default data, on CPU.

1. the seed's bit-level addition example;
2. the synthetic mechanism table (bias of O and δ on rows with tied maxima), and
   that bias split by rounding site;
3. (with the training layer) a small GPT trained with two attention settings
   on the same replayed data, and a report with figures.
"""

from __future__ import annotations

from pathlib import Path

SEED_EXAMPLE = (-2.4071154594421387, -2.296875)


def run_demo(out: Path, train: bool = True) -> None:
    from stableflash.diagnose.mechanism import mechanism_table
    from stableflash.numerics import explain_add

    out.mkdir(parents=True, exist_ok=True)
    print("== 1. The seed's BF16 addition (section 3.4.4) ==")
    print(explain_add(*SEED_EXAMPLE))

    print("\n== 2. Bias on rows with k tied maxima: mean signed error vs fp64, 99% CI over rows ==")
    print("(V and dO of one sign; 'paper' = the analysed bf16 implementation, one tile)")
    table = mechanism_table()
    (out / "mechanism.json").write_text(table.to_json())
    (out / "mechanism.md").write_text(table.to_markdown() + "\n")
    print(table.to_markdown())
    print(f"\nwritten: {out / 'mechanism.json'}")

    from stableflash.diagnose.bias import bias_attribution
    from stableflash.diagnose.mechanism import tied_maxima_inputs
    print("\n== 2b. Where the bias comes from: the 'paper' policy's bias split by rounding site (4 tied maxima) ==")
    print("(each site turned to fp32 alone; a site's share is the bias it removes; 99% CI over rows)")
    attribution = bias_attribution(*tied_maxima_inputs(4), "paper")
    attribution.save(out / "bias.json")
    print(attribution.to_markdown())

    if train:
        try:
            from stableflash.train.demo import train_demo
        except ImportError:
            print("(training layer not installed; skipped)")
            return
        print("\n== 3. Training: two attention settings on the same replayed data ==")
        train_demo(out)
