"""``tokenbridge generate``: clear errors (exit 2) before anything is sent."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROOT
from tokenbridge.cli import app
from tokenbridge.emulator import EmulatorConfig, running_emulator
from tokenbridge.exit_codes import ExitCode


def _invoke(args, env=None):
    return CliRunner().invoke(app, ["generate", *args], env=env or {})


def _one_prompt(tmp_path: Path) -> Path:
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    return prompts


@pytest.mark.parametrize(("args", "env", "message"), [
    (["{tmp}/nope.jsonl", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"], {}, "nope.jsonl does not exist"),
    (["{prompts}", "--model", "m", "--base-url", "https://openrouter.ai/api/v1", "--api-key-env", "TB_SURELY_UNSET_KEY"],
     {"TB_SURELY_UNSET_KEY": ""}, "TB_SURELY_UNSET_KEY is not set"),
    (["{prompts}", "--base-url", "http://127.0.0.1:9/v1"], {}, "no model given"),
    (["{prompts}", "--config", "{tmp}/c.toml"], {}, "c.toml:2: concurency: unknown key; did you mean 'concurrency'?"),
], ids=["missing-prompts", "unset-key", "no-model", "config-typo"])
def test_usage_errors_name_the_problem(tmp_path, args, env, message):
    prompts = _one_prompt(tmp_path)
    (tmp_path / "c.toml").write_text('model = "m"\nconcurency = 3\n', encoding="utf-8")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{prompts}", str(prompts)) for a in args]
    res = _invoke([*argv, "--out", str(tmp_path / "run")], env=env)
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dry", [False, True])
def test_datasets_of_one_name_on_the_command_line_are_refused_as_in_a_config(tmp_path, dry):
    """Two ``train.jsonl`` (both named ``train``) were merged into one dataset: the first's
    rows sent and paid for, the second's each a bad row (a colliding id), exit 1."""
    for part in ("a", "b"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "train.jsonl").write_text(json.dumps({"id": 1, "prompt": part}) + "\n", encoding="utf-8")
    res = _invoke([str(tmp_path / "a" / "train.jsonl"), f"train={tmp_path / 'b' / 'train.jsonl'}", "--out",
                   str(tmp_path / "run"), "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                   *(["--dry-run"] if dry else [])])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        f"error: datasets: names must be unique, repeated: train: {tmp_path / 'a' / 'train.jsonl'}, "
        f"{tmp_path / 'b' / 'train.jsonl'} (a path alone is named after its file: give each a name, NAME=PATH)"]
    assert not (tmp_path / "run").exists()


def test_a_dry_run_without_a_tokenizer_says_its_counts_are_approximate(tmp_path):
    res = _invoke([str(_one_prompt(tmp_path)), "--out", str(tmp_path / "run"), "--model", "m", "--reasoning", "high",
                   "--provider-only", "a,b", "--dry-run"])
    assert res.exit_code == 0 and "samples: 1 (0 already done, 1 to send)" in res.output
    assert "approx." in res.output  # no --tokenizer: character estimate, said so


def test_a_dry_run_refuses_what_the_run_refuses(tmp_path):
    """No datasets: the dry run said "samples: 0", exit 0, and the run then refused (exit 2)."""
    res = _invoke(["--out", str(tmp_path / "run"), "--model", "m", "--dry-run"])
    assert res.exit_code == 2 and res.output.strip().splitlines() == ["error: no prompt datasets given"], res.output


def test_the_limit_flag_caps_every_dataset_its_own_limit_too(tmp_path):
    """Flags override file values: --limit 2 sent all 176 of a dataset whose config says
    ``limit = 5000`` (the flag only filled datasets with no limit of their own)."""
    rows = "".join(json.dumps({"id": f"p{i}", "prompt": f"q {i}"}) + "\n" for i in range(9))
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.jsonl").write_text(rows, encoding="utf-8")
    cfg = tmp_path / "g.toml"
    cfg.write_text('model = "m"\n[[datasets]]\nname = "a"\npath = "a.jsonl"\nlimit = 5000\n'
                   '[[datasets]]\nname = "b"\npath = "b.jsonl"\nlimit = 1\n'
                   '[[datasets]]\nname = "c"\npath = "c.jsonl"\n', encoding="utf-8")
    res = _invoke(["--config", str(cfg), "--out", str(tmp_path / "run"), "--limit", "2", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "samples: 5 (0 already done, 5 to send)" in res.output
    assert [line.split(",")[0].strip() for line in res.output.splitlines() if line.startswith("  ")] == [
        "a: 2 samples", "b: 1 samples", "c: 2 samples"]


def test_an_empty_prompt_file_is_said_not_silently_sent_nothing(tmp_path):
    """reconstruct warns of an input with no records; generate said nothing and exited 0."""
    empty = tmp_path / "b3.jsonl"
    empty.write_bytes(b"")
    res = _invoke([str(empty), "--out", str(tmp_path / "run"), "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                   "--progress", "plain"])
    assert res.exit_code == 0, res.output
    assert f"warning: dataset b3 ({empty}) gave no prompt: nothing of it is sent" in res.output


def test_a_dry_run_with_bad_rows_exits_1_as_the_run_would(tmp_path):
    """Exit 1 means "some rows were bad" for every command; the dry run said 0, so a script
    checking it went on to pay for a run that would refuse them. The rows that crashed it
    (exit 8: a 5000-digit id, a lone surrogate inside messages stored as JSON text) are
    among them, each one line naming file, line and field."""
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"id": "ok", "prompt": "hi"}) + "\n" + '{"id": ' + "7" * 5000 + ', "prompt": "x"}\n'
                       + json.dumps({"id": "s", "messages": '[{"role": "user", "content": "\\ud800"}]'}) + "\n",
                       encoding="utf-8")
    res = _invoke([str(prompts), "--out", str(tmp_path / "run"), "--model", "m", "--dry-run"])
    assert res.exit_code == ExitCode.INCOMPLETE == 1, res.output
    assert "samples: 1 (0 already done, 1 to send), bad rows: 2" in res.output
    assert [line for line in res.output.splitlines() if line.startswith("bad row:")] == [
        f"bad row: {prompts}: line 2: field '<line>': not valid JSON: a number of more than 4300 digits",
        f"bad row: {prompts}: line 3: field 'messages[0].content': lone surrogate '\\ud800' at character 0: not valid UTF-8",
    ]
    assert not (tmp_path / "run").exists()


def test_a_damaged_parquet_prompt_file_is_one_line_exit_2(tmp_path):
    """iter_batches' OSError ("Invalid BYTE_ARRAY value") was a traceback and exit 8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["hello"] * 20000, "id": [str(i) for i in range(20000)]}), f,
                   compression="none", use_dictionary=False)
    meta = pq.ParquetFile(f).metadata.row_group(0).column(0)
    raw = bytearray(f.read_bytes())
    raw[meta.data_page_offset + 64:meta.data_page_offset + meta.total_compressed_size:7] = b"\xaa" * len(
        range(meta.data_page_offset + 64, meta.data_page_offset + meta.total_compressed_size, 7))
    f.write_bytes(bytes(raw))
    for args in (["--dry-run"], ["--base-url", "http://127.0.0.1:9/v1"]):
        line = _one_line_error(_invoke([f"x={f}", "--out", str(tmp_path / "run"), "--model", "m", *args]), 2)
        assert line.startswith(f"error: dataset 'x': {f}: cannot read parquet: damaged at row 0 or after ("), line
        assert not (tmp_path / "run").exists()


def test_a_dry_run_says_how_many_bad_rows_it_did_not_print_and_where_they_are(tmp_path):
    """It printed 20 ``bad row:`` lines of 24 and no word of the other 4; the run says
    "... 4 more bad rows (all listed in generate.json)"."""
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + "".join(f'{{"prompt": {i}}}\n' for i in range(24)),
                       encoding="utf-8")
    bad = [f"bad row: {prompts}: line {n}: field 'prompt': must be a non-empty string" for n in range(2, 26)]
    args = [str(prompts), "--out", str(tmp_path / "run"), "--model", "m"]
    res = _invoke([*args, "--dry-run"])
    assert res.exit_code == 1, res.output
    assert [line for line in res.output.splitlines() if line.startswith(("bad row:", "..."))] == [
        *bad[:20], "... 4 more bad rows (--summary-json FILE lists them all)"]
    summary = tmp_path / "dry.json"
    res = _invoke([*args, "--dry-run", "--summary-json", str(summary)])
    assert res.exit_code == 1, res.output
    assert [line for line in res.output.splitlines() if line.startswith(("bad row:", "..."))] == [
        *bad[:20], f"... 4 more bad rows (all listed in {summary})"]
    assert ["bad row: " + b for b in json.loads(summary.read_text())["bad_rows"]] == bad
    res = _invoke([*args, "--base-url", "http://127.0.0.1:9/v1", "--max-attempts", "1", "--progress", "plain"])
    assert [line for line in res.output.splitlines() if line.startswith(("bad row:", "..."))] == [
        *bad[:20], "... 4 more bad rows (all listed in generate.json)"], res.output


def test_a_run_folder_whose_state_is_not_sqlite_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.sqlite").write_bytes(b"this is not sqlite" * 100)
    res = _invoke([str(_one_prompt(tmp_path)), "--out", str(tmp_path / "run"), "--model", "m", "--base-url",
                   "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "not a usable tokenbridge state file" in res.output
    assert (tmp_path / "run" / "state.sqlite").read_bytes() == b"this is not sqlite" * 100  # never replaced


def _one_line_error(res, code: int) -> str:
    """The run ended with ``code`` and a single ``error:`` line, no traceback."""
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_a_second_process_on_the_run_folder_fails_fast(tmp_path):
    from tokenbridge.generate import RunFolderBusy, write_exchanges
    from tokenbridge.generate.lock import run_lock

    prompts = tmp_path / "b3.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    hold = ("import sys, time\nfrom tokenbridge.generate.lock import run_lock\n"
            "with run_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = _invoke([str(prompts), "--out", str(run), "--model", "m", "--base-url", "http://127.0.0.1:9/v1",
                       "--max-attempts", "1"])
        line = _one_line_error(res, 7)
        assert f"{run}: run folder in use by pid {holder.pid}" in line
        with pytest.raises(RunFolderBusy):
            write_exchanges(run)
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run):  # a dead holder leaves nothing behind that blocks
        pass


@pytest.mark.parametrize(("how", "message", "hidden"), [
    (["--model", "m", "--base-url", "openrouter.ai/api/v1"], "needs http:// or https://", None),
    (["--config", "{tmp}/c.toml"], "look like credentials", "sk-x"),
], ids=["url-without-scheme", "credentials-in-headers"])
def test_bad_settings_are_one_line_exit_2(tmp_path, how, message, hidden):
    (tmp_path / "c.toml").write_text('model = "m"\n[headers]\nAuthorization = "Bearer sk-x"\n', encoding="utf-8")
    args = [str(_six_prompts(tmp_path)), "--out", str(tmp_path / "run"), *[a.replace("{tmp}", str(tmp_path)) for a in how]]
    line = _one_line_error(_invoke(args), 2)
    assert message in line and (hidden is None or hidden not in line)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [
    "sk-or-v1-" + "0123456789abcdef" * 2, "my app sk-ant-api03-" + "x1Y_" * 10, "Bearer " + "3f9a" * 8,
    "basic dXNlcjpwYXNzd29yZDEyMzQ1Njc4", "sk-" + "A1b2" * 12, "sk_live_" + "a1B2" * 6, "sk-proj-" + "Ab12_-" * 5,
    # a cold reader's: other key formats the first patterns missed
    "sk-svcacct-" + "Ab3_-x" * 25, "sk-" + "Ab3xYz_" * 6, "sk-or-v1-" + "A1" * 32, "gsk_" + "a1B2c3" * 8,
    "xai-" + "a1B2c3" * 8, "AIzaSy" + "a1B2c3" * 6, "hf_" + "a1B2c3" * 6, "ghp_Zq8vN2xL4mR7tY1wK9pB3sD6fH0jC5gA"])
def test_a_credential_in_a_header_value_is_refused_and_never_shown(tmp_path, value):
    """The name check let ``X-Title = "sk-or-v1-..."`` through; a server that echoed the
    header put the key in every error, generate.json and state.sqlite (a cold tester's)."""
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'model = "m"\nbase_url = "http://127.0.0.1:9/v1"\n[headers]\nX-Title = "{value}"\n',
                   encoding="utf-8")
    res = _invoke([str(_one_prompt(tmp_path)), "--out", str(tmp_path / "run"), "--config", str(cfg)])
    line = _one_line_error(res, 2)
    assert line.startswith(f"error: {cfg}:3: headers: header X-Title: value looks like a credential (not shown here)")
    assert value.split()[-1][:16] not in res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [
    "https://github.com/acme/sk-learn-benchmark-suite", "tokenbridge rk-distillation-experiment",
    "Basic reconstruction-experiments", "My pk_experiment_2024_run_alpha", "Bearer of good news 2024", "MyApp",
    "tag sk-proj-reconstruction-2024-run1", "see sk-ant-docs-and-examples-here for help",
    "Basic configuration-v2-20240501", "basic 12345678901234567890 widgets"])
def test_a_header_value_that_only_starts_like_a_key_is_sent(value):
    """Words after a key's prefix are no key (a cold reviewer's: the first pattern refused them)."""
    from tokenbridge.generate import GenerateSettings

    assert GenerateSettings(headers={"X-Title": value}).headers == {"X-Title": value}


def test_a_header_value_holding_the_api_key_is_refused_before_anything_is_sent(tmp_path, monkeypatch):
    """A key-like value in a header is refused by its look; the key itself, in any spelling
    the masking knows (here its base64), once it is read."""
    import base64

    key = "fk-" + "a1b2c3d4" * 6  # no provider's prefix: only the key read from the environment tells
    monkeypatch.setenv("MY_KEY", key)
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'model = "m"\nbase_url = "http://127.0.0.1:9/v1"\napi_key_env = "MY_KEY"\n[headers]\n'
                   f'X-Title = "app {base64.b64encode(key.encode()).decode()}"\n', encoding="utf-8")
    res = _invoke([str(_one_prompt(tmp_path)), "--out", str(tmp_path / "run"), "--config", str(cfg)])
    assert _one_line_error(res, 2) == ("error: headers: header X-Title: value holds the API key from $MY_KEY (not "
                                       "shown here): the key is sent only as Authorization; remove it from the header")
    assert key[3:19] not in res.output and base64.b64encode(key.encode()).decode()[:16] not in res.output
    assert not (tmp_path / "run").exists()


