"""Our exports through the trainers' OWN loaders (SpecForge, speculators), pinned versions.

Install: ``pip install torch==2.13.0 && pip install --no-deps -r requirements-trainers.txt``.
Without them these tests skip locally and FAIL in CI (``CI=true``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
from collections import Counter

import numpy as np
import pytest

from conftest import ROOT
from test_export_support import make_run, read_jsonl, write_jsonl
from typer.testing import CliRunner

from tokenbridge.cli import app
from tokenbridge.export import build_vocab, export_file
from tokenbridge.tokenizer import TokenizerError, load_tokenizer

V = 163840


def _pins() -> dict[str, str]:
    text = (ROOT / "requirements-trainers.txt").read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, flags=re.M))


def _need(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = f"{module} not importable ({exc}); pip install --no-deps -r requirements-trainers.txt"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def torch():
    return _need("torch")


def test_pinned_versions_are_installed():
    _need("specforge.data.prompt_builder")
    _need("speculators.train.data")
    for name, version in _pins().items():
        assert importlib.metadata.version(name) == version, name


@pytest.fixture(scope="module")
def run(kimi, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainers")
    rows = make_run(kimi, 30, seed=2)[1]
    src = write_jsonl(root / "reconstructed.jsonl", rows)
    return root, src, [r for r in rows if r["status"] == "ok"]


def _ours(want):
    return [(w["input_ids"], w["loss_mask"]) for w in want]


# --- SpecForge ----------------------------------------------------------------------------


def test_specforge_prompt_tasks_equal_ours(run):
    prompt_builder = _need("specforge.data.prompt_builder")
    root, src, want = run
    export_file(src, root / "sf", "specforge")
    tasks = prompt_builder.prepare_prompt_tasks(
        root / "sf" / "train.jsonl", None, chat_template=None, max_length=1 << 20, is_preformatted=False,
        train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
    )
    assert [(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks] == _ours(want)


def test_specforge_loads_our_vocab_mapping(run, torch, tmp_path):
    base = _need("specforge.modeling.draft.base")
    teacher = _need("specforge.core.compact_teacher")
    preprocessing = _need("specforge.data.preprocessing")
    _, src, want = run
    counter = Counter()
    for w in want:
        counter.update(w["completion_ids"])
    for n in (50, len(counter) + 30):  # with ties to break, and with unseen ids to fill
        summary = build_vocab(src, n, tmp_path / str(n), V)
        draft = torch.nn.Module()
        draft.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
        draft.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
        base.Eagle3DraftModel.load_vocab_mapping(draft, str(tmp_path / str(n) / "vocab_mapping.pt"))
        teacher.validate_vocab_mapping_consistency(draft.t2d, draft.d2t)
        # SpecForge's own builder on the same counts (Counter in id order: its ties follow insertion)
        d2t, t2d = preprocessing.process_token_dict_to_mappings(Counter(dict(sorted(counter.items()))), n, V)
        assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
        assert draft.d2t.tolist() == np.load(tmp_path / str(n) / "d2t.npy").tolist()
        assert summary.filled_unseen == max(0, n - len(counter))


# --- speculators --------------------------------------------------------------------------


def test_speculators_arrow_dataset_yields_our_ids_and_masks(run, torch, tmp_path):
    data = _need("speculators.train.data")
    hs_connectors = _need("hs_connectors")
    from safetensors.torch import save_file

    root, src, want = run
    out = root / "spec"
    export_file(src, out, "speculators")
    # Cached "hidden states" with the ids we expect; ArrowDataset compares them with the
    # dataset's input_ids and reads loss_mask from the dataset itself.
    hs = tmp_path / "hidden_states"
    hs.mkdir()
    for i, w in enumerate(want):
        ids = torch.tensor(w["input_ids"], dtype=torch.long)
        save_file({"token_ids": ids, "hidden_states": torch.zeros(len(ids), 4, 2)}, hs / f"hs_{i}.safetensors")
    ds = data.ArrowDataset(max_len=1 << 16, datapath=str(out), transfer=hs_connectors.FileTransfer(hs), on_missing="raise")
    assert len(ds) == len(want)
    assert ds.approx_lengths == [len(w["input_ids"]) for w in want]
    items = [ds[i] for i in range(len(ds))]
    assert [(x["input_ids"].tolist(), x["loss_mask"].tolist()) for x in items] == _ours(want)
    batch = data.CollateFn(max_len=4096, hidden_size=2)(items[:3])
    n = sum(len(w["input_ids"]) for w in want[:3])
    assert batch["input_ids"][0, :n].tolist() == sum((w["input_ids"] for w in want[:3]), [])
    assert batch["loss_mask"][0, :n].tolist() == sum((w["loss_mask"] for w in want[:3]), [])


def test_the_options_the_cards_name_are_the_pinned_trainers_own(run, torch):
    """The speculators card's `--train-data-ratio` and its split by row index (validation is
    the file's last rows), and the conversations card's SpecForge `data.train_only_last_turn`."""
    resolution = _need("speculators.train.config.resolution")
    schema = _need("speculators.train.config.schema")
    data = _need("speculators.train.data")
    specforge_schema = _need("specforge.config.schema")
    from test_export import SPLIT_NOTE, TURNS_NOTE

    root, src, want = run
    out = root / "split"
    export_file(src, out, "speculators")
    assert SPLIT_NOTE.format(dir=out) in (out / "README.md").read_text(encoding="utf-8")
    assert resolution.build_parser().parse_args(["--train-data-ratio", "0.5"]).train_data_ratio == 0.5
    assert schema.DataArgs.model_fields["train_data_ratio"].default == 0.9
    assert resolution._partition_yaml_keys({"data": {"train_data_ratio": 0.5}}) == ({"train_data_ratio"}, set())
    k = int(len(want) * 0.9)
    val = data.ArrowDataset(max_len=1 << 16, datapath=str(out), on_missing="skip", train_ratio=0.9, split="val")
    assert val.start_file_idx == k and val.data.with_format(None)["id"] == [w["id"] for w in want[k:]]
    assert "`data.train_only_last_turn: true`" in TURNS_NOTE
    assert specforge_schema.DataConfig.model_fields["train_only_last_turn"].default is False
    assert specforge_schema.DataConfig(prompts_path="x", train_only_last_turn=True).train_only_last_turn is True


@pytest.mark.parametrize("fmt", ["specforge", "parquet"])
def test_speculators_prepare_data_passes_our_rows_through(run, fmt):
    preprocessing = _need("speculators.data_generation.preprocessing")
    from datasets import load_dataset

    root, src, want = run
    out = root / f"pd-{fmt}"
    export_file(src, out, fmt)
    if fmt == "specforge":
        raw = load_dataset("json", data_files=str(out / "train.jsonl"), split="train")
    else:
        raw = load_dataset("parquet", data_files=str(out / "data" / "*.parquet"), split="train")
    ds = preprocessing.build_speculator_training_dataset(raw, processor=None, max_length=1 << 20, num_proc=1)
    plain = ds.with_format(None)
    assert list(zip(plain["input_ids"], plain["loss_mask"])) == _ours(want)
    assert plain["seq_len"] == [len(w["input_ids"]) for w in want]


def test_speculators_loads_our_vocab(run, torch, tmp_path):
    cli = _need("speculators.train.cli")
    vocab_mapping = _need("speculators.train.vocab_mapping")
    model = _need("speculators.model")
    from datasets import load_from_disk

    root, src, want = run
    n = 60
    build_vocab(src, n, tmp_path, V)
    d2t, t2d, size = cli._load_mappings(str(tmp_path / "d2t.npy"), str(tmp_path / "t2d.npy"), n)
    assert size == n and d2t.dtype == torch.long and t2d.dtype == torch.bool
    # speculators' own builder from our token_freq.pt gives the same mapping
    freq = torch.load(tmp_path / "token_freq.pt", weights_only=True)
    ref_d2t, ref_t2d = vocab_mapping.build_vocab_mappings_from_distribution(freq, n, V)
    assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d)
    # and its frequency counter over our speculators export gives the same counts
    export_file(src, root / "spec-freq", "speculators")
    vocab_mapping.save_token_frequency_distribution(load_from_disk(str(root / "spec-freq")), tmp_path / "theirs.pt")
    assert torch.load(tmp_path / "theirs.pt", weights_only=True) == freq
    draft = torch.nn.Module()
    draft.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))
    draft.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
    draft.use_draft_vocab, draft.verifier_vocab_size, draft.draft_vocab_size = True, V, n
    model.DraftVocabMixin.load_vocab_mappings(draft, t2d, d2t)
    assert torch.equal(draft.d2t, d2t) and int(draft.t2d.sum()) == n


def test_conversations_load_as_trainer_raw_data(run):
    preprocessing = _need("speculators.data_generation.preprocessing")
    root, src, want = run
    export_file(src, root / "conv", "conversations")
    raw, _ = preprocessing.load_raw_dataset(str(root / "conv" / "conversations.jsonl"))
    assert raw["id"] == [w["id"] for w in want]
    ours = read_jsonl(root / "conv" / "conversations.jsonl")
    assert [c[-1]["content"] for c in raw["conversations"]] == [w["content"] for w in want]
    assert [[t["role"] for t in c] for c in raw["conversations"]] == [[t["role"] for t in o["conversations"]] for o in ours]


# --- t2d as long as the model's output layer -------------------------------------------------


def _with_model_config(src_dir, dst, config):
    """The tokenizer folder ``src_dir`` as a user has it from the Hub: plus the model's config.json."""
    dst.mkdir()
    for f in src_dir.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_t2d_takes_the_models_vocab_size_from_config_json_and_both_trainers_load_it(run, torch, tmp_path, kimi_dir):
    """A model's ``lm_head`` is often padded past its tokenizer's ids (Qwen3: 151,936 rows for
    151,669 ids). Both trainers load a ``t2d`` only at that length; it was sized to the
    tokenizer, so every family but Kimi failed at training time."""
    base = _need("specforge.modeling.draft.base")
    model = _need("speculators.model")
    _, src, _ = run
    padded = V + 160
    folder = _with_model_config(kimi_dir, tmp_path / "k25", {"text_config": {"vocab_size": padded}})
    res = CliRunner().invoke(app, ["vocab", str(src), "-n", "40", "-o", str(tmp_path / "v"), "--tokenizer", str(folder)])
    assert res.exit_code == 0 and "warning" not in res.output, res.output
    summary = json.loads((tmp_path / "v" / "vocab.json").read_text())
    assert (summary["target_vocab_size"], summary["target_vocab_size_from"]) == (padded, "config.json")
    assert np.load(tmp_path / "v" / "t2d.npy").shape == (padded,)
    draft = torch.nn.Module()
    draft.register_buffer("t2d", torch.zeros(padded, dtype=torch.bool))
    draft.register_buffer("d2t", torch.zeros(40, dtype=torch.long))
    base.Eagle3DraftModel.load_vocab_mapping(draft, str(tmp_path / "v" / "vocab_mapping.pt"))
    draft.use_draft_vocab, draft.verifier_vocab_size, draft.draft_vocab_size = True, padded, 40
    model.DraftVocabMixin.load_vocab_mappings(draft, draft.t2d.clone(), draft.d2t.clone())
    assert int(draft.t2d.sum()) == 40


