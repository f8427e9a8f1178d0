"""The bad-input matrix (issue 9): every row goes through the gate the panel puts in front of a launch, and must come
back with an error that names the field and says how to fix it, with nothing submitted.

The gate is `run_preflight` (what `PanelServices.preflight` and the launch form's "Check settings" call; the form
enables Launch only when it passes), the proxy's and the sidecar's HTTP API for adapter names, and the Adapters
page's download handler for zips. "Nothing submitted" means: no run or job row, no job folder, no run data in the
store or the bucket, no Hub Jobs submission, no process left behind, and for the HTTP gates nothing past the
admission handshake reaching the replica or the engine.

Each test is marked `bad_input("<row>")`; `bench/reliability_report.py` counts them. Each keeps the field and the
message it got in its report's `user_properties`, so the report can quote what a user reads.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gradio as gr
import psutil
import pytest
import requests
from aiohttp import web
from sqlmodel import select

from app.launch_form import KEYS, form_from_spec
from app.pages.adapters import AdaptersPage
from app.pages.launch import LaunchPage
from app.panel import LOCAL_OWNER, Panel
from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import AdapterVersion, Job, Run
from backend.launch.preflight import Preflight, run_preflight
from backend.sandbox.client import SandboxLimits
from backend.services.runs import RunNotFound, RunService
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.ports import free_port
from jobs.replica.sidecar import Sidecar
from jobs.store import LocalStore, publish_directory
from tests.support.echo_server import EchoServer
from tests.support.hub_emulator import HubEmulator
from tests.support.loop_thread import LoopThread
from tests.support.proxy_harness import start_harness, write_adapter

OWNER = LOCAL_OWNER
HF_TOKEN = "hf_badinputmatrix0123456789abcdef"  # made up: token-shaped, valid nowhere
# Short sandbox limits keep the hanging rows quick; everything else is the product's default.
SANDBOX = SandboxLimits(seconds=3)
SCORES = "    return [1.0] * len(completions)\n"


def row(name: str):
    return pytest.mark.bad_input(name)


# --- the gate ---------------------------------------------------------------------------------------------------


@dataclass
class Gate:
    """A panel with nothing in it, and what must still be empty after a refused input."""

    ctx: PanelContext
    store: Path  # the local folder the specs use as their bucket
    emulator: HubEmulator | None = None
    bucket_client: Any = None  # boto3 client of the moto bucket a spec uses, if any
    bucket: str | None = None

    def spec(self, **sections: Any) -> dict[str, Any]:
        """The demo spec (local, built-in model and data) as a dict, with `sections` merged into it."""
        data = demo_spec("bad-input", f"file://{self.store}").model_dump()
        for section, values in sections.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        if data["dataset"]["source"] != "builtin" and "eval" not in sections:
            data["eval"] = {}  # the demo evaluates on the built-in dataset's test split, as demo_spec does
        return data

    def check(self, data: dict[str, Any], **credentials: int | None) -> Preflight:
        return run_preflight(self.ctx, OWNER, data, sandbox=SANDBOX, **credentials)

    def assert_nothing_submitted(self, children_before: dict[int, str]) -> None:
        with self.ctx.db.session() as session:
            assert session.exec(select(Run)).all() == [], "a run was recorded"
            assert session.exec(select(Job)).all() == [], "a job was recorded"
        jobs = self.ctx.local_launcher.workdir
        assert not jobs.exists() or not any(jobs.iterdir()), "a local job was started"
        assert not (self.store / layout.RUNS).exists(), "run data was written to the store"
        if self.emulator is not None:
            assert self.emulator.submissions == [], "a job was submitted to the Hub"
        if self.bucket is not None:
            listed = self.bucket_client.list_objects_v2(Bucket=self.bucket).get("Contents", [])
            assert [item["Key"] for item in listed] == [], "something was left in the bucket"
        assert started_since(children_before) == {}, "a process was left running"


def live_children() -> dict[int, str]:
    """This test process's live children, by pid, with their command lines (to say which one was left)."""
    return _alive(psutil.Process().children())