PASTED_KEY = "sk-or-v1-" + "5f0c" * 16
_LOOKS_LIKE_A_KEY = ("looks like an API key (not shown here): give the NAME of the environment variable that holds "
                     "the key (letters, digits and '_', not starting with a digit, e.g. OPENROUTER_API_KEY), never the "
                     "key itself, and put the key in that variable")


@pytest.mark.parametrize("how", ["flag", "config", "run-config"])
def test_a_key_pasted_as_api_key_env_is_refused_and_never_shown(tmp_path, kimi_dir, how):
    """``api_key_env = "sk-or-v1-..."`` printed "environment variable sk-or-v1-<the whole key>
    is not set", and against a loopback server (no key needed) the run went on and stored
    it in runs.settings. Now one line, exit 2, nothing of the key shown or written."""
    prompts = _one_prompt(tmp_path)
    cfg = tmp_path / "g.toml"
    base = ["--out", str(tmp_path / "run"), "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]
    if how == "flag":
        res, where = _invoke([str(prompts), *base, "--api-key-env", PASTED_KEY]), "--api-key-env"
    elif how == "config":
        cfg.write_text(f'model = "m"\napi_key_env = "{PASTED_KEY}"\n', encoding="utf-8")
        res, where = _invoke([str(prompts), "--config", str(cfg), *base]), f"{cfg}:2: api_key_env"
    else:
        cfg.write_text(f'[run]\nout = "run"\ntokenizer = "{kimi_dir}"\n[generate]\nbase_url = "http://127.0.0.1:9/v1"\n'
                       f'model = "m"\napi_key_env = "{PASTED_KEY}"\ndatasets = [{{ path = "{prompts}" }}]\n',
                       encoding="utf-8")
        res, where = CliRunner().invoke(app, ["run", str(cfg)]), f"{cfg}:7: generate.api_key_env"
    assert _one_line_error(res, 2) == f"error: {where}: {_LOOKS_LIKE_A_KEY}"
    assert PASTED_KEY[9:21] not in res.output
    assert not (tmp_path / "run").exists()


def test_an_api_key_env_that_is_no_variable_name_is_refused_without_quoting_it(tmp_path):
    from tokenbridge.generate import ConfigError, GenerateSettings, read_api_key

    res = _invoke([str(_one_prompt(tmp_path)), "--out", str(tmp_path / "run"), "--model", "m", "--base-url",
                   "http://127.0.0.1:9/v1", "--api-key-env", "my-key"])
    assert _one_line_error(res, 2) == (
        "error: --api-key-env: is not an environment variable name (not shown here, as it may be a key): give the "
        "NAME of the environment variable that holds the key (letters, digits and '_', not starting with a digit, "
        "e.g. OPENROUTER_API_KEY), never the key itself")
    assert "my-key" not in res.output
    # built in Python, or read directly (probe), the same: no message quotes it
    with pytest.raises(ConfigError) as err:
        GenerateSettings(api_key_env=PASTED_KEY)
    assert str(err.value) == f"api_key_env {_LOOKS_LIKE_A_KEY}"
    with pytest.raises(ConfigError) as err:
        read_api_key(PASTED_KEY)
    assert str(err.value) == f"the API key's variable {_LOOKS_LIKE_A_KEY}"
    assert GenerateSettings(api_key_env="TB_OTHER_KEY_2").api_key_env == "TB_OTHER_KEY_2"


def test_the_key_written_into_a_config_is_not_answered_with_did_you_mean_api_key_env(tmp_path):
    """``api_key = "sk-..."`` got "did you mean 'api_key_env'?", and users pasted the key there."""
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'model = "m"\napi_key = "{PASTED_KEY}"\n', encoding="utf-8")
    res = _invoke([str(_one_prompt(tmp_path)), "--config", str(cfg), "--out", str(tmp_path / "run")])
    assert _one_line_error(res, 2) == (
        f"error: {cfg}:2: api_key: unknown key: a config never holds the API key (its value is not shown). Put the key "
        "in an environment variable (export OPENROUTER_API_KEY=...); to read another variable, set api_key_env to "
        'that variable\'s NAME (api_key_env = "MY_KEY_VAR"), never the key itself')
    assert PASTED_KEY[9:21] not in res.output