def test_a_tokenizer_without_the_models_size_warns_and_says_how_to_give_it(run, tmp_path):
    """Qwen3's folder as shipped here has no config.json: t2d gets the tokenizer's 151,669
    ids, which the trainers refuse for a 151,936-row model, so the command says so."""
    _, src, _ = run
    qwen = ROOT.parent / "shared" / "tokenizers" / "qwen3"
    assert load_tokenizer(qwen).model_vocab_size is None
    assert load_tokenizer(_with_model_config(qwen, tmp_path / "q", {"vocab_size": 151936})).output_vocab_size == 151936
    bad = _with_model_config(qwen, tmp_path / "bad", {"vocab_size": "151936"})
    with pytest.raises(TokenizerError, match=r"config.json: vocab_size must be an integer in 1\.\.16777216, got '151936'"):
        load_tokenizer(bad)
    # a config.json that is no model config (a list, broken JSON) is not the tokenizer's business: no size
    assert load_tokenizer(_with_model_config(qwen, tmp_path / "list", [1, 2])).model_vocab_size is None
    broken = _with_model_config(qwen, tmp_path / "broken", {})
    (broken / "config.json").write_text("{vocab_size: 1")
    assert load_tokenizer(broken).model_vocab_size is None
    nested = _with_model_config(qwen, tmp_path / "nested", {"vocab_size": None, "text_config": {"vocab_size": 151936}})
    assert load_tokenizer(nested).model_vocab_size == 151936
    rows = read_jsonl(src)
    for r in rows:  # ids inside Qwen3's range (what they spell does not matter to the count)
        for key in ("prompt_ids", "completion_ids", "input_ids"):
            r[key] = [i % 150000 for i in r[key]]
    small = write_jsonl(tmp_path / "small.jsonl", rows)
    res = CliRunner().invoke(app, ["vocab", str(small), "-n", "40", "-o", str(tmp_path / "v"),
                                   "--tokenizer", str(qwen)])
    assert res.exit_code == 0, res.output
    assert "warning: t2d is sized to the tokenizer's 151669 ids" in res.stderr
    assert "--target-vocab-size (run: [vocab] target_vocab_size)" in res.stderr
    assert json.loads((tmp_path / "v" / "vocab.json").read_text())["target_vocab_size_from"] == "tokenizer"