def started_since(children_before: dict[int, str]) -> dict[int, str]:
    """The live processes this test process started since `children_before` was taken, with their descendants.

    Descendants of older children are not counted: the browser tests' panel and Chromium live for the whole session
    and start and end processes of their own at any moment."""
    new = [child for child in psutil.Process().children() if child.pid not in children_before]
    descendants = []
    for child in new:
        try:
            descendants.extend(child.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return _alive([*new, *descendants])


def _alive(processes: list[psutil.Process]) -> dict[int, str]:
    alive = {}
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive[process.pid] = " ".join(process.cmdline())
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def gate(tmp_path) -> Gate:
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    yield Gate(ctx, tmp_path / "store")
    ctx.db.close()


@pytest.fixture
def record(request) -> Callable[..., None]:
    """Keep what the user was told on the test's report (`report.user_properties`; junit properties with
    `-o junit_family=legacy`), for bench/reliability_report.py to quote."""

    def keep(**properties: str) -> None:
        request.node.user_properties.extend(properties.items())

    return keep


@pytest.fixture
def refused(gate, record) -> Callable[..., str]:
    """Run the gate on `data`; assert it names `field`, says `fix`, and submitted nothing. Returns the message."""

    def check(data: dict[str, Any], field: str, fix: str, **credentials: int | None) -> str:
        before = live_children()
        result = gate.check(data, **credentials)
        assert not result.ok
        assert field in result.errors, f"expected an error on {field}, got {result.errors}"
        message = result.errors[field]
        record(field=field, message=message)
        assert fix in message, f"{field}: {message!r} does not say how to fix it ({fix!r})"
        gate.assert_nothing_submitted(before)
        return message

    return check


def reward(source: str) -> list[dict[str, Any]]:
    """A built-in reward and a user one (so the user reward is `rewards.1`: the error must say which)."""
    return [
        {"kind": "builtin", "name": "digit_frac"},
        {"kind": "code", "name": "mine", "source": source, "entry_point": "f"},
    ]


# --- model ------------------------------------------------------------------------------------------------------


@row("model id malformed")
@pytest.mark.parametrize("model_id", ["not a model!", "../../etc/passwd", "owner/name/extra", "owner--name"])
def test_a_malformed_model_id(gate, refused, model_id):
    refused(gate.spec(model={"id": model_id}), "model.id", "use 'owner/name'")


class MissingModelHub:
    """The Hub's model API as it answers for a repository that does not exist (404, X-Error-Code RepoNotFound)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.paths.append(self.path)
                body = json.dumps({"error": "Repository Not Found"}).encode()
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("X-Error-Message", "Repository Not Found")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@row("model not loadable")
def test_a_model_folder_without_weights(gate, refused, tmp_path):
    (tmp_path / "empty-model").mkdir()
    refused(gate.spec(model={"id": str(tmp_path / "empty-model")}), "model.id", "save_pretrained")


@row("model not loadable")
def test_a_model_the_hub_does_not_have(gate, refused, monkeypatch):
    import huggingface_hub.constants

    hub = MissingModelHub()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)  # what HF_ENDPOINT sets
    try:
        refused(gate.spec(model={"id": "acme/no-such-model"}), "model.id", "check the id and the token")
        assert any(path.startswith("/api/models/acme/no-such-model") for path in hub.paths)
    finally:
        hub.close()


TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"  # real models' chat templates and special tokens


def model_files(tokenizer: str) -> dict[str, bytes]:
    return {"config.json": b'{"model_type": "qwen2"}', "tokenizer_config.json": (TOKENIZERS / tokenizer).read_bytes()}


@row("chat template TRL cannot read")
def test_a_model_folder_whose_chat_template_trl_cannot_read(gate, refused, tmp_path):
    folder = tmp_path / "gemma"
    folder.mkdir()
    for name, data in model_files("gemma-2-2b-it.json").items():
        (folder / name).write_bytes(data)
    refused(gate.spec(model={"id": str(folder)}), "model.id", "cannot read replies in")


@row("chat template TRL cannot read")
def test_a_hub_model_whose_chat_template_trl_cannot_read(gate, refused, hub):
    """Read from the Hub with the user's token, before anything is billed; the recipe's model passes the same check
    (TRL needs the ChatML response template for it, which the trainer supplies)."""
    gate.emulator.repos["google/gemma-2-2b-it"] = model_files("gemma-2-2b-it.json")
    gate.emulator.repos["Qwen/Qwen2.5-Math-1.5B"] = model_files("qwen2.5-math-1.5b.json")
    gemma = gate.spec(model={"id": "google/gemma-2-2b-it"})
    refused(gemma, "model.id", "cannot read replies in", hf_credential_id=hub["hf"])
    recipe = gate.check(gate.spec(model={"id": "Qwen/Qwen2.5-Math-1.5B"}), hf_credential_id=hub["hf"])
    assert "model.id" not in recipe.errors and not any("Qwen" in warning for warning in recipe.warnings), recipe
    # Template files in `additional_chat_templates/` turn the template into named ones when transformers loads it.
    with_tools = {**model_files("llama-3.1-8b-instruct.json"), "additional_chat_templates/tool_use.jinja": b"{{ x }}"}
    gate.emulator.repos["acme/llama-tools"] = with_tools
    named = gate.spec(model={"id": "acme/llama-tools"})
    refused(named, "model.id", "several named chat templates (tool_use)", hf_credential_id=hub["hf"])


@row("job image that cannot run the jobs")
@pytest.mark.parametrize(
    ("role", "image", "flavor", "fix"),
    [
        ("replica", "alpine:3.20", "cpu-basic", "has no python3"),
        ("trainer", "python:3.12-slim", "cpu-upgrade", "has no torch"),
        ("replica", "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime", "a10g-small", "replicas on GPUs serve with vLLM"),
        ("replica", "docker.io/vllm/vllm-openai:v0.33.0", "a10g-small", "vLLM 0.22 to 0.31, not v0.33.0"),
    ],
    ids=["no python", "no torch", "gpu replica without vllm", "vllm too new"],
)
def test_a_job_image_that_cannot_run_the_jobs(gate, refused, hub, moto_server, role, image, flavor, fix):
    """Images are not pulled here: what is known of them is checked before anything is submitted or billed."""
    data = hub_spec(gate, moto_server.url, **{f"{role}_image": image, f"{role}_flavor": flavor})
    refused(data, f"compute.{role}_image", fix, store_credential_id=hub["keys"], hf_credential_id=hub["hf"])


def test_an_image_nothing_is_known_of_passes_with_a_warning_to_run_the_smoke_test(gate, hub, moto_server):
    data = hub_spec(gate, moto_server.url, trainer_image="ghcr.io/acme/trainer:1.0")
    result = gate.check(data, store_credential_id=hub["keys"], hf_credential_id=hub["hf"])
    assert "compute.trainer_image" not in result.errors and "compute.replica_image" not in result.errors
    (warning,) = [w for w in result.warnings if "acme" in w]
    assert warning.startswith("ghcr.io/acme/trainer:1.0: cannot tell") and "run the smoke test" in warning
    assert not any("vllm/vllm-openai" in w for w in result.warnings)  # the default image is known


@row("model too large for the trainer flavor")
def test_a_model_the_trainer_flavors_gpus_cannot_hold(gate, refused, hub, moto_server):
    """An 8 B model in float32 needs 32 GB on every GPU: an A10G (24 GB) cannot, an H200 can."""
    gate.emulator.repos["acme/eight-b"] = model_files("qwen2.5-math-1.5b.json")
    gate.emulator.repo_parameters["acme/eight-b"] = 8_030_000_000
    data = {**hub_spec(gate, moto_server.url, trainer_flavor="a10g-small"), "model": {"id": "acme/eight-b"}}
    credentials = {"store_credential_id": hub["keys"], "hf_credential_id": hub["hf"]}
    message = refused(data, "compute.trainer_flavor", "choose a flavor with more memory per GPU", **credentials)
    assert "8.0 B parameters" in message and "32 GB" in message and "24 GB each GPU of a10g-small" in message
    roomy = gate.check({**data, "compute": {**data["compute"], "trainer_flavor": "h200"}}, **credentials)
    assert "compute.trainer_flavor" not in roomy.errors, roomy.errors


@row("model too large for the trainer flavor even sharded")
def test_a_model_the_trainer_shards_over_its_gpus_or_refuses_when_even_its_share_is_too_large(
    gate, refused, hub, moto_server
):
    """A 32 B model in float32 (128 GB) fits no GPU whole: h200x2 shards it (FSDP, 64 GB each of 141 GB) and the
    plan says so; a forced DDP is refused with the fix; 4 x 24 GB (a10g-largex4) cannot hold even a quarter."""
    gate.emulator.repos["acme/thirty-two-b"] = model_files("qwen2.5-math-1.5b.json")
    gate.emulator.repo_parameters["acme/thirty-two-b"] = 32_000_000_000
    data = {**hub_spec(gate, moto_server.url, trainer_flavor="h200x2"), "model": {"id": "acme/thirty-two-b"}}
    credentials = {"store_credential_id": hub["keys"], "hf_credential_id": hub["hf"]}
    sharded = gate.check(data, **credentials)
    assert "compute.trainer_flavor" not in sharded.errors, sharded.errors
    assert sharded.plan["derived"]["trainer"]["sharding"] == "fsdp"
    assert sharded.plan["derived"]["trainer"]["model_parameters"] == 32_000_000_000
    ddp = {**data, "compute": {**data["compute"], "trainer_sharding": "ddp"}}
    message = refused(ddp, "compute.trainer_flavor", "shard it over the GPUs (compute.trainer_sharding", **credentials)
    assert "a whole float32 copy on every GPU (128 GB)" in message
    small = {**data, "compute": {**data["compute"], "trainer_flavor": "a10g-largex4"}}
    message = refused(small, "compute.trainer_flavor", "choose a flavor with more GPUs or more memory", **credentials)
    assert "a 1/4 share of the float32 weights on each of its GPUs (FSDP) (32 GB)" in message


@row("replica flavor vLLM cannot split the model over")
def test_a_replica_flavor_whose_gpus_do_not_divide_the_attention_heads(gate, refused, hub, moto_server):
    """Qwen2.5-1.5B has 12 attention heads: vLLM can spread it over 1, 2, 3, 4 or 6 GPUs, not the 8 of h200x8."""
    files = {**model_files("qwen2.5-math-1.5b.json"), "config.json": b'{"num_attention_heads": 12}'}
    gate.emulator.repos["acme/twelve-heads"] = files
    data = {**hub_spec(gate, moto_server.url, replica_flavor="h200x8"), "model": {"id": "acme/twelve-heads"}}
    credentials = {"store_credential_id": hub["keys"], "hf_credential_id": hub["hf"]}
    message = refused(data, "compute.replica_flavor", "choose a flavor with 1, 2, 3, 4, 6 GPU(s)", **credentials)
    assert "12 attention heads" in message and "8 GPUs of h200x8" in message
    fits = gate.check({**data, "compute": {**data["compute"], "replica_flavor": "h200x4"}}, **credentials)
    assert "compute.replica_flavor" not in fits.errors, fits.errors


# --- dataset ----------------------------------------------------------------------------------------------------


def store_dataset(gate: Gate, name: str, text: str, **dataset: Any) -> dict[str, Any]:
    """A spec whose dataset is the file `datasets/<name>` in the run's store, holding `text`."""
    path = gate.store / "datasets" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return gate.spec(dataset={"source": "store", "id": f"datasets/{name}", **dataset})


@row("dataset missing")
def test_a_dataset_file_that_is_not_in_the_store(gate, refused):
    gate.store.mkdir(parents=True)
    data = gate.spec(dataset={"source": "store", "id": "datasets/missing.jsonl"})
    refused(data, "dataset.id", "upload it first")


def hub_layout_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, train: str) -> str:
    """A dataset repository laid out as on the Hub with one `train` split, found by `datasets` in the working folder
    (the real split logic); its id."""
    folder = tmp_path / "work" / "acme" / "mathset"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text(train)
    monkeypatch.chdir(tmp_path / "work")
    return "acme/mathset"