def _six_prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "b3.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"hi {i}"}) + "\n" for i in range(6)), encoding="utf-8")
    return prompts


@pytest.fixture
def finished(tmp_path, kimi):
    """(the emulator's URL, the arguments of a generate run that finished on it)."""
    with running_emulator(EmulatorConfig(min_tokens=5, max_tokens=20), tokenizer=kimi) as url:
        args = [str(_six_prompts(tmp_path)), "--out", str(tmp_path / "run"), "--model", "moonshotai/kimi-k2.5",
                "--base-url", url, "--progress", "none", "--max-tokens", "50"]
        res = _invoke(args)
        assert res.exit_code == 0, res.output
        yield url, args


def test_changed_settings_are_refused_then_kept_with_force_settings(finished):
    _, args = finished
    line = _one_line_error(_invoke([*args[:-1], "60"]), 2)
    assert "6 with another request (max_tokens 50 -> 60, e.g. b3-0)" in line and "--force-settings" in line
    # --dry-run says the same (it said "6 already done", exit 0, and the run then refused)
    assert _one_line_error(_invoke([*args[:-1], "60", "--dry-run"]), 2) == line
    dry = _invoke([*args[:-1], "60", "--dry-run", "--force-settings"])
    assert dry.exit_code == 0 and "(6 already done, 0 to send)" in dry.output, dry.output
    res = _invoke([*args[:-1], "60", "--force-settings", "--limit", "2"])
    assert res.exit_code == 0 and "(4 other stored samples left out)" in res.output, res.output


