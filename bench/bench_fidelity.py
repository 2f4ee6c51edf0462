"""How well the gate separates exact samples from wrong ones, per model family, per
provider quirk and per serving engine.

The bundled prompts go through the emulator once per provider, each provider showing a
single quirk on every response (plus a clean one), or one engine profile (``engine =
"sglang"`` / ``"vllm"``: what those stacks' parsers and detokenizers serve for the family),
once per family (every folder in ../shared/tokenizers; DeepSeek in thinking and instant
mode). The synthetic Kimi model opens a share of its tool calls without ``</think>``
(``--no-think-close``), as Kimi K2 does. The emulator knows the ids its
synthetic model emitted and returns them; reconstruction runs with those ids withheld,
as it must for a real text-only API, and every verdict is compared with the truth:

  ok, exact        passed, and the ids equal the model's      (what we want)
  ok, WRONG        passed, but the ids differ                 (the gate missed it)
  caught           not ok, and the ids differ                 (the gate caught it)
  cautious         not ok, although the ids are exact         (rejected for a reason the
                                                               ids cannot show, e.g. a leak)

    python bench/bench_fidelity.py [--families kimi-k2.5,qwen3,...] [--tokenizer DIR] [--limit N] [--no-think-close RATE]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenbridge.emulator.families import FamilyProfile

ROOT = Path(__file__).resolve().parents[1]


def _providers(family: FamilyProfile):
    """One provider per quirk and per engine profile the family has. ``no_stop_trim`` is an
    SGLang request flag, so it rides on the SGLang profile (gpt-oss, where the stop is text
    the parser reads; elsewhere the stop is a skipped special token). gpt-oss has no vLLM
    profile."""
    from tokenbridge.emulator import ProviderConfig, ProviderQuirks

    harmony = family.writer == "harmony"
    out = [ProviderConfig(name="clean/fp8")]
    for f in fields(ProviderQuirks):
        if f.name != "no_stop_trim":
            out.append(ProviderConfig(name=f"{f.name.replace('_', '-')}/fp8", quirks=ProviderQuirks(**{f.name: 1.0})))
    for engine in ("sglang", "vllm") if family.vllm_reasoning != "unmodelled" else ("sglang",):
        out.append(ProviderConfig(name=f"engine-{engine}/fp8", engine=engine))
    if harmony:
        out.append(ProviderConfig(name="engine-sglang-no-stop-trim/fp8", engine="sglang",
                                  quirks=ProviderQuirks(no_stop_trim=1.0)))
    return tuple(out)


def _strip_truth(record: dict) -> tuple[dict, list | None, list]:
    rec = copy.deepcopy(record)
    prompt = rec["response"].pop("prompt_token_ids", None)
    choices = [c.pop("token_ids", None) for c in rec["response"].get("choices") or []]
    return rec, prompt, choices


#: (family row, tokenizer folder, model id, request ``reasoning``): every family in
#: ../shared/tokenizers; DeepSeek thinks only when asked, so it runs in both modes.
_FAMILIES = (
    ("kimi-k2.5", "kimi-k2.5", "moonshotai/kimi-k2.5", None),
    ("qwen3", "qwen3", "qwen/qwen3-235b-a22b", None),
    ("deepseek-v3.1 thinking", "deepseek-v3.1", "deepseek/deepseek-chat-v3.1", {"enabled": True}),
    ("deepseek-v3.1 instant", "deepseek-v3.1", "deepseek/deepseek-chat-v3.1", None),
    ("deepseek-v3.2 thinking", "deepseek-v3.2", "deepseek/deepseek-v3.2", {"enabled": True}),
    ("deepseek-v3.2 instant", "deepseek-v3.2", "deepseek/deepseek-v3.2", None),
    ("glm-4.5", "glm-4.5", "z-ai/glm-4.5", None),
    ("gpt-oss", "gpt-oss", "openai/gpt-oss-120b", None),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="one tokenizer folder instead of every family (its row is named after the folder)")
    ap.add_argument("--families", default=",".join(f for f, *_ in _FAMILIES),
                    help="family rows to run, comma-separated (default: all)")
    ap.add_argument("--limit", type=int, default=None, help="prompts per dataset (default: all 216)")
    ap.add_argument("--no-think-close", type=float, default=0.15,
                    help="share of tool calls the model opens without </think> (Kimi only; default 0.15)")
    args = ap.parse_args()

    if args.tokenizer is not None:
        runs = [(args.tokenizer.name, args.tokenizer, "moonshotai/kimi-k2.5", None)]
    else:
        wanted = args.families.split(",")
        unknown = sorted(set(wanted) - {f for f, *_ in _FAMILIES})
        if unknown:
            raise SystemExit(f"unknown family rows: {', '.join(unknown)}")
        runs = [(f, ROOT.parent / "shared" / "tokenizers" / folder, model, reasoning)
                for f, folder, model, reasoning in _FAMILIES if f in wanted]
    summary: dict[str, tuple[Counter, Counter]] = {}
    for family, folder, model, reasoning in runs:
        print(f"## {family}")
        print()
        summary[family] = _run_family(folder, model, reasoning, args)
        print()
    print("## Per family")
    print()
    print("| family | samples | passed (each alone) | wrong passes | wrong samples caught | passed (whole run) | wrong passes | wrong samples caught |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for family, (alone, run) in summary.items():
        print(f"| {family} | {sum(alone.values())} | " + " | ".join(_totals(alone)) + " | " + " | ".join(_totals(run)) + " |")


def _totals(total: Counter) -> list[str]:
    passed = total["ok, exact"] + total["ok, WRONG"]
    wrong = total["caught"] + total["ok, WRONG"]
    return [str(passed), f"{total['ok, WRONG']} ({total['ok, WRONG'] / max(passed, 1):.1%})", f"{total['caught']}/{wrong}"]


def _run_family(folder: Path, model: str, reasoning: dict | None, args: argparse.Namespace) -> tuple[Counter, Counter]:
    from tokenbridge.emulator import EmulatorConfig, running_emulator
    from tokenbridge.generate import generate_run, settings_from_mapping
    from tokenbridge.generate.settings import _builtin_path
    from tokenbridge.reconstruct import reconstruct_file, reconstruct_record
    from tokenbridge.chat import resolve_dialect
    from tokenbridge.emulator.families import family_profile
    from tokenbridge.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    providers = _providers(family_profile(resolve_dialect(tok)))
    datasets = [{"name": n, "path": _builtin_path(f"builtin:prompts/{n}.jsonl"), **({"limit": args.limit} if args.limit else {})}
                for n in ("chat", "sharegpt", "plain")]
    table: dict[str, Counter] = {}
    codes: dict[str, Counter] = {}
    truths: dict[tuple, tuple] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, running_emulator(
        EmulatorConfig(providers=providers, models=(model,), tool_call_without_think_close=args.no_think_close),
        tokenizer=tok,
    ) as url:
        combined = (Path(tmp) / "all.jsonl").open("w", encoding="utf-8")
        for prov in providers:
            out = Path(tmp) / prov.slug
            settings = settings_from_mapping({
                "base_url": url, "model": model, "concurrency": 32, "max_tokens": 2048,
                "progress": "none", "provider": {"only": [prov.name], "allow_fallbacks": False},
                "extra_body": {"return_token_ids": True}, "datasets": datasets,
                **({"reasoning": reasoning} if reasoning else {}),
            })
            summary = generate_run(settings, out)
            assert summary.failed == 0, (prov.name, summary)
            counts, seen = Counter(), Counter()
            for line in (out / "exchanges.jsonl").open(encoding="utf-8"):
                rec, truth_prompt, truth = _strip_truth(json.loads(line))
                combined.write(json.dumps(rec, ensure_ascii=False) + "\n")
                for row, native in zip(reconstruct_record(rec, tok), truth):
                    truths[(str(row["provider"]), row["id"], row["choice"])] = (truth_prompt, native)
                    _tally(row, truth_prompt, native, counts, seen)
            table[prov.name], codes[prov.name] = counts, seen
        combined.close()
        # the run-level view: one reconstruct over every provider's exchanges, so each
        # provider's traits (calibration, stripping, vLLM's joined text) are found and applied
        # and what `tokenbridge probe`'s echo tests say of each provider, as --provider-profile
        from tokenbridge.generate import probe
        from tokenbridge.traits import INVISIBLE_EDITS

        reports = probe(model=model, providers=[p.name for p in providers], base_url=url, key=None,
                        tokenizer=tok, max_tokens=512)
        # An edit the tokenizer itself makes (Qwen3's NFC normalizer: its model cannot emit
        # decomposed text, so every provider echoes NFC) is no provider's; probe does not
        # know the tokenizer, so its finding is dropped here and said so below.
        own = {"nfc"} if tok.decode(tok.encode("e\u0301")) != "e\u0301" else set()
        profile = {r.provider: tuple(e for e in r.profile()["text_edits"] if e in INVISIBLE_EDITS and e not in own)
                   for r in reports}
        summary = reconstruct_file(Path(tmp) / "all.jsonl", Path(tmp) / "all.out.jsonl", tok, provider_profile=profile)
        notes = summary.stripping_suspects() + summary.calibration_notes()
        notes += [f"probe's {e} finding dropped for every provider: the {folder.name} tokenizer normalizes {e} itself"
                  for e in sorted(own)]
        run_table: dict[str, Counter] = {}
        run_codes: dict[str, Counter] = {}
        for line in (Path(tmp) / "all.out.jsonl").open(encoding="utf-8"):
            row = json.loads(line)
            truth_prompt, native = truths[(str(row["provider"]), row["id"], row["choice"])]
            _tally(row, truth_prompt, native, run_table.setdefault(str(row["provider"]), Counter()),
                   run_codes.setdefault(str(row["provider"]), Counter()))

    print(f"{sum(sum(c.values()) for c in table.values())} samples, {len(providers)} providers, one quirk at rate 1.0 or"
          f" one engine profile each; tokenizer {folder.name}, model {model}"
          f"{', reasoning ' + json.dumps(reasoning) if reasoning else ''}; native ids withheld from reconstruction,"
          f" then compared; {time.monotonic() - started:.0f} s")
    print()
    print("Each sample alone (reconstruct_record, no run-level traits):")
    print()
    alone = _print_table(table, codes)
    print()
    print("The whole run (reconstruct_file over every provider's exchanges: run-level traits applied, and the")
    print("profile `tokenbridge probe` measured against the same emulator as --provider-profile):")
    print()
    run = _print_table(run_table, run_codes)
    print()
    print("run-level provider notes:")
    for note in notes + [f"{p}: probe found {', '.join(e)}" for p, e in sorted(profile.items()) if e] or ["(none)"]:
        print(f"- {note}")
    return alone, run


def _tally(row: dict, truth_prompt: list | None, native: list, counts: Counter, seen: Counter) -> None:
    exact = row["completion_ids"] == native and row["prompt_ids"] == truth_prompt
    if row["status"] == "ok":
        counts["ok, exact" if exact else "ok, WRONG"] += 1
    else:
        counts["cautious" if exact else "caught"] += 1
        seen.update({f["code"] for f in row["findings"] if f["severity"] == "error"} or {"(warnings only)"})


def _print_table(table: dict[str, Counter], codes: dict[str, Counter]) -> Counter:
    cols = ["ok, exact", "ok, WRONG", "caught", "cautious"]
    print("| provider (quirk at rate 1.0, or engine) | " + " | ".join(cols) + " | codes on rejected samples |")
    print("|---|" + "---:|" * len(cols) + "---|")
    for name, counts in table.items():
        top = ", ".join(f"{c} {n}" for c, n in codes[name].most_common(3))
        print(f"| {name} | " + " | ".join(str(counts.get(c, 0)) for c in cols) + f" | {top} |")
    total = Counter()
    for c in table.values():
        total.update(c)
    passed = total["ok, exact"] + total["ok, WRONG"]
    print()
    print(f"passed {passed}: {total['ok, WRONG']} wrong ({total['ok, WRONG'] / max(passed, 1):.1%}); "
          f"wrong samples caught: {total['caught']}/{total['caught'] + total['ok, WRONG']}; "
          f"exact samples kept: {total['ok, exact']}/{total['ok, exact'] + total['cautious']}")
    return total


if __name__ == "__main__":
    main()