@row("split missing")
def test_a_split_the_dataset_does_not_have(gate, refused, tmp_path, monkeypatch):
    dataset_id = hub_layout_dataset(tmp_path, monkeypatch, '{"prompt": "1+1?", "answer": "2"}\n')
    data = gate.spec(dataset={"source": "hub", "id": dataset_id, "split": "validation"})
    refused(data, "dataset.split", "one of ['train']")


@row("prompt column missing")
def test_a_prompt_column_the_dataset_does_not_have(gate, refused):
    data = store_dataset(gate, "qa.jsonl", '{"question": "1+1?", "answer": "2"}\n', prompt_column="prompt")
    refused(data, "dataset.prompt_column", "its columns are question, answer")


@row("empty dataset")
@pytest.mark.parametrize(("name", "text"), [("empty.jsonl", ""), ("header-only.csv", "prompt,answer\n")])
def test_an_empty_dataset(gate, refused, name, text):
    refused(store_dataset(gate, name, text), "dataset.id", "at least one row")


# --- held-out evaluation (issue 29) ---------------------------------------------------------------------------------


@row("held-out split missing")
def test_a_held_out_split_the_dataset_does_not_have(gate, refused, tmp_path, monkeypatch):
    dataset_id = hub_layout_dataset(tmp_path, monkeypatch, '{"prompt": "1+1?", "answer": "2"}\n')
    data = gate.spec(dataset={"source": "hub", "id": dataset_id, "split": "train"}, eval={"split": "test"})
    refused(data, "eval.split", "one of ['train']")