def test_a_store_write_failure_is_exit_6_with_a_note(finished, tmp_path, monkeypatch):
    from tokenbridge.generate import store as store_mod

    _, args = finished

    def full(self):
        self._conn.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store_mod.Store, "finish", full)
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": 1, "prompt": "new"}) + "\n", encoding="utf-8")
    res = _invoke([str(more), *args[1:]])
    assert res.exit_code == 6 and "Traceback" not in res.output, res.output
    assert "note: stopping: store write failed: database or disk is full" in res.output
    assert "stopped: store_error" in res.output


def test_a_summary_json_that_cannot_be_written_after_the_run_is_exit_1_not_2(finished, tmp_path, monkeypatch):
    """A full disk under --summary-json after a paid run exited 2, the usage-error status;
    a failed write is 1 (docs/contracts.md), and the line says the run itself is kept."""
    import errno

    from tokenbridge import fsio

    _, args = finished
    target = tmp_path / "summary.json"

    def full(path, text, **kw):
        raise fsio.OutputWriteError(Path(path), OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(fsio, "write_text", full)
    res = _invoke([*args, "--summary-json", str(target)])
    assert res.exit_code == ExitCode.INCOMPLETE and "Traceback" not in res.output, res.output
    assert res.output.strip().splitlines()[-1] == (f"error: --summary-json: {target}: cannot write (No space left on device); nothing partial was "
                    f"kept; the run itself is stored in {tmp_path / 'run'}")


# --- a renamed dataset: its answers are in the store under other ids -----------------------


def _stored(run: Path) -> tuple[list[tuple[str, str]], int]:
    with sqlite3.connect(run / "state.sqlite") as con:
        samples = con.execute("SELECT id, status FROM samples ORDER BY seq").fetchall()
        (runs,) = con.execute("SELECT COUNT(*) FROM runs").fetchone()
    return samples, runs


@pytest.mark.parametrize("how", ["renamed", "config-then-path"])
def test_a_renamed_dataset_is_refused_before_its_answers_are_bought_again(tmp_path, how):
    """``generate d=p.jsonl`` then ``generate dd=p.jsonl`` (or a config's ``name = "d"``,
    then the file alone, named ``p``) changed every sample id, and the run sent every
    request again, byte for byte (6 requests for 3 prompts), saying only "(3 other stored
    samples left out)" after paying. Now refused before anything is sent or stored."""
    from hostile_server import HostileServer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": f"q {k}"}) + "\n" for k in "abc"), encoding="utf-8")
    cfg = tmp_path / "g.toml"
    cfg.write_text(f'model = "m"\n[[datasets]]\nname = "d"\npath = "{prompts}"\n', encoding="utf-8")
    run = tmp_path / "run"
    with HostileServer() as srv:
        common = ["--out", str(run), "--base-url", srv.url, "--model", "m", "--progress", "none"]
        first, again = ((["--config", str(cfg)], [str(prompts)]) if how == "config-then-path"
                        else ([f"d={prompts}"], [f"dd={prompts}"]))
        assert _invoke([*first, *common]).exit_code == 0
        before = _stored(run)
        line = _one_line_error(_invoke([*again, *common]), 2)
        new = "p" if how == "config-then-path" else "dd"
        assert line == (
            f"error: {run}: 3 new sample(s) send requests this folder already holds answers to under other sample "
            f"ids: 3 of dataset '{new}' as answered under dataset 'd' (e.g. {new}-a = d-a); sending them would pay "
            "for those answers again, and nothing was sent. To use those answers, give the dataset its old name "
            'again (d=PATH on the command line, or name = "d" in a config; a PATH alone is named after its file); '
            "for fresh answers to the same prompts, use another run folder or another seed (--seed, request.seed)")
        assert sum(srv.attempts.values()) == 3 and _stored(run) == before  # nothing sent, added or begun
        # --dry-run refuses it alike (it said "3 to send", exit 0, and the run then refused)
        assert _one_line_error(_invoke([*again, *common, "--dry-run"]), 2) == line
        assert _stored(run) == before
        dry = _invoke([f"d={prompts}", *common, "--dry-run"])  # the old name: nothing to send, no refusal
        assert dry.exit_code == 0 and "samples: 3 (3 already done, 0 to send)" in dry.output, dry.output
        res = _invoke([f"d={prompts}", *common])  # the old name: resumed, nothing to send
        assert res.exit_code == 0 and sum(srv.attempts.values()) == 3, res.output
        res = _invoke([*again, *common, "--seed", "7"])  # another request: fresh answers, asked for
        assert res.exit_code == 0 and sum(srv.attempts.values()) == 6, res.output


def test_rows_whose_ids_changed_under_the_same_name_are_told_to_take_their_ids_back(tmp_path):
    """The refusal told to give the dataset its old name again: the very name given."""
    from hostile_server import HostileServer

    prompts, renamed = tmp_path / "p.jsonl", tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": f"q {k}"}) + "\n" for k in "ab"), encoding="utf-8")
    renamed.write_text("".join(json.dumps({"id": "X" + k, "prompt": f"q {k}"}) + "\n" for k in "ab"), encoding="utf-8")
    run = tmp_path / "run"
    with HostileServer() as srv:
        common = ["--out", str(run), "--base-url", srv.url, "--model", "m", "--progress", "none"]
        assert _invoke([f"d={prompts}", *common]).exit_code == 0
        line = _one_line_error(_invoke([f"d={renamed}", *common]), 2)
        assert "2 of dataset 'd' as answered under dataset 'd' (e.g. d-Xa = d-a)" in line
        assert "To use those answers, give the rows their old ids again (the row's id field; a row without one is " \
               "named by its content)" in line and "old name" not in line
        assert sum(srv.attempts.values()) == 2


def _finished_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """A run folder whose two samples are done, and the command line that made it."""
    from hostile_server import HostileServer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": k, "prompt": f"q {k}"}) + "\n" for k in "ab"), encoding="utf-8")
    run = tmp_path / "run"
    with HostileServer() as srv:
        common = [f"d={prompts}", "--out", str(run), "--base-url", srv.url, "--model", "m", "--progress", "none"]
        assert _invoke(common).exit_code == 0
    return run, common


def test_a_dry_run_reads_the_store_without_writing_or_waiting_on_a_run(tmp_path):
    """--dry-run opened the store as a run does: it made and upgraded the schema and took
    the write lock, so beside a running generate it waited on that lock (60 s), then failed."""
    run, common = _finished_run(tmp_path)
    before = (run / "state.sqlite").read_bytes()
    writer = sqlite3.connect(run / "state.sqlite", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a run in the middle of a write
    try:
        dry = _invoke([*common, "--dry-run"])
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert dry.exit_code == 0 and "samples: 2 (2 already done, 0 to send)" in dry.output, dry.output
    assert (run / "state.sqlite").read_bytes() == before


def test_a_dry_run_leaves_the_run_folder_as_it_found_it(tmp_path):
    """Reading a WAL database makes SQLite put ``state.sqlite-wal`` and ``-shm`` beside it,
    which a read-only connection cannot remove: a dry run of a finished run left both. Beside
    a run that has the database open, they are the run's and stay."""
    run, common = _finished_run(tmp_path)
    listing = sorted(p.name for p in run.iterdir())
    assert "state.sqlite-wal" not in listing
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    dry = _invoke([*common, "--dry-run"])
    assert dry.exit_code == 0 and "samples: 2 (2 already done, 0 to send)" in dry.output, dry.output
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    live = sqlite3.connect(run / "state.sqlite", isolation_level=None)  # a run's open connection
    try:
        live.execute("SELECT 1 FROM meta").fetchall()
        assert _invoke([*common, "--dry-run"]).exit_code == 0
        assert (run / "state.sqlite-wal").exists() and (run / "state.sqlite-shm").exists()
    finally:
        live.close()
    assert sorted(p.name for p in run.iterdir()) == listing


def test_a_dry_run_of_a_folder_with_older_ids_counts_them_done_as_the_run_does(tmp_path):
    """A folder made before ids stopped doubling their prefix holds ``d-d-a``: the run keeps
    that id and sends nothing, and so must the dry run count it (it said "1 to send"), and
    not take its own old answer for a renamed dataset's."""
    from hostile_server import HostileServer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "d-a", "prompt": "q a"}) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    with HostileServer() as srv:
        common = [f"d={prompts}", "--out", str(run), "--base-url", srv.url, "--model", "m", "--progress", "none"]
        assert _invoke(common).exit_code == 0
        with sqlite3.connect(run / "state.sqlite") as con:  # the id an older version gave it
            for table, column in (("samples", "id"), ("responses", "sample_id"), ("attempts", "sample_id")):
                con.execute(f"UPDATE {table} SET {column} = 'd-' || {column}")
        dry = _invoke([*common, "--dry-run"])
        assert dry.exit_code == 0 and "samples: 1 (1 already done, 0 to send)" in dry.output, dry.output
        assert _invoke(common).exit_code == 0 and srv.attempts["q a"] == 1


