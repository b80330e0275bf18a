"""Catalogue: every bad input of the `trajflow` flow commands we know of, and the one-line error each must give.

Each row is run through `trajflow` (flows/cli.py's `main`) in this process. A row passes when the command exits with
its code (2: a mistake in the arguments or the config, 1: the environment: storage, Prefect API), prints nothing on
stdout, and prints only ``trajflow <command>: error: ...`` lines on stderr, one of them holding the expected text:
no traceback, no pydantic block. All of them are found before Prefect starts (the last test checks that in a
process of its own). Add a row for every bad input found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flows.cli import main
from storage.store import RunStore
from tasks.run_config import load_config
from tests.fixtures_sft import ARITHMETIC
from tests.paths import REPO

TINY = "configs/tiny.yaml"
CASES = [
    # id, argv ({tmp} is the test's folder; {file} a plain file in it), exit code, text one error line holds
    ("unknown key", ["train", "--set", "stpes=3"], 2, "stpes: unknown key; did you mean steps?"),
    ("unknown nested key", ["train", "--set", "trainer.learnig_rate=1e-4"], 2,
     "trainer.learnig_rate: unknown key; did you mean trainer.learning_rate?"),
    ("nested key at the top", ["train", "--set", "learning_rate=1e-4"], 2,
     "learning_rate: unknown key; did you mean trainer.learning_rate?"),
    ("unknown judge key", ["train", "--set", "judge.modle=x"], 2,
     "judge.modle: unknown key; did you mean judge.model?"),
    ("out of range", ["train", "--set", "steps=-1"], 2, "steps: input should be greater than or equal to 0, got -1"),
    ("wrong type", ["train", "--set", "group_size=many"], 2, "group_size: input should be a valid integer"),
    ("section given a scalar", ["train", "--set", "trainer=3"], 2,
     "trainer: input should be a valid dictionary or instance of TrainerConfig, got 3"),
    ("model check", ["train", "--set", "trainer.lr_schedule=cosine"], 2,
     "trainer: lr_schedule='cosine' needs total_steps"),
    ("attention kernel misspelled", ["train", "--set", "trainer.attention_kernel=varln"], 2,
     "trainer.attention_kernel: input should be 'auto', 'varlen', 'flash', 'sdpa-default' or 'cudnn', got 'varln'"),
    ("LoRA cast cache switch misspelled", ["train", "--set", "trainer.cache_lora_casts=maybe"], 2,
     "trainer.cache_lora_casts: input should be 'auto', 'on' or 'off', got 'maybe'"),
    ("LoRA grad accumulation switch misspelled", ["train", "--set", "trainer.accumulate_lora_grads=fp32"], 2,
     "trainer.accumulate_lora_grads: input should be 'auto', 'on' or 'off', got 'fp32'"),
    ("long-row threshold zero", ["train", "--set", "trainer.long_row_tokens=0"], 2,
     "trainer.long_row_tokens: input should be greater than or equal to 1, got 0"),
    ("vllm command empty", ["train", "--set", "inference.vllm_command=[]"], 2,
     "inference.vllm_command: the vLLM command must name an executable, got []"),
    ("vllm env not a list or mapping", ["train", "--set", "inference.vllm_env=3"], 2,
     "inference.vllm_env.dict[str,nullable[str]]: input should be a valid dictionary, got 3"),
    ("pipeline negative", ["train", "--set", "pipeline.max_off_policy_steps=-1"], 2,
     "pipeline.max_off_policy_steps: input should be greater than or equal to 0, got -1"),
    ("pipeline outlives retention", ["train", "--set", "pipeline.max_off_policy_steps=3", "--set", "retention.keep_last=2"],
     2, "retention.keep_last=2 is too few for pipeline.max_off_policy_steps=3: a resumed run needs the last 4 checkpoints"),
    ("--set without =", ["train", "--set", "steps"], 2, "--set expects key=value, got 'steps'"),
    ("--set into a scalar", ["train", TINY, "--set", "steps.x=1"], 2, "--set steps.x: 'steps' is not a section"),
    ("--set value not YAML", ["train", "--set", "run=[oops"], 2, "--set run: the value '[oops' is not valid YAML"),
    ("run name escapes", ["train", "--set", "run=../escape"], 2, "run: invalid run name '../escape'"),
    ("project with a slash", ["train", "--set", "project=a/b"], 2, "project: invalid project name 'a/b'"),
    ("missing config file", ["train", "{tmp}/missing.yaml"], 2, "config file not found: {tmp}/missing.yaml"),
    ("config is a folder", ["train", "{tmp}"], 2, "cannot read config file {tmp}: Is a directory"),
    ("config not a mapping", ["train", "{tmp}/list.yaml"], 2,
     "{tmp}/list.yaml: expected a mapping of RunConfig fields"),
    ("config not YAML", ["train", "{tmp}/bad.yaml"], 2, "{tmp}/bad.yaml: not valid YAML"),
    ("dotted key in YAML", ["train", "{tmp}/dotted.yaml"], 2,
     "'trainer.lora_rank': unknown key; in YAML nest it (trainer: {lora_rank: ...}), dotted keys are for --set"),
    ("storage is a file", ["train", TINY, "--set", "storage={file}"], 1, "{file} is a file, not a folder"),
    ("storage under a file", ["train", TINY, "--set", "storage={file}/runs"], 1, "{file} is a file, not a folder"),
    ("storage cannot be created", ["train", TINY, "--set", "storage=/proc/trajflow-runs/x"], 1,
     "cannot create /proc/trajflow-runs/x in /proc: No such file or directory"),
    ("storage scheme unknown", ["train", TINY, "--set", "storage=nosuch://bucket/runs"], 1,
     "invalid storage root 'nosuch://bucket/runs': scheme 'nosuch' is not supported"),
    ("run made with other settings", ["train", TINY, "--set", "storage={tmp}/runs"], 2,
     "run ci/tiny already exists in {tmp}/runs with different group_size"),
    ("eval policy malformed", ["eval", TINY, "--set", "storage={tmp}/runs2", "--policy", "nonsense"], 2,
     "--policy 'nonsense': expected base, <run>@<step>, @<step> or url=...,model=..."),
    ("eval policy of another run", ["eval", TINY, "--set", "storage={tmp}/runs2", "--policy", "other@3"], 2,
     "only adapters of run 'tiny' can be loaded by this config"),
    ("eval unknown key", ["eval", "--set", "eval_scenaros=2"], 2,
     "eval_scenaros: unknown key; did you mean eval_scenarios?"),
    ("training device misspelled", ["train", "--set", "training.device=gpu1"], 2,
     "training.device: expected auto, cpu, cuda or cuda:K (K a GPU index), got 'gpu1'"),
    ("inference device misspelled", ["train", "--set", "inference.device=cuda1"], 2,
     "inference.device: expected auto, cpu, cuda or cuda:K (K a GPU index), got 'cuda1'"),
    ("inference on a GPU not here", ["train", TINY, "--set", "storage={tmp}/runs3", "--set", "inference.device=cuda:7"],
     2, "inference.device cuda:7 needs cuda:7, but this machine shows 0 GPU(s)"),
    ("training ranks on GPUs not here", ["train", TINY, "--set", "storage={tmp}/runs3", "--set",
     "training.device=cuda:1", "--set", "training.gpus=2"], 2,
     "training.device cuda:1 with training.gpus=2 needs cuda:1, cuda:2, but this machine shows 0 GPU(s)"),
    ("replicas of a server we do not start", ["train", "--set", "inference.backend=url", "--set",
     "inference.replicas=2"], 2, "inference: replicas=2 needs servers the run starts (backend embedded or vllm)"),
    ("embedded process with vllm", ["train", "--set", "inference.backend=vllm", "--set",
     "inference.embedded_process=true"], 2,
     "inference: embedded_process=true applies to backend=embedded; backend=vllm already runs as a process of its own"),
    ("embedded process with a url", ["train", "--set", "inference.backend=url", "--set", "inference.url=http://h/v1",
     "--set", "inference.embedded_process=true"], 2,
     "inference: embedded_process=true applies to backend=embedded; backend=url attaches to a server started"),
    ("embedded process not a boolean", ["train", "--set", "inference.embedded_process=maybe"], 2,
     "inference.embedded_process: input should be a valid boolean, unable to interpret input, got 'maybe'"),
    ("overlap decode unknown", ["train", "--set", "inference.overlap_decode=maybe"], 2,
     "inference.overlap_decode: input should be 'auto', 'on' or 'off', got 'maybe'"),
    ("engine setting unknown", ["train", "--set", "inference.engine.warp=on"], 2,
     "inference.engine: no engine setting 'warp'; known: adapter_cache_dir, admission_wait_steps"),
    ("engine setting out of range", ["train", "--set", "inference.engine.admission_wait_steps=-1"], 2,
     "inference.engine.admission_wait_steps: input should be greater than or equal to 0, got -1"),
    ("engine setting of its own field", ["train", "--set", "inference.engine.max_loras=2"], 2,
     "inference.engine: max_loras: set inference.max_loras instead of inside engine"),
    ("engine setting wrong type", ["train", "--set", "inference.engine.compile_decode=maybe"], 2,
     "inference.engine.compile_decode: input should be a valid boolean"),
    ("training mode unknown", ["train", "--set", "training.mode=thread"], 2,
     "training.mode: input should be 'auto', 'local', 'process' or 'deployment', got 'thread'"),
    ("training gpus zero", ["train", "--set", "training.gpus=0"], 2,
     "training.gpus: input should be greater than or equal to 1, got 0"),
    ("config show unknown key", ["config", "show", "--set", "inference.devise=cpu"], 2,
     "inference.devise: unknown key; did you mean inference.device?"),
    ("deploy gpu slots", ["deploy", "--gpu-slots", "0"], 2, "--gpu-slots must be at least 1, got 0"),
    ("deploy silent too short", ["deploy", "--silent-after-s", "20"], 2,
     "--silent-after-s 20 must be longer than the longest heartbeat interval of the deployments (30 s)"),
    ("deploy file missing", ["deploy", "--file", "{tmp}/missing.yaml"], 2,
     "cannot read {tmp}/missing.yaml: No such file or directory"),
    ("deploy file not YAML", ["deploy", "--file", "{tmp}/bad.yaml"], 2, "{tmp}/bad.yaml is not valid YAML"),
    ("deploy file without deployments", ["deploy", "--file", "{tmp}/list.yaml"], 2,
     "{tmp}/list.yaml has no `deployments:` list of mappings"),
    ("deploy heartbeat Prefect refuses", ["deploy", "--file", "{tmp}/heartbeat.yaml"], 2,
     "deployment 'fast': PREFECT_FLOWS_HEARTBEAT_FREQUENCY='5' is not accepted by Prefect"),
    ("deploy home relative", ["deploy", "--home", "checkout"], 2,
     "TRAJFLOW_HOME must be an absolute path (the checkout on the worker hosts), got 'checkout'"),
    ("tracking key misspelt", ["train", "--set", "tracking.wandb.projet=x"], 2,
     "tracking.wandb.projet: unknown key; did you mean tracking.wandb.project?"),
    ("tracking credentials in the config", ["train", "--set", "tracking.wandb.api_key=k-123"], 2,
     "tracking.wandb.api_key: unknown key"),
    ("tracking wandb mode", ["train", "--set", "tracking.wandb.mode=offlin"], 2,
     "tracking.wandb.mode: input should be 'online', 'offline' or 'disabled'"),
    ("tracking project with a slash", ["train", "--set", "tracking.trackio.project=a/b"], 2,
     "tracking.trackio.project: string should match pattern"),
    ("sft data a web URL", ["train", "--set", "sft.data=https://example.com/d.jsonl"], 2,
     "sft.data: 'https://example.com/d.jsonl' is a web URL, and trajflow fetches no URL a config names"),
    ("sft data another scheme", ["train", "--set", "sft.data=gs://bucket/d.jsonl"], 2,
     "sft.data: 'gs://bucket/d.jsonl': scheme 'gs' is not supported"),
    ("sft without data", ["train", "--set", "sft.epochs=2"], 2, "sft.data: required"),
    ("sft key misspelt", ["train", "--set", "sft.epoch=2"], 2, "sft.epoch: unknown key; did you mean sft.epochs?"),
    ("sft epochs zero", ["train", "--set", "sft.data=d.jsonl", "--set", "sft.epochs=0"], 2,
     "sft.epochs: input should be greater than or equal to 1, got 0"),
    ("sft on_bad_line unknown", ["train", "--set", "sft.data=d.jsonl", "--set", "sft.on_bad_line=ignore"], 2,
     "sft.on_bad_line: input should be 'error' or 'skip'"),
    ("sft data missing", ["train", TINY, "--set", "storage={tmp}/runs4", "--set", "sft.data={tmp}/none.jsonl"], 2,
     "sft.data: cannot read {tmp}/none.jsonl"),
    ("sft data empty", ["sft", TINY, "--set", "storage={tmp}/runs4", "--set", "sft.data={tmp}/empty.jsonl"], 2,
     "{tmp}/empty.jsonl: empty (no conversation); expected one JSON object per line"),
    ("sft data a bad line", ["train", TINY, "--set", "storage={tmp}/runs4", "--set", "sft.data={tmp}/bad.jsonl"], 2,
     "{tmp}/bad.jsonl line 2: messages[1].role must be one of system, developer, user, assistant, tool, got 'robot'"),
    ("sft data not UTF-8", ["sft", TINY, "--set", "storage={tmp}/runs4", "--set", "sft.data={tmp}/binary.jsonl"], 2,
     "{tmp}/binary.jsonl: not UTF-8 text"),
    ("sft conversation too long", ["sft", TINY, "--set", "storage={tmp}/runs4", "--set", "sft.data={tmp}/demos.jsonl",
     "--set", "sft.max_length=20"], 2, "{tmp}/demos.jsonl line 1: 41 tokens, longer than the context (20 tokens"),
    ("sft of a config without sft", ["sft", TINY, "--set", "storage={tmp}/runs4"], 2,
     "the config has no sft section"),
    ("fork step not a number", ["fork", "tiny@x", "new", "--project", "ci", "--storage", "{tmp}/runs"], 2,
     "SRC_RUN[@STEP]: the step after '@' must be a number, got 'x'"),
    ("fork source not committed", ["fork", "tiny", "new", "--project", "ci", "--storage", "{tmp}/runs"], 2,
     "run ci/tiny in {tmp}/runs has no committed step to fork from"),
    ("fork source escapes", ["fork", "../x", "new", "--storage", "{tmp}/runs"], 2, "invalid run name '../x'"),
    ("fork new run with a slash", ["fork", "tiny", "a/b", "--project", "ci", "--storage", "{tmp}/runs"], 2,
     "invalid run name 'a/b'"),
    ("fork into itself", ["fork", "tiny@1", "tiny", "--project", "ci", "--storage", "{tmp}/runs"], 2,
     "cannot fork run ci/tiny into itself"),
    ("demos agent without an expert", ["demos", "arithmetic", "--out", "{tmp}/d.jsonl"], 2,
     "no scripted expert for agent 'arithmetic': demonstrations exist for research, tictactoe"),
    ("demos unknown agent", ["demos", "chess", "--out", "{tmp}/d.jsonl"], 2, "no scripted expert for agent 'chess'"),
    ("demos of val", ["demos", "research", "--split", "val", "--out", "{tmp}/d.jsonl"], 2,
     "split 'val': demonstrations come from the train split only (val and test must stay unseen by training)"),
    ("demos of test", ["demos", "tictactoe", "--split", "test", "--out", "{tmp}/d.jsonl"], 2,
     "split 'test': demonstrations come from the train split only"),
    ("demos count zero", ["demos", "research", "--count", "0", "--out", "{tmp}/d.jsonl"], 2,
     "count must be at least 1, got 0"),
    ("demos count negative", ["demos", "tictactoe", "--count", "-3", "--out", "{tmp}/d.jsonl"], 2,
     "count must be at least 1, got -3"),
    ("demos count beyond the split", ["demos", "tictactoe", "--count", "999", "--out", "{tmp}/d.jsonl"], 2,
     "count 999 is more than the 256 train scenarios of 'tictactoe'"),
    ("demos out in a missing folder", ["demos", "research", "--out", "{tmp}/missing/d.jsonl"], 2,
     "--out {tmp}/missing/d.jsonl: folder {tmp}/missing does not exist"),
    ("demos out is a folder", ["demos", "research", "--out", "{tmp}"], 2,
     "--out {tmp} is a folder; name the JSONL file to write"),
]


@pytest.fixture
def inputs(tmp_path):
    """The files the rows name: a plain file, a list, broken YAML, a dotted key, a run stored with other settings."""
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "list.yaml").write_text("- a list\n- not a mapping\n")
    (tmp_path / "bad.yaml").write_text("steps: [1, 2\n")
    (tmp_path / "dotted.yaml").write_text("trainer.lora_rank: 4\n")
    (tmp_path / "heartbeat.yaml").write_text(
        "deployments:\n- {name: fast, work_pool: {name: p, job_variables: {env: {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: '5'}}}}\n")
    (tmp_path / "demos.jsonl").write_text(json.dumps(ARITHMETIC[0]) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps(ARITHMETIC[0]) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}) + "\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    stored = load_config(TINY, [f"storage={tmp_path / 'runs'}", "group_size=9"])
    RunStore(stored.storage, stored.project, stored.run).write_run_config(stored.model_dump(mode="json"))
    return tmp_path


def _fill(text: str, tmp) -> str:
    return text.replace("{tmp}", str(tmp)).replace("{file}", str(tmp / "a-file"))


def _check_one_line_errors(code: int, out: str, err: str, command: str, expected_code: int, text: str) -> None:
    assert code == expected_code, err
    assert out == ""
    lines = err.strip().splitlines()
    assert lines and all(line.startswith(f"trajflow {command}: error: ") for line in lines), err
    assert any(text in line for line in lines), err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err


@pytest.mark.parametrize("argv, code, text", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_gives_a_one_line_error(argv, code, text, inputs, capsys):
    command = "config show" if argv[0] == "config" else argv[0]
    status = main([_fill(a, inputs) for a in argv])
    out, err = capsys.readouterr()
    _check_one_line_errors(status, out, err, command, code, _fill(text, inputs))


def test_a_missing_bucket_is_named(s3_endpoint, capsys):
    status = main(["train", TINY, "--set", "storage=s3://no-such-bucket-here/runs"])
    out, err = capsys.readouterr()
    _check_one_line_errors(status, out, err, "train", 1, "bucket 'no-such-bucket-here' does not exist")


def test_a_prefect_api_url_without_a_server(inputs, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        status = main(["train", TINY, "--set", f"storage={inputs / 'fresh'}"])
    out, err = capsys.readouterr()
    _check_one_line_errors(status, out, err, "train", 1,
                           "PREFECT_API_URL is http://127.0.0.1:9/api but no Prefect server answers there")


def test_the_mistake_is_found_before_prefect_starts_and_said_once(tmp_path):
    # --verbose shows Prefect's own lines: had the flow started, "Starting temporary server" and Prefect's report of
    # the failure would be there, and Python's traceback after them
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run([sys.executable, "-m", "flows.train", TINY, "--set", f"storage={blocker}/runs", "--verbose"],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        f"trajflow train: error: storage '{blocker}/runs' cannot hold runs: {blocker} is a file, not a folder"]


@pytest.mark.parametrize("url, text", [
    ("", "PREFECT_API_URL is not set: deployments need a Prefect server that stays up"),
    ("http://127.0.0.1:9/api", "PREFECT_API_URL is http://127.0.0.1:9/api but no Prefect server answers there"),
], ids=["no server named", "server not answering"])
def test_deploy_needs_a_prefect_server(url, text, capsys):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: url}):
        status = main(["deploy"])
    out, err = capsys.readouterr()
    _check_one_line_errors(status, out, err, "deploy", 1, text)