@row("held-out prompts all shared with training")
def test_held_out_rows_whose_prompts_all_occur_in_training(gate, refused):
    data = store_dataset(gate, "same.jsonl", '{"prompt": "1+1?", "answer": "2"}\n' * 12)
    refused({**data, "eval": {"holdout": 4}}, "eval.holdout", "all 4 held-out prompts")


@row("held-out rows leave none to train on")
def test_held_out_rows_that_leave_nothing_to_train_on(gate, refused):
    data = store_dataset(gate, "two.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    refused({**data, "eval": {"holdout": 2}}, "eval.holdout", "carve fewer")


@row("eval samples out of range")
@pytest.mark.parametrize(
    ("settings", "field", "fix"),
    [({"k": 0}, "eval.k", "greater than or equal to 1"), ({"greedy": True, "k": 4}, "eval.k", "set k to 1")],
)
def test_eval_settings_out_of_range(gate, refused, settings, field, fix):
    refused(gate.spec(eval={"split": "test", **settings}), field, fix)


@row("eval metric raising or of the wrong length")
@pytest.mark.parametrize(
    ("body", "fix"),
    [("    raise ValueError('no exact answer')\n", "ValueError: no exact answer"), ("    return [1.0]\n", "for 4")],
    ids=["raising", "wrong-length"],
)
def test_an_eval_metric_that_fails_on_sample_rows(gate, refused, body, fix):
    """A metric is tried on the dataset's rows like a reward, and named as the metric it is (never as a reward)."""
    metric = {
        "kind": "code",
        "name": "exact",
        "source": "def exact(completions, **kw):\n" + body,
        "entry_point": "exact",
    }
    refused(gate.spec(eval={"split": "test", "metrics": [metric]}), "eval.metrics.0", fix)


# --- agents' environments (issue 31) ------------------------------------------------------------------------------

TOOL = 'def {name}({parameter}) -> str:\n    """{doc}\n\n    Args:\n        key: what to use\n    """\n{body}'
RAISES = TOOL.format(name="look", parameter="key: str", doc="Look a key up.", body="    return {'a': '1'}[key]\n")
HANGS = TOOL.format(name="wait", parameter="key: str", doc="Wait for it.", body="    while True:\n        pass\n")
NETWORK = "import socket\n" + TOOL.format(
    name="fetch", parameter="key: str", doc="Fetch it.", body="    socket.create_connection((key, 80))\n"
)
UNTYPED = TOOL.format(name="look", parameter="key", doc="Look a key up.", body="    return key\n")
NO_RESET = (
    "class Game:\n"
    "    def start(self, **row):\n"
    "        return None\n\n"
    "    def move(self, key: str) -> str:\n"
    '        """Move.\n\n        Args:\n            key: where to\n        """\n'
    "        return key\n"
)


@row("environment code TRL could not use, or that fails on its sample calls")
@pytest.mark.parametrize(
    ("source", "entry_point", "field", "fix"),
    [
        ("import no_such_module\n", "look", "environment.source", "the code failed when imported: ModuleNotFound"),
        (RAISES, "look", "environment.source", "tool look(key='1') raised KeyError: '1'; a tool should return what"),
        (UNTYPED, "look", "environment.source", "give every parameter a type hint"),
        (NO_RESET, "Game", "environment.source", "Game has no reset method; define reset(self, **row)"),
        (RAISES, "lookup", "environment.entry_point", "lookup not defined in the code"),
        (HANGS, "wait", "environment.source", "make the tools faster (they run on every turn during training)"),
        (NETWORK, "fetch", "environment.source", "may not resolve host names (socket.getaddrinfo) in the sandbox"),
    ],
    ids=["import", "raises", "untyped", "no-reset", "entry-point", "hangs", "network"],
)
def test_environment_code_is_tried_in_the_sandbox_before_anything_starts(
    gate, refused, source, entry_point, field, fix
):
    """The user's tools or environment class are loaded in the reward sandbox, checked as TRL will use them, and
    each tool called once with arguments made from its schema; a hostile tool meets the sandbox's refusals."""
    environment = {"kind": "code", "source": source, "entry_point": entry_point}
    refused(gate.spec(environment=environment, eval={"split": None}, model={"max_model_len": 1024}), field, fix)


PER_ROW = "\n".join(
    f"class {name}:\n    def reset(self, **row):\n        return None\n\n"
    f"    def {tool}(self, key: str) -> str:\n"
    f'        """{name} a key.\n\n        Args:\n            key: what to use\n        """\n'
    "        return key\n"
    for name, tool in (("Upper", "shout"), ("Lower", "whisper"))
)


@row("an environment column naming an environment that does not exist")
@pytest.mark.parametrize(
    ("names", "fix"),
    [
        (
            ["Upper", "Sideways"],
            "dataset row 2 names environment 'Sideways'; with several environment classes, each row",
        ),
        (None, "dataset row 1 has no environment column; with several environment classes"),
    ],
    ids=["unknown", "no-column"],
)
def test_rows_must_name_one_of_the_environments_when_there_are_several(gate, refused, names, fix):
    """TRL stops a run at the first row whose `environment` names none of its environments, after the replicas
    started billing: the sample rows are checked first, in the sandbox with the code."""
    rows = [{"prompt": "Say it.", "answer": "", **({"environment": n} if names else {})} for n in names or ["", ""]]
    spec = store_dataset(gate, "agents.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    spec.update(
        environment={"kind": "code", "source": PER_ROW, "entry_point": "Upper, Lower"},
        model={**spec["model"], "max_model_len": 1024},
    )
    refused(spec, "environment.entry_point", fix)


@row("environment packages missing where local jobs run")
def test_environment_packages_a_local_run_lacks_are_named_with_the_command_that_installs_them(gate, refused):
    """A local run's trainer runs in the panel's environment: a package its environment code needs is installed there
    first (the trainer installs them only where a job image lacks them, on HF Jobs)."""
    good = TOOL.format(name="look", parameter="key: str", doc="Look a key up.", body="    return key\n")
    environment = {"kind": "code", "source": good, "entry_point": "look", "packages": ["no-such-package-xyz==1.0"]}
    spec = gate.spec(environment=environment, eval={"split": None}, model={"max_model_len": 1024})
    refused(spec, "environment.packages", "pip install no-such-package-xyz==1.0' in the panel's environment")


def test_environment_code_that_trl_can_use_passes_the_gate(gate):
    """The control: a typed, documented tool whose sample call answers passes, and nothing else is said about it."""
    good = TOOL.format(
        name="look", parameter="key: str", doc="Look a key up.", body="    return {'a': '1'}.get(key, 'none')\n"
    )
    environment = {"kind": "code", "source": good, "entry_point": "look"}
    result = gate.check(gate.spec(environment=environment, eval={"split": None}, model={"max_model_len": 1024}))
    assert not any(key.startswith("environment") for key in result.errors), result.errors


# --- rewards ----------------------------------------------------------------------------------------------------


@row("reward syntax error")
def test_reward_code_with_a_syntax_error(gate, refused):
    refused(gate.spec(rewards=reward("def f(completions, **kw)\n" + SCORES)), "rewards.1", "line 1")


@row("reward raising")
def test_reward_code_that_raises(gate, refused):
    source = "def f(completions, **kw):\n    raise ValueError('no score for this')\n"
    message = refused(gate.spec(rewards=reward(source)), "rewards.1", "line 2")
    assert "ValueError: no score for this" in message


@row("reward wrong length")
def test_reward_code_returning_the_wrong_number_of_scores(gate, refused):
    source = "def f(completions, **kw):\n    return [1.0]\n"
    refused(gate.spec(rewards=reward(source)), "rewards.1", "for 4 completions")


@row("reward NaN or strings")
@pytest.mark.parametrize(
    ("value", "fix"), [("float('nan')", "expected a finite number"), ("'high'", "expected a number")]
)
def test_reward_code_returning_nan_or_strings(gate, refused, value, fix):
    source = f"def f(completions, **kw):\n    return [{value}] * len(completions)\n"
    message = refused(gate.spec(rewards=reward(source)), "rewards.1", fix)
    assert "row 0" in message


@row("reward hanging")
@pytest.mark.parametrize(
    "body", ["    while True:\n        pass\n", "    import time\n    time.sleep(600)\n"], ids=["busy", "sleeping"]
)
def test_reward_code_that_hangs(gate, refused, body):
    refused(gate.spec(rewards=reward("def f(completions, **kw):\n" + body)), "rewards", "make the reward faster")


@row("reward runs commands or opens a socket")
def test_reward_code_running_a_command(gate, refused, tmp_path):
    marker = tmp_path / "escaped"
    source = f"import os\ndef f(completions, **kw):\n    os.system('touch {marker}')\n" + SCORES
    refused(gate.spec(rewards=reward(source)), "rewards.1", "may not run shell commands")
    assert not marker.exists()


@row("reward runs commands or opens a socket")
def test_reward_code_starting_a_process(gate, refused, tmp_path):
    marker = tmp_path / "escaped"
    source = f"import subprocess\ndef f(completions, **kw):\n    subprocess.run(['touch', '{marker}'])\n" + SCORES
    refused(gate.spec(rewards=reward(source)), "rewards.1", "may not start processes")
    assert not marker.exists()


@row("reward runs commands or opens a socket")
def test_reward_code_opening_a_socket(gate, refused):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        source = f"import socket\ndef f(completions, **kw):\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
        refused(gate.spec(rewards=reward(source + SCORES)), "rewards.1", "reward code may not")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@row("reward printing megabytes")
def test_reward_code_printing_megabytes(gate, refused):
    source = "def f(completions, **kw):\n    print('x' * 5_000_000)\n" + SCORES
    refused(gate.spec(rewards=reward(source)), "rewards.1", "remove the prints")


# --- training and compute settings ----------------------------------------------------------------------------


@row("LoRA rank vLLM cannot serve")
@pytest.mark.parametrize("rank", [0, 1024])
def test_a_lora_rank_vllm_cannot_serve(gate, refused, rank):
    refused(gate.spec(lora={"rank": rank}), "lora.rank", "use a rank from 1 to 512 (vLLM's largest)")


@row("settings TRL 1.16 cannot honour")
@pytest.mark.parametrize(
    ("grpo", "field", "fix"),
    [
        ({"max_staleness": 0}, "grpo.max_staleness", "use 1 (nearly on-policy) or more"),
        ({"top_p": 0.95}, "grpo.top_p", "leave top-p at 1"),
        ({"top_k": 50}, "grpo.top_k", "leave top-k at 0"),
    ],
    ids=["staleness-0", "top-p", "top-k"],
)
def test_settings_trl_cannot_honour(gate, refused, grpo, field, fix):
    refused(gate.spec(grpo=grpo), field, fix)


@row("staleness larger than the queue allows")
def test_staleness_beyond_the_adapters_a_replica_holds(gate, refused):
    refused(gate.spec(grpo={"max_staleness": 17}), "grpo.max_staleness", "use at most 16")


@row("staleness larger than the queue allows")
def test_a_queue_that_cannot_hold_one_group(gate, refused):
    refused(gate.spec(grpo={"queue_size": 4}), "grpo.queue_size", "raise it to at least 8")


@row("zero or too many replicas")
@pytest.mark.parametrize("replicas", [0, -1, 17])
def test_zero_or_too_many_replicas(gate, refused, replicas):
    refused(gate.spec(compute={"replicas": replicas}), "compute.replicas", "use 1 to 16 replicas")


@row("timeout malformed")
@pytest.mark.parametrize(
    ("timeout", "fix"),
    [("4 hours", "write e.g. '90s'"), ("-5m", "write e.g. '90s'"), ("0", "write e.g. '90s'"), ("8d", "7 days")],
)
def test_a_malformed_timeout(gate, refused, timeout, fix):
    refused(gate.spec(compute={"timeout": timeout}), "compute.timeout", fix)


@row("timeout malformed")
@pytest.mark.parametrize("timeout", ["2.5", "90", "5m"])
def test_a_timeout_too_short_for_hf_jobs(gate, refused, hub, moto_server, timeout):
    """Unit-less numbers are seconds, as on HF Jobs: "2.5" would end the jobs before any of them started."""
    data = hub_spec(gate, moto_server.url, timeout=timeout)
    credentials = {"store_credential_id": hub["keys"], "hf_credential_id": hub["hf"]}
    refused(data, "compute.timeout", "use at least '10m'", **credentials)


@pytest.fixture
def hub(gate, tmp_path, moto_server):
    """The gate with an HF token and bucket keys saved, a moto bucket, and the Hub Jobs emulator as the Hub."""
    emulator = HubEmulator(tmp_path / "hub", tokens=(HF_TOKEN,), namespace="tester").start()
    gate.ctx.hub_endpoint = emulator.url
    gate.emulator = emulator
    gate.bucket_client, gate.bucket = moto_server.client(), moto_server.create_bucket()
    credentials = moto_server.credentials
    keys = {"access_key_id": credentials.access_key_id, "secret_access_key": credentials.secret_access_key}
    ids = {
        "hf": gate.ctx.vault.save(OWNER, "hub", "hf_token", HF_TOKEN).id,
        "keys": gate.ctx.vault.save(OWNER, "bucket", "s3", keys).id,
        "wrong": gate.ctx.vault.save(OWNER, "wrong", "s3", {**keys, "secret_access_key": "not-the-secret-0000"}).id,
    }
    yield ids
    emulator.close()


def hub_spec(gate: Gate, endpoint: str, bucket: str | None = None, **compute: Any) -> dict[str, Any]:
    uri = f"s3://{bucket or gate.bucket}/panel"
    return gate.spec(
        compute={
            "backend": "hf_jobs",
            "namespace": "tester",
            "trainer_flavor": "cpu-upgrade",
            "replica_flavor": "cpu-basic",
            **compute,
        },
        storage={"uri": uri, "endpoint": endpoint},
    )


@row("unknown flavor")
@pytest.mark.parametrize("role", ["trainer_flavor", "replica_flavor"])
def test_a_flavor_the_hub_does_not_list(gate, refused, hub, moto_server, role):
    data = hub_spec(gate, moto_server.url, **{role: "h9000"})
    message = refused(
        data, f"compute.{role}", "choose one of", store_credential_id=hub["keys"], hf_credential_id=hub["hf"]
    )
    assert "cpu-basic" in message  # the choices come from the Hub's hardware list


# --- the bucket -------------------------------------------------------------------------------------------------


@row("bucket keys wrong")
def test_bucket_keys_the_bucket_rejects(gate, refused, hub, moto_server):
    refused(
        hub_spec(gate, moto_server.url),
        "storage.credentials",
        "check the access key and secret",
        store_credential_id=hub["wrong"],
        hf_credential_id=hub["hf"],
    )


@row("bucket region wrong")
def test_a_bucket_region_that_is_not_the_buckets(gate, refused, hub, moto_server):
    """Issue 14: the job bootstrap signs for the spec's region and cannot follow a redirect to another one."""
    gate.bucket_client.create_bucket(Bucket="eu-data", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    data = hub_spec(gate, moto_server.url, bucket="eu-data")
    data["storage"]["region"] = "us-east-2"
    credentials = {"store_credential_id": hub["keys"], "hf_credential_id": hub["hf"]}
    message = refused(data, "storage.region", "use eu-west-1", **credentials)
    assert "the bucket is in eu-west-1, not us-east-2" in message
    gate.bucket_client.delete_bucket(Bucket="eu-data")  # the gate checks that nothing was left behind


@row("bucket missing")
def test_a_bucket_that_does_not_exist(gate, refused, hub, moto_server):
    refused(
        hub_spec(gate, moto_server.url, bucket="no-such-bucket-here"),
        "storage.uri",
        "create it or fix its name",
        store_credential_id=hub["keys"],
        hf_credential_id=hub["hf"],
    )


@row("endpoint unreachable")
def test_an_endpoint_nobody_listens_on(gate, refused, hub):
    refused(
        hub_spec(gate, f"http://127.0.0.1:{free_port()}"),
        "storage.endpoint",
        "check the endpoint URL",
        store_credential_id=hub["keys"],
        hf_credential_id=hub["hf"],
    )


@row("endpoint with a typo")
@pytest.mark.parametrize(
    ("endpoint", "fix"),
    [
        ("htps://127.0.0.1:{port}", "write it as https://host[:port]"),
        ("http//127.0.0.1:{port}", "write it as https://host[:port]"),
        ("http://127.0.0.l:{port}", "check the endpoint URL"),
    ],
)
def test_an_endpoint_with_a_typo(gate, refused, hub, moto_server, endpoint, fix):
    data = hub_spec(gate, endpoint.format(port=moto_server.port))
    refused(data, "storage.endpoint", fix, store_credential_id=hub["keys"], hf_credential_id=hub["hf"])


# --- names and ids ----------------------------------------------------------------------------------------------


@row("run id with path characters")
@pytest.mark.parametrize("run_id", ["../etc", "runs/x", "a/../../b", "x\\y", "/abs", "ok-id/.."])
def test_a_run_id_with_path_characters(gate, refused, run_id):
    refused(gate.spec(run_id=run_id), "run_id", "use 3-48 lowercase letters, digits and '-'")


@pytest.fixture
def proxy(local_store):
    """The real proxy in front of one recording upstream standing in for a replica."""
    upstream = EchoServer().start()
    harness = start_harness(local_store, replicas=0, upstreams=[upstream.url])
    yield harness, upstream
    harness.close()
    upstream.stop()


@row("adapter name with ../")
@pytest.mark.parametrize(
    ("path", "body", "fix"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "../../etc/passwd", "lora_path": "/tmp"}, "expected trl-policy-v<N>"),
        ("/v1/load_lora_adapter", {"lora_name": "trl-policy-v1/../x", "lora_path": "/tmp"}, "expected trl-policy-v"),
        ("/v1/unload_lora_adapter", {"lora_name": "../trl-policy-v1"}, "expected trl-policy-v<N>"),
        ("/v1/completions", {"model": "../../model", "prompt": [1, 2]}, "no '..' segments"),
    ],
)
def test_an_adapter_name_with_dot_dot_at_the_proxy(proxy, record, tmp_path, path, body, fix):
    harness, upstream = proxy
    handshake = len(upstream.requests)
    assert handshake > 0, "the proxy never talked to this replica: nothing reaching it would prove nothing"
    response = harness.post(path, body)
    record(field="lora_name" if "lora_name" in body else "model", message=response.text)
    assert response.status_code == 400
    assert ("lora_name" in response.text or "model name" in response.text) and fix in response.text
    # Past the admission handshake only health checks reached the replica: no load, unload or generation.
    assert [seen.path for seen in upstream.requests[handshake:] if seen.method != "GET"] == []
    # The control: the same call with a well-formed name does reach it, so the silence above is the refusal's.
    good = {**body, **{key: "trl-policy-v1" for key in ("lora_name", "model") if key in body}}
    if "lora_path" in body:
        good["lora_path"] = str(write_adapter(tmp_path / "adapter"))
    assert harness.post(path, good).status_code != 400
    assert [seen.path for seen in upstream.requests[handshake:] if seen.method != "GET"] == [path]