def test_repeats_a_run_asks_for_are_still_sent(tmp_path):
    """A prompt twice in a dataset (no id: its hash, then ``~2``) and more rows appended
    later: each is its own sample, sent once, whoever holds the same request already."""
    from hostile_server import HostileServer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "same"}) + "\n" + json.dumps({"prompt": "same"}) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    with HostileServer() as srv:
        args = [f"d={prompts}", "--out", str(run), "--base-url", srv.url, "--model", "m", "--progress", "none"]
        assert _invoke(args).exit_code == 0 and srv.attempts["same"] == 2
        with prompts.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"prompt": "same"}) + "\n")
        res = _invoke(args)
        assert res.exit_code == 0 and srv.attempts["same"] == 3, res.output
    assert [status for _, status in _stored(run)[0]] == ["done"] * 3


# --- prompt sources that cannot be read: one line naming dataset and file, exit 2 ---------

_NO_OVERRIDE = ["--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def _as_unprivileged(argv: list[str]) -> list[str]:
    """``argv`` as it runs for a user: root reads a mode-000 file anyway, so root drops the
    capability that lets it (setpriv); skipped where that cannot be done."""
    import os
    import shutil

    if os.geteuid() != 0:
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None or subprocess.run([setpriv, *_NO_OVERRIDE, "true"], check=False).returncode != 0:
        pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
    return [setpriv, *_NO_OVERRIDE, *argv]


def _unreadable_source(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(the dataset path, the path the error names) for a source one part of which is mode 000."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a"], "prompt": ["hi"]})
    if kind == "jsonl":
        path = _one_prompt(tmp_path)
        return path, path
    if kind == "parquet":
        path = tmp_path / "p.parquet"
        pq.write_table(table, path)
        return path, path
    folder = tmp_path / "d"
    folder.mkdir()
    if kind == "folder":
        (folder / "a.jsonl").write_text('{"prompt": "hi"}\n', encoding="utf-8")
        return folder, folder
    if kind == "file-in-folder":
        (folder / "a.jsonl").write_text('{"prompt": "hi"}\n', encoding="utf-8")
        (folder / "b.jsonl").write_text('{"prompt": "hi 2"}\n', encoding="utf-8")
        return folder, folder / "b.jsonl"
    arrow = folder / "data-00000-of-00001.arrow"  # kind == "save_to_disk"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow.name}]}), encoding="utf-8")
    return folder, arrow


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "folder", "file-in-folder", "save_to_disk"])
def test_an_unreadable_prompt_source_is_one_line_exit_2(tmp_path, kind):
    """A mode-000 prompt file or folder was a PermissionError traceback, exit 8."""
    dataset, named = _unreadable_source(tmp_path, kind)
    named.chmod(0)
    try:
        argv = _as_unprivileged([sys.executable, "-c", "from tokenbridge.cli import app; app()", "generate",
                                 f"x={dataset}", "--out", str(tmp_path / "run"), "--model", "m", "--dry-run"])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    finally:
        named.chmod(0o755)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).strip().splitlines() == [
        f"error: dataset 'x': {named}: unreadable (Permission denied)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("error", "after", "said"), [
    (IsADirectoryError(21, "Is a directory"), None, "unreadable (Is a directory)"),  # replaced since it was seen
    (FileNotFoundError(2, "No such file or directory"), None, "unreadable (No such file or directory)"),
    (OSError(5, "Input/output error"), 1, "unreadable after line 1 (Input/output error)"),  # a bad disk block
])
def test_a_prompt_file_that_fails_to_open_or_read_is_one_line(tmp_path, monkeypatch, error, after, said):
    import io

    prompts = tmp_path / "b3.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n', encoding="utf-8")
    real_open = Path.open

    class Failing(io.BytesIO):
        def readline(self, *a):  # what iterating a binary file calls, line by line
            if self.tell() and after is not None:
                raise error
            return super().readline(*a)

        def __next__(self):
            line = self.readline()
            if not line:
                raise StopIteration
            return line

    def fake_open(self, mode="r", *a, **k):
        if self == prompts:
            if after is None:
                raise type(error)(error.errno, error.strerror, str(self))
            return Failing(real_open(self, "rb").read())
        return real_open(self, mode, *a, **k)

    monkeypatch.setattr(Path, "open", fake_open)
    res = _invoke([f"x={prompts}", "--out", str(tmp_path / "run"), "--model", "m", "--dry-run"])
    assert _one_line_error(res, 2) == f"error: dataset 'x': {prompts}: {said}"


