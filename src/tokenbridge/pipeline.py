"""``tokenbridge run CONFIG``: datasets → generate → reconstruct → export → vocab → report.

Every stage is resumable and skipped when already done: a stage records a fingerprint
of its inputs (content hashes) and settings in ``RUN/pipeline.json`` after it finishes,
and runs again only when that fingerprint changes or its output is gone. Generation
resumes from its own store, so re-running after a crash continues where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from . import fsio, interrupt
from .display import printable
from .outdir import OutputKind, remove_own_output
from .runconfig import PipelineError, RunConfig, check_before_generate, load_run_config
from .runconfig import emulator_config as _emulator_config

__all__ = ["PipelineError", "RunConfig", "StageResult", "load_run_config", "run_pipeline"]


@dataclass
class StageResult:
    name: str
    status: str  # "ran" | "skipped"
    detail: dict[str, Any] = field(default_factory=dict)


# --- stage bookkeeping -------------------------------------------------------------------


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_identity(source: str) -> str:
    """A digest of the tokenizer's files (a folder), else its name: a changed vocab or
    template must re-run reconstruction."""
    folder = Path(source)
    if not folder.is_dir():
        return source
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file() and (p.suffix in (".model", ".json", ".jinja", ".py") or p.name == "tiktoken.model"):
            h.update(p.name.encode() + _digest(p).encode())
    return h.hexdigest()


def _fingerprint(inputs: list[Path], settings: Any) -> str:
    from . import __version__

    h = hashlib.sha256(json.dumps({"tokenbridge": __version__, **settings}, sort_keys=True, default=str).encode())
    for p in inputs:
        h.update(_digest(p).encode() if p.exists() else b"-")
    return h.hexdigest()


class _State:
    """RUN/pipeline.json: one fingerprint per finished stage, written atomically."""

    def __init__(self, out: Path):
        self.path = out / "pipeline.json"
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            self.data = {}

    def done(self, stage: str, fingerprint: str, output: Path) -> bool:
        return self.data.get(stage, {}).get("fingerprint") == fingerprint and output.exists()

    def record(self, stage: str, fingerprint: str, detail: Mapping[str, Any]) -> None:
        self.data[stage] = {"fingerprint": fingerprint, **detail}
        self._save()

    def forget(self, stage: str) -> None:
        if self.data.pop(stage, None) is not None:
            self._save()

    def _save(self) -> None:
        fsio.write_text(self.path, json.dumps(self.data, indent=2, default=str) + "\n", point="state")


def run_pipeline(cfg: RunConfig, echo: Callable[[str], None] = print) -> list[StageResult]:
    """Run every stage in order, holding the run folder's lock throughout; returns what
    each stage did. Raises PipelineError (and RunFolderBusy when another process holds
    the folder)."""
    from .generate.lock import run_lock

    with run_lock(cfg.out, command="run", retry=f"or set another [run] out in {cfg.source}"):
        for folder in (cfg.out, cfg.out / "export"):
            fsio.clean_stale_temps(folder)
        return _run_stages(cfg, echo)


def _run_stages(cfg: RunConfig, echo: Callable[[str], None]) -> list[StageResult]:
    from .emulator import running_emulator
    from .export import ExportJob, VocabJob, run_pass
    from .generate import generate_run, settings_from_mapping
    from .generate.outcome import describe_run
    from .view import status_text
    from .reconstruct import reconstruct_file
    from .report import RowStats, build_report
    from .tokenizer import load_tokenizer

    out = cfg.out
    state = _State(out)
    tok = load_tokenizer(cfg.tokenizer)
    check_before_generate(cfg, tok)  # the config checks that need the tokenizer, before any request
    results: list[StageResult] = []

    # 1. generate (resumes from its store; done samples are never sent again)
    settings = settings_from_mapping(cfg.generate, source=str(cfg.source), base_dir=cfg.source.parent)
    if cfg.use_emulator:
        context = running_emulator(_emulator_config(cfg), tokenizer=tok)
    else:
        context = nullcontext(None)
    with context as url:
        if url is not None:
            settings = settings.with_overrides(base_url=url)
            echo(f"generate: built-in emulator at {url}")
        with interrupt.kept_handlers():  # generate leaves the default ones behind
            summary = generate_run(settings, out)
    exchanges = out / "exchanges.jsonl"
    gen_detail = {"done": summary.done, "failed": summary.failed, "spent_usd": summary.spent_total,
                  "stop_reason": summary.stop_reason, "exit_code": summary.exit_code}
    results.append(StageResult("generate", "ran", gen_detail))
    echo(f"generate: {describe_run(summary)}")
    if summary.stop_reason:
        raise PipelineError(f"generate stopped ({summary.stop_reason}); fix it and run the same command again",
                            code=summary.exit_code or 1)
    if summary.exit_code not in _GENERATE_GOES_ON or not summary.exchanges:  # not rewritten: stale
        why = "; ".join(summary.notices[-3:]) or f"exit status {summary.exit_code}"
        raise PipelineError(f"generate failed ({why}); the later stages were not run on a stale {exchanges.name}; "
                            "fix it and run the same command again", code=summary.exit_code)
    if not exchanges.exists():
        raise PipelineError(f"generate wrote no {exchanges}")

    # 2. reconstruct
    reconstructed = out / "reconstructed.jsonl"
    fp = _fingerprint([exchanges], {"tokenizer": _tokenizer_identity(cfg.tokenizer), "dialect": cfg.dialect,
                                    "policy": dict(cfg.policy.severities), "tol": cfg.policy.usage_tolerance,
                                    "profile": dict(cfg.provider_profile or {})})
    if state.done("reconstruct", fp, reconstructed):
        results.append(StageResult("reconstruct", "skipped"))
    else:
        rs = reconstruct_file(exchanges, reconstructed, tok, dialect=cfg.dialect, policy=cfg.policy,
                              provider_profile=cfg.provider_profile)
        detail = rs.to_dict()
        state.record("reconstruct", fp, {"status": detail["status"], "bad_lines": len(rs.bad_lines),
                                         "provider_notes": detail["provider_notes"] + rs.calibration_notes()})
        results.append(StageResult("reconstruct", "ran", detail))
    echo(f"reconstruct: {results[-1].status} → {reconstructed}: {status_text(state.data['reconstruct'].get('status') or {})}")
    for note in state.data["reconstruct"].get("provider_notes") or ():
        echo(f"reconstruct: warning: {printable(note)}")  # names providers

    # 3-5. exports (one stage per format, skipped, not failed, when no row qualifies), draft vocabulary and the
    # report's row statistics, all from one pass over reconstructed.jsonl
    wanted = {"ok", "flagged"} if cfg.include_flagged else {"ok"}
    usable = sum(n for k, n in (state.data.get("reconstruct", {}).get("status") or {}).items() if k in wanted)
    exports: list[ExportJob] = []
    plan: dict[str, tuple[str, str]] = {}  # stage -> (fingerprint, "ran" | "skipped" | "empty"), in stage order
    for fmt in cfg.export_formats:
        target = out / "export" / fmt
        fp = _fingerprint([reconstructed], {"format": fmt, "include_flagged": cfg.include_flagged})
        if state.done(f"export:{fmt}", fp, target):
            plan[f"export:{fmt}"] = (fp, "skipped")
        elif not usable:
            plan[f"export:{fmt}"] = (fp, "empty")
        else:
            plan[f"export:{fmt}"] = (fp, "ran")
            exports.append(ExportJob(fmt, target, include_flagged=cfg.include_flagged))
    vocab_job = None
    if cfg.draft_vocab_size:
        target = out / "vocab"
        fp = _fingerprint([reconstructed], {"size": cfg.draft_vocab_size, "include_flagged": cfg.include_flagged})
        if not usable:
            plan["vocab"] = (fp, "empty")
        elif state.done("vocab", fp, target):
            plan["vocab"] = (fp, "skipped")
        else:
            plan["vocab"] = (fp, "ran")
            vocab_job = VocabJob(cfg.draft_vocab_size, target, target_vocab_size=tok.vocab_size,
                                 include_flagged=cfg.include_flagged)
    row_stats = RowStats() if cfg.report else None
    passed = run_pass(reconstructed, exports=exports, vocab=vocab_job, stats=row_stats, vocab_size=tok.vocab_size) \
        if exports or vocab_job is not None or row_stats is not None else None
    for stage, (fp, what) in plan.items():
        fmt = stage.partition(":")[2]
        target, kind = (out / "export" / fmt, "export") if fmt else (out / "vocab", "vocab")
        if what == "empty":
            results.append(StageResult(stage, "empty", {"rows": 0} if fmt else {}))
            echo((f"export {fmt}: nothing to export (no {'ok/flagged' if cfg.include_flagged else 'ok'} rows)" if fmt
                  else "vocab: nothing to count (no usable rows)") + _drop_stale(state, stage, target, kind))
            continue
        detail: dict[str, Any] = {}
        if what == "ran" and passed is not None:
            if fmt:
                es = next(e for e in passed.exports if e.format == fmt)
                detail = {"rows": es.rows_exported, "skipped": es.skipped}
            elif passed.vocab is not None:
                detail = {"coverage": passed.vocab.coverage, "distinct_tokens": passed.vocab.distinct_tokens}
            state.record(stage, fp, detail)
        results.append(StageResult(stage, what, detail))
        echo(f"export {fmt}: {what} → {target} {state.data[stage].get('rows')} rows" if fmt
             else f"vocab: {what} → {target} (coverage {state.data['vocab'].get('coverage'):.4f})")

    # report (cheap; always rebuilt so it reflects the latest run)
    if cfg.report:
        html = build_report(out, rows=row_stats)
        results.append(StageResult("report", "ran", {"html": str(html)}))
        echo(f"report: {html}")
    return results


#: generate's exit statuses after which the later stages run: all done, or some failed
_GENERATE_GOES_ON = (0, 1)


def _drop_stale(state: _State, stage: str, target: Path, kind: OutputKind) -> str:
    """Remove a stage's previous output (only if tokenbridge made it), so an old export is
    never taken for this run's; returns what to add to the stage's line."""
    state.forget(stage)
    if remove_own_output(target, kind):
        return f"; removed the previous {target} (it was made from older data)"
    if target.exists():
        return f"; {target} is not a tokenbridge {kind}, left alone"
    return ""