@pytest.fixture
def sidecar(tmp_path):
    """The replica's sidecar (in this process) in front of a recording engine."""
    engine = EchoServer().start()
    loop = LoopThread("sidecar")
    cache = tmp_path / "cache"
    app = Sidecar(engine.url, LocalStore(tmp_path / "store"), max_staleness=1, cache_root=cache).app()
    runner = web.AppRunner(app)
    port = free_port()

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    loop.run(start())
    yield f"http://127.0.0.1:{port}", engine, cache
    loop.run(runner.cleanup())
    loop.close()
    engine.stop()


@row("adapter name with ../")
@pytest.mark.parametrize(
    ("lora_path", "fix"),
    [
        ("store:runs/../spec/adapters/v000001/", "write store:runs/<run_id>/adapters/v<6 digits>/"),
        ("store:runs/run-a/adapters/v000001/../../x/", "write store:runs/<run_id>/adapters/v<6 digits>/"),
        ("/tmp/../etc", "an absolute path on the replica without '..'"),
        ("../adapters/v000001", "an absolute path on the replica without '..'"),
    ],
)
def test_an_adapter_path_with_dot_dot_at_the_sidecar(sidecar, record, lora_path, fix):
    url, engine, cache = sidecar
    body = {"lora_name": "run-a-v1", "lora_path": lora_path}
    response = requests.post(url + "/v1/load_lora_adapter", json=body, timeout=30)
    message = response.json()["error"]["message"]
    record(field="lora_path", message=message)
    assert response.status_code == 400
    assert "lora_path" in message and fix in message
    assert engine.requests == []  # the engine never heard of it
    assert not cache.exists() or not any(cache.rglob("*"))
    # The control: a call the sidecar passes on does reach this engine, so the silence above is the refusal's.
    assert requests.get(url + "/v1/models", timeout=30).status_code == 200
    assert [(seen.method, seen.path) for seen in engine.requests] == [("GET", "/v1/models")]