@pytest.mark.parametrize("what", ["tokenizer-flag", "tokenizer-config", "emulator-config"])
def test_a_tokenizer_or_emulator_config_behind_a_locked_folder_is_one_line_exit_2(tmp_path, kimi_dir, what):
    """A tokenizer folder or an emulator config under a folder without search permission was
    a PermissionError traceback from exists()/is_dir(), exit 8 (a cold tester)."""
    locked = tmp_path / "locked"
    (locked / "tok").mkdir(parents=True)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (locked / "tok" / name).symlink_to(kimi_dir / name)
    (locked / "emu.toml").write_text('models = ["m"]\n', encoding="utf-8")
    cfg = tmp_path / "run.toml"
    tok = locked / "tok" if what == "tokenizer-config" else kimi_dir
    emulator = f'[emulator]\nconfig = "{locked / "emu.toml"}"\n' if what == "emulator-config" else ""
    cfg.write_text(f'[run]\nout = "out"\ntokenizer = "{tok}"\n{emulator}[generate]\nmodel = "m"\n'
                   'datasets = [{ name = "c", path = "builtin:prompts/chat.jsonl", limit = 1 }]\n', encoding="utf-8")
    if what == "tokenizer-flag":
        command = ["reconstruct", str(ROOT / "examples" / "exchanges.jsonl"), "-o", str(tmp_path / "r.jsonl"),
                   "--tokenizer", str(locked / "tok")]
        expected = f"error: {locked / 'tok'}: cannot read (Permission denied)"
    elif what == "tokenizer-config":
        command = ["run", str(cfg)]
        expected = f"error: {cfg}:3: run.tokenizer: cannot read the tokenizer folder {locked / 'tok'} (Permission denied)"
    else:
        command = ["run", str(cfg)]
        expected = f"error: {cfg}:5: emulator.config: {locked / 'emu.toml'}: cannot read (Permission denied)"
    locked.chmod(0)
    try:
        argv = _as_unprivileged([sys.executable, "-c", "from tokenbridge.cli import app; app()", *command])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    finally:
        locked.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == expected
    assert not (tmp_path / "out").exists()