# --- another owner's zip ----------------------------------------------------------------------------------------


@pytest.fixture
def alices_version(tmp_path):
    """A Space panel holding one run of alice's with one published adapter version."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel")
    store = LocalStore(tmp_path / "store")
    spec = demo_spec("alice-run", f"file://{store.root}")
    RunService(ctx, "alice").create(spec)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"alice's weights")
    publish_directory(store, layout.adapter_prefix("alice-run", 1), adapter, {"version": 1})
    with ctx.db.session() as session:
        session.add(AdapterVersion(run_id="alice-run", owner="alice", version=1, step=1, created_at=0.0))
        session.commit()
    panel = Panel(ctx, space=True)
    page = AdaptersPage(panel)
    with gr.Blocks():
        page.build()
    yield panel, page
    ctx.db.close()


def profile(username: str) -> gr.OAuthProfile:
    return gr.OAuthProfile({"name": username.title(), "preferred_username": username, "profile": "", "picture": ""})


@row("zip download of another owner's version")
def test_a_zip_of_another_owners_version(alices_version, record):
    panel, page = alices_version
    with pytest.raises(RunNotFound) as refusal:
        page.prepare_download("alice-run", 1, profile("bob"))
    with pytest.raises(RunNotFound) as unknown:
        page.prepare_download("nobody-run", 1, profile("bob"))
    record(field="run_id", message=str(refusal.value))
    # Bob learns nothing, not even that the run exists: the answer is the one for a run that does not.
    assert str(refusal.value).replace("alice-run", "X") == str(unknown.value).replace("nobody-run", "X")
    zips = list(page.downloads.rglob("*.zip")) + list((panel.ctx.folder / "downloads").rglob("*.zip"))
    assert zips == []
    # The same request as alice succeeds: the refusal is about the owner, not a broken handler.
    page.prepare_download("alice-run", 1, profile("alice"))
    assert [path.name for path in page.downloads.rglob("*.zip")] == ["alice-run-v1.zip"]


@row("run id with path characters")
@pytest.mark.parametrize("run_id", ["../../alice-run", "alice-run/../../x", "/etc/passwd"])
def test_a_zip_request_with_a_path_for_a_run_id(alices_version, run_id):
    panel, page = alices_version
    with pytest.raises(RunNotFound, match="no run"):
        page.prepare_download(run_id, 1, profile("alice"))
    assert not any(panel.ctx.folder.rglob("*.zip")) and not any(page.downloads.rglob("*.zip"))


# --- oversized form inputs --------------------------------------------------------------------------------------


@row("oversized form inputs")
@pytest.mark.parametrize(
    ("sections", "field", "fix"),
    [
        (
            {"rewards": reward("def f(completions, **kw):\n" + SCORES + "#" + "x" * 300_000)},
            "rewards.1.source",
            "keep rewards small",
        ),
        ({"name": "n" * 10_000}, "name", "at most 120 characters"),
        ({"dataset": {"limit": 10**13}}, "dataset.limit", "use at most 1,000,000,000"),
        ({"dataset": {"system_prompt": "s" * 2_000_000}}, "dataset.system_prompt", "keep it under 100,000"),
        ({"grpo": {"max_steps": 10**19}}, "grpo.max_steps", "use at most 10,000,000"),
        ({"grpo": {"seed": 2**40}}, "grpo.seed", "use a seed from 0 to 4294967295"),
    ],
    ids=["reward source", "name", "dataset row limit", "system prompt", "max steps", "seed"],
)
def test_oversized_form_inputs(gate, refused, sections, field, fix):
    refused(gate.spec(**sections), field, fix)


# --- the form itself --------------------------------------------------------------------------------------------


def test_the_launch_form_will_not_launch_what_its_check_refused(gate):
    """Every row above is caught by the check; this is the form's promise that a failed check launches nothing."""
    panel = Panel(gate.ctx, space=False)
    page = LaunchPage(panel)
    with gr.Blocks():
        page.build()
    form = {
        **form_from_spec(gate.spec(lora={"rank": 0})),
        "store_credential": "",
        "hf_credential": "",
        "wandb_credential": "",
    }
    values = {page.inputs[key]: form[key] for key in KEYS}
    outputs = page.check(values)
    assert set(outputs) == set(page._check_outputs())
    assert outputs[page.checked] == ""
    assert outputs[page.launch_button].interactive is False
    assert "LoRA rank: 0 is out of range" in outputs[page.slots["training"]].value
    before = live_children()
    run_id, _ = page.launch({**values, page.checked: outputs[page.checked]})
    assert run_id is None
    gate.assert_nothing_submitted(before)