def test_progress_none_keeps_the_warnings(tmp_path, capsys):
    """``--progress none`` turns the progress display off; it hid that a dataset gave no
    prompt (exit 0, the other datasets sent), which ``plain`` printed; the dry run said it
    in no mode."""
    from tokenbridge.generate.progress import Reporter

    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    res = _invoke([f"a={_one_prompt(tmp_path)}", f"e={tmp_path / 'empty.jsonl'}", "--out", str(tmp_path / "run"),
                   "--model", "m", "--progress", "none", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"note: dataset e ({tmp_path / 'empty.jsonl'}) gave no prompt: nothing of it is sent" in res.output
    quiet = Reporter("none")
    quiet.log("resuming: 3 of 5 samples already done")
    quiet.log("warning: dataset e gave no prompt", warn=True)
    assert capsys.readouterr().err == "warning: dataset e gave no prompt\n"


@pytest.mark.parametrize(("flags", "error"), [
    # "no" went out as an effort, and OpenRouter turned thinking on; any word was sent as written
    (["--reasoning", "bogus"], "error: --reasoning: effort: unknown value 'bogus' (choose from: max, xhigh, high, medium, "
                               "low, minimal, none)"),
    (["--provider-only", ",,,"], "error: --provider-only: must be a name, not empty or blank"),  # was: only = []
    (["--provider-only", "a,,b"], "error: --provider-only: must be a name, not empty or blank"),
    (["--quantizations", "int4,,fp8"], "error: --quantizations: must be a name, not empty or blank"),
])
def test_a_reasoning_effort_or_routing_name_that_is_none_is_refused_before_sending(tmp_path, flags, error):
    res = _invoke([f"d={_one_prompt(tmp_path)}", "--out", str(tmp_path / "run"), "--dry-run", "-m", "m", *flags])
    assert _one_line_error(res, 2) == error


@pytest.mark.parametrize(("value", "sent"), [
    ("no", {"enabled": False}), ("NO", {"enabled": False}), ("yes", {"enabled": True}), (" High ", {"effort": "high"}),
    ("xhigh", {"effort": "xhigh"}), ("none", {"enabled": False})])
def test_the_reasoning_flag_reads_on_off_and_efforts_in_any_case(value, sent):
    from tokenbridge.generate.settings import normalize_reasoning

    assert normalize_reasoning(value, "--reasoning") == sent


def test_rows_whose_tools_are_not_sent_are_said_per_dataset(tmp_path):
    """A row's tools were dropped from the request (send_tools is off) without a word."""
    rows = tmp_path / "t.jsonl"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    rows.write_text(json.dumps({"id": "a", "prompt": "hi", "tools": [tool]}) + "\n"
                    + json.dumps({"id": "b", "prompt": "yo"}) + "\n", encoding="utf-8")
    res = _invoke([f"x={rows}", "--out", str(tmp_path / "run"), "--dry-run", "-m", "m"])
    assert res.exit_code == 0, res.output
    assert ("note: dataset x: 1 row(s) carry tools, not sent (send_tools = false: the model sees no tool declaration, "
            "and the stored request holds none; send_tools = true sends them)") in res.output.splitlines()
