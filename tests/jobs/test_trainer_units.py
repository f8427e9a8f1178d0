"""Trainer pieces that do not need a running system: CPU attention, spec→config, datasets, telemetry chunks."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from jobs.contract import DatasetSpec, derived, layout, parse_spec
from jobs.demo.preset import demo_spec
from jobs.store import LocalStore, publish_directory
from jobs.telemetry import ChunkWriter, decode_jsonl, next_sequence
from jobs.trainer import cpu_compat
from jobs.trainer.audit import FAILING, MARGIN, VersionWeights, judge, lora_weights, read_published_weights
from jobs.trainer.config import grpo_config, lora_config
from jobs.trainer.dataset import DatasetError, build_prompts, check_columns, load_rows, to_messages


def reference_attention(q, k, v, scale):
    """Plain causal attention over one sequence, heads repeated for GQA: the ground truth."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_len, k_len = q.shape[0], k.shape[0]
    mask = torch.arange(k_len)[None, :] <= (torch.arange(q_len)[:, None] + k_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_cpu_varlen_attention_matches_per_segment_causal_attention():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q_lens, k_lens = [3, 5, 2], [3, 7, 6]  # segments 2 and 3 attend to a longer path (tree packing)
    q = torch.randn(sum(q_lens), heads, dim)
    k = torch.randn(sum(k_lens), kv_heads, dim)
    v = torch.randn(sum(k_lens), kv_heads, dim)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = cpu_compat.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), softmax_scale=0.3, causal=True)
    for i in range(len(q_lens)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        expected = reference_attention(q[qs], k[ks], v[ks], 0.3)
        torch.testing.assert_close(out[qs], expected, atol=1e-5, rtol=1e-5)


def test_cpu_patches_replace_the_three_names_and_refuse_a_moved_one(monkeypatch):
    assert cpu_compat.apply_cpu_patches(force=True)
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    assert async_rollout_worker.is_vllm_available() is True
    assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None
    assert packing._flash_attn().flash_attn_varlen_func is cpu_compat.varlen_attention
    monkeypatch.delattr(packing, "_flash_attn")
    with pytest.raises(cpu_compat.IncompatibleTRL, match="trl==1.16.0"):
        cpu_compat.apply_cpu_patches(force=True)


def test_every_grpo_field_reaches_the_trl_config(tmp_path):
    spec = parse_spec(
        {
            "run_id": "mapping",
            "grpo": {
                "num_generations": 4,
                "completions_per_step": 256,
                "max_completion_length": 100,
                "temperature": 0.7,
                "learning_rate": 1e-4,
                "adam_beta2": 0.99,
                "epsilon": 0.3,
                "max_steps": 7,
                "max_staleness": 2,
                "weight_sync_steps": 3,
                "max_inflight": 96,
                "queue_size": 300,
                "token_budget": 0,
                "gradient_checkpointing": False,
                "save_steps": 5,
                "seed": 9,
            },
            "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"], "dropout": 0.05},
        }
    )
    config = grpo_config(spec, str(tmp_path), "http://127.0.0.1:9999", cuda=False)
    assert (config.num_generations, config.max_completion_length, config.temperature) == (4, 100, 0.7)
    assert (config.top_p, config.top_k, config.learning_rate, config.adam_beta2) == (1.0, 0, 1e-4, 0.99)
    assert (config.epsilon, config.max_steps, config.max_staleness, config.weight_sync_steps) == (0.3, 7, 2, 3)
    assert (config.max_inflight_tasks, config.queue_maxsize, config.token_budget) == (96, 300, 0)
    assert (config.gradient_checkpointing, config.save_steps, config.seed) == (False, 5, 9)
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 256
    assert config.vllm_server_base_url == "http://127.0.0.1:9999"
    assert config.use_cpu and not config.bf16 and config.dtype == "float32"
    assert config.lr_scheduler_type == "constant" and config.logging_steps == 1
    lora = lora_config(spec)
    assert (lora.r, lora.lora_alpha, set(lora.target_modules), lora.lora_dropout) == (
        16,
        32,
        {"q_proj", "v_proj"},
        0.05,
    )


def test_builtin_dataset_becomes_chat_prompts_with_system_prompt():
    spec = DatasetSpec(
        source="builtin",
        id="digits",
        prompt_column="prompt",
        answer_column="answer",
        system_prompt="Answer with digits.",
    )
    dataset = build_prompts(spec, load_rows(spec))
    assert len(dataset) == 32
    first = dataset[0]
    assert first["prompt"][0] == {"role": "system", "content": "Answer with digits."}
    assert first["prompt"][1]["role"] == "user" and first["answer"] == ""


def test_store_dataset_with_renamed_columns(store):
    rows = [{"question": f"What is {i}+{i}?", "solution": str(2 * i), "difficulty": i} for i in range(5)]
    store.put_bytes("datasets/add.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = DatasetSpec(source="store", id="datasets/add.jsonl", prompt_column="question", answer_column="solution")
    dataset = build_prompts(spec, load_rows(spec, store, limit=3))
    assert len(dataset) == 3
    assert dataset[2]["answer"] == "4" and dataset[2]["difficulty"] == 2
    assert dataset[2]["prompt"] == [{"role": "user", "content": "What is 2+2?"}]


def test_rewards_see_every_column_as_trl_does_and_the_answer_through_a_dotted_path(store):
    """Issue 13: the math preset's dataset keeps its gold answer in `reward_model.ground_truth`; rewards get it as
    `answer`, and every column under its own name, structs and lists included."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "tags": ["add", f"n{i}"],
            "level": i,
        }
        for i in range(3)
    ]
    store.put_bytes("datasets/math.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = DatasetSpec(source="store", id="datasets/math.jsonl", answer_column="reward_model.ground_truth")
    dataset = build_prompts(spec, load_rows(spec, store))
    assert dataset[2]["answer"] == "4" and dataset[2]["prompt"] == rows[2]["prompt"]
    assert dataset[2]["reward_model"] == {"ground_truth": "4", "style": "rule"}
    assert (dataset[2]["tags"], dataset[2]["level"]) == (["add", "n2"], 2)
    wrong = DatasetSpec(source="store", id="datasets/math.jsonl", answer_column="reward_model.solution")
    with pytest.raises(DatasetError, match=r"answer_column: 'reward_model' has no field 'solution'; .* ground_truth"):
        check_columns(load_rows(wrong, store), wrong)
    too_deep = DatasetSpec(source="store", id="datasets/math.jsonl", answer_column="level.value")
    with pytest.raises(DatasetError, match=r"'level' has no field 'value'; its fields are none: it is not a struct"):
        check_columns(load_rows(too_deep, store), too_deep)


def test_dataset_errors_name_the_field_and_the_columns(store):
    store.put_bytes("datasets/x.csv", b"q,a\nhi,1\n")
    spec = DatasetSpec(source="store", id="datasets/x.csv", prompt_column="question", answer_column="a")
    with pytest.raises(DatasetError, match=r"dataset.prompt_column: column 'question' .* columns are q, a"):
        check_columns(load_rows(spec, store), spec)
    missing = DatasetSpec(source="store", id="datasets/missing.jsonl")
    with pytest.raises(DatasetError, match="not in"):
        load_rows(missing, store)
    store.put_bytes("datasets/empty.jsonl", b"")
    with pytest.raises(DatasetError):
        load_rows(DatasetSpec(source="store", id="datasets/empty.jsonl"), store)
    with pytest.raises(DatasetError, match="string or a list"):
        to_messages(42, None)


def test_overlong_prompts_are_dropped_and_all_dropped_is_an_error():
    class CharTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return {"input_ids": list("".join(m["content"] for m in messages))}

    spec = DatasetSpec(source="builtin", id="digits", answer_column="answer")
    kept = build_prompts(spec, load_rows(spec), CharTokenizer(), max_prompt_tokens=19)
    assert 0 < len(kept) < 32
    assert all(len(row["prompt"][0]["content"]) <= 19 for row in kept)
    with pytest.raises(DatasetError, match="every prompt is longer"):
        build_prompts(spec, load_rows(spec), CharTokenizer(), max_prompt_tokens=3)


def test_chunk_writer_numbers_chunks_and_continues_after_a_restart(store):
    writer = ChunkWriter(store, "run-t", "metrics", interval=60)
    writer.add({"step": 1})
    writer.add({"step": 2})
    assert writer.flush()
    assert writer.flush()  # nothing buffered: no empty chunk
    writer.add({"step": 3})
    writer.close()
    keys = [info.key for info in store.list(layout.telemetry_prefix("run-t", "metrics"))]
    assert keys == [layout.telemetry_key("run-t", "metrics", 0), layout.telemetry_key("run-t", "metrics", 1)]
    assert decode_jsonl(store.get_bytes(keys[0])) == [{"step": 1}, {"step": 2}]
    assert next_sequence(store, "run-t", "metrics") == 2
    again = ChunkWriter(store, "run-t", "metrics")
    assert again.seq == 2


def test_chunk_writer_keeps_records_when_the_store_fails(moto_server):
    from jobs.contract import parse_storage_uri
    from jobs.retry import RetryPolicy
    from jobs.store import S3Store
    from tests.support.faulty_proxy import FaultyProxy

    proxy = FaultyProxy(moto_server.url).start()
    try:
        bucket = moto_server.create_bucket()
        store = S3Store(
            parse_storage_uri(f"s3://{bucket}", endpoint=proxy.url),
            moto_server.credentials,
            retry=RetryPolicy(2, 0.01, 0.02),
        )
        writer = ChunkWriter(store, "run-f", "samples", interval=60)
        writer.add({"n": 1})
        proxy.inject("status", count=10, status=503)
        assert not writer.flush()
        proxy.clear()
        writer.add({"n": 2})
        assert writer.flush()
        (key,) = [info.key for info in store.list(layout.telemetry_prefix("run-f", "samples"))]
        assert decode_jsonl(store.get_bytes(key)) == [{"n": 1}, {"n": 2}]
    finally:
        proxy.stop()


def test_demo_preset_is_valid_and_overridable(tmp_path):
    spec = demo_spec("demo-x", f"file://{tmp_path}", grpo={"max_steps": 5})
    assert spec.model.id == "builtin:tiny-qwen2" and spec.rewards[0].name == "digit_frac"
    assert spec.grpo.max_steps == 5 and spec.grpo.learning_rate == 2e-2


# --- several training processes (issue 13) ------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "gpu"])
def test_each_step_trains_completions_per_step_in_total_whatever_the_processes(processes, cuda):
    """Parity with TRL's fixed-count planner: a micro-batch is `per_device_train_batch_size × num_processes` samples,
    one row per rank, and a step is `gradient_accumulation_steps` micro-batches. So the per-device batch the trainer
    derives must be each process's share, or every step would train `processes` times the completions asked for."""
    from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher

    from jobs.contract import derived

    spec = parse_spec({"run_id": "ddp", "grpo": {"num_generations": 8, "completions_per_step": 64}})
    per_device, accumulation = derived.batch_shape(spec.grpo, processes, cuda)
    samples = [  # 16 groups of 8 completions, each group its own prompt
        {"input_ids": torch.tensor([100 + g, 200 + g, i]), "completion_mask": torch.tensor([0, 1, 1]), "group_id": g}
        for g in range(16)
        for i in range(8)
    ]
    micro_batches = iter(FixedCountBatcher(samples, processes, per_device * processes))
    step = [next(micro_batches) for _ in range(accumulation)]
    rows = [row for micro_batch in step for row in micro_batch]
    assert all(len(micro_batch) == processes for micro_batch in step)  # one row per rank
    assert all(row.samples for row in rows)  # no rank idles (it would desynchronise the collectives)
    assert sum(len(row.samples) for row in rows) == 64
    assert {s["group_id"] for row in rows for s in row.samples} == set(range(8))  # the step's 8 whole groups


def test_the_trainer_config_gives_each_of_two_cpu_processes_half_a_step(tmp_path):
    from jobs.demo.preset import demo_spec

    spec = demo_spec("ddp", f"file://{tmp_path}", compute={"trainer_processes": 2})
    config = grpo_config(spec, str(tmp_path), "http://127.0.0.1:9999", cuda=False)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (32, 1)


def test_the_sharding_follows_the_model_size_against_one_gpu_on_both_branches():
    """A pure function, tested for the GPU branch that cannot run here: DDP while a float32 copy takes at most 60% of
    one GPU, FSDP beyond; what the spec forces is kept; one process never shards; no GPU or no size means DDP."""
    from jobs.contract import derived

    h200 = 141.0
    fits, too_large = 7_000_000_000, 32_000_000_000  # 28 GB and 128 GB in float32
    assert derived.trainer_sharding("auto", 2, fits, h200) == "ddp"
    assert derived.trainer_sharding("auto", 2, too_large, h200) == "fsdp"
    assert derived.trainer_sharding("auto", 2, too_large, 0.0) == "ddp"  # the CPU: no GPU memory to outgrow
    # The size could not be read: sharded, which runs whatever size preflight accepted (perhaps only sharded).
    assert derived.trainer_sharding("auto", 2, None, h200) == "fsdp"
    assert derived.trainer_sharding("auto", 2, None, 0.0) == "ddp"
    assert derived.trainer_sharding("ddp", 2, too_large, h200) == "ddp"
    assert derived.trainer_sharding("fsdp", 2, fits, h200) == "fsdp"
    assert derived.trainer_sharding("fsdp", 1, too_large, h200) == "single"
    assert derived.trainer_fits(too_large, h200, shards=2) and not derived.trainer_fits(too_large, h200)


def test_fsdp_becomes_trls_fsdp2_config_and_ddp_changes_nothing(tmp_path):
    from jobs.demo.preset import demo_spec

    spec = demo_spec("fsdp", f"file://{tmp_path}", compute={"trainer_processes": 2, "trainer_sharding": "fsdp"})
    sharded = grpo_config(spec, str(tmp_path), "http://127.0.0.1:9999", cuda=False, sharding="fsdp")
    assert sharded.fsdp_plugin_args["fsdp_version"] == 2  # TRL 1.16's async trainer gathers FSDP2 DTensors only
    assert sharded.fsdp_plugin_args["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert sharded.fsdp_plugin_args["reshard_after_forward"] is True
    plain = grpo_config(spec, str(tmp_path), "http://127.0.0.1:9999", cuda=False, sharding="ddp")
    assert plain.fsdp_plugin_args is None and not plain.fsdp


def test_fsdp_for_one_trainer_process_is_refused_naming_the_field():
    from jobs.contract import SpecError

    with pytest.raises(SpecError) as refused:
        parse_spec({"run_id": "one-proc", "compute": {"trainer_sharding": "fsdp"}})
    assert "compute.trainer_sharding" in str(refused.value) and "trainer_processes to 2 or more" in str(refused.value)


def test_the_parameter_count_is_read_from_safetensors_headers_without_loading_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from jobs.demo.tiny_model import ensure_tiny_model
    from jobs.models import parameter_count

    folder = ensure_tiny_model()
    assert parameter_count(str(folder)) == AutoModelForCausalLM.from_pretrained(folder).num_parameters()
    assert parameter_count(str(tmp_path)) is None  # no weights there: on GPUs the sharding falls back to FSDP


def test_the_main_process_is_rank_0_of_torchrun_or_the_only_one():
    from jobs.trainer import ranks

    assert (ranks.rank({}), ranks.world_size({}), ranks.is_main_process({})) == (0, 1, True)
    first = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    second = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert (ranks.rank(first), ranks.world_size(first), ranks.is_main_process(first)) == (0, 2, True)
    assert (ranks.rank(second), ranks.world_size(second), ranks.is_main_process(second)) == (1, 2, False)


def test_one_process_decides_alone_and_makes_its_own_working_folder(tmp_path, monkeypatch):
    from jobs.trainer import ranks

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert ranks.from_main(lambda: "decided") == "decided"
    ranks.wait_for_all()  # nothing to wait for
    assert ranks.shared_workdir(str(tmp_path), "run-a") == str(tmp_path)
    made = ranks.shared_workdir(None, "run-a")
    assert os.path.isdir(made) and os.path.basename(made).startswith("trainer-run-a-")
    os.rmdir(made)


def test_truncation_is_judged_with_every_eos_the_generation_config_lists(tmp_path):
    """Issue 13: Qwen2.5-style models end generations on two ids; a completion ending on the second one is not cut
    off, and `math_boxed` must score it."""
    from jobs.models import eos_token_ids
    from jobs.trainer.rewards import MathBoxed

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    qwen_style = eos_token_ids(str(tmp_path), 151643)
    assert qwen_style == [151643, 151645]
    reward = MathBoxed(qwen_style)
    ended_on_im_end = reward(["\\boxed{4}"], completion_ids=[[5, 151645]], answer=["4"])
    cut_off = reward(["\\boxed{4}"], completion_ids=[[5, 6]], answer=["4"])
    assert (ended_on_im_end, cut_off) == ([1.0], [0.0])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(str(tmp_path), 151643) == [7, 151643]
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(str(tmp_path), 151643) == [151643]


# --- the policy audit's verdict and the weights of the version before ------------------------------------------------

FP32 = 1e-3  # the audit's float32 tolerance (jobs/trainer/audit.py TOLERANCE)


def test_a_replica_serving_the_published_version_matches():
    verdict, why = judge(5, {"current": 1e-6, "previous": 0.3, "base": 0.6}, {"previous": 0.3, "base": 0.6}, FP32)
    assert verdict == "match" and why.startswith("serves v5 ")


def test_a_replica_serving_the_version_before_or_the_base_or_neither_fails_naming_what_it_serves():
    separation = {"previous": 0.3, "base": 0.6}
    verdict, why = judge(5, {"current": 0.3, "previous": 1e-6, "base": 0.6}, separation, FP32)
    assert verdict == "stale" and "serves v4 under v5's name" in why
    verdict, why = judge(5, {"current": 0.6, "previous": 0.3, "base": 1e-6}, separation, FP32)
    assert verdict == "base" and "serves the base model under v5's name" in why
    verdict, why = judge(5, {"current": 0.2, "previous": 0.4, "base": 0.5}, separation, FP32)
    assert verdict == "mismatch" and verdict in FAILING


def test_a_version_the_probe_cannot_tell_from_the_one_before_is_inconclusive_not_a_match():
    """At bf16 (tolerance 0.1) one sync may move the policy less than the noise: a replica serving v(N-1) is then
    within the tolerance of vN (the old absolute check passed it). The record says the audit cannot tell."""
    bf16 = 0.1
    verdict, why = judge(5, {"current": 0.05, "previous": 0.03, "base": 0.9}, {"previous": 0.05, "base": 0.9}, bf16)
    assert verdict == "inconclusive" and "cannot be told from v4" in why
    # Told apart once the versions are (MARGIN + 1) tolerances apart: the same noise is then a clear match.
    apart = (MARGIN + 1) * bf16
    verdict, _ = judge(5, {"current": 0.05, "previous": apart, "base": 0.9}, {"previous": apart, "base": 0.9}, bf16)
    assert verdict == "match"
    # The first version equals the base model (LoRA's B starts at zero); after a resume v(N-1) is not in memory.
    verdict, why = judge(1, {"current": 1e-6, "base": 1e-6}, {"base": 0.0}, FP32)
    assert verdict == "inconclusive" and "the base model" in why
    assert judge(7, {"current": 1e-6, "base": 0.5}, {"base": 0.5}, FP32)[0] == "match"


def tiny_peft_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora)


def test_after_a_resume_the_version_before_is_read_back_from_the_store_as_it_was_published(tmp_path):
    """The first audit after a resume has no v(N-1) in memory: it is read from the store, where the proxy published
    it (`save_pretrained` of the same adapter), and scores exactly as v(N-1) did."""
    model = tiny_peft_model().eval()
    ids = torch.tensor([[1, 5, 9, 13]])
    store = LocalStore(tmp_path / "store")
    with torch.no_grad():
        logits_v1 = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "v1")
    publish_directory(store, layout.adapter_prefix("resumed", 1), tmp_path / "v1", {"version": 1})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
    resumed = VersionWeights()  # a fresh process: nothing kept
    assert resumed.keep(1, read_published_weights(store, "resumed", 1))
    assert not resumed.keep(7, read_published_weights(store, "resumed", 7))
    with torch.no_grad(), resumed.loaded(model, 1):
        assert torch.equal(model(input_ids=ids).logits, logits_v1)


def test_the_weights_of_the_version_before_are_scored_then_the_trainers_own_restored_bit_for_bit():
    model = tiny_peft_model().eval()
    ids = torch.tensor([[1, 5, 9, 13]])
    versions = VersionWeights()
    versions.note(model, 1)
    with torch.no_grad():
        logits_v1 = model(input_ids=ids).logits
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))  # an optimizer step, in place
        logits_v2 = model(input_ids=ids).logits
    versions.note(model, 2)
    parameters = {name: p for name, p in model.named_parameters()}
    own = lora_weights(model)
    assert not torch.allclose(logits_v1, logits_v2)
    with torch.no_grad(), versions.loaded(model, 1):
        assert torch.equal(model(input_ids=ids).logits, logits_v1)
    after = lora_weights(model)
    assert all(torch.equal(after[name], own[name]) for name in own)
    assert all(p is parameters[name] for name, p in model.named_parameters())  # the optimizer's tensors, untouched
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits_v2)
    versions.note(model, 3)
    assert (versions.has(1), versions.has(2), versions.has(3)) == (False, True, True)


def test_stale_drops_are_logged_once_then_summed_up_per_burst(caplog):
    """Issue 33, item 5: TRL logged one INFO line per dropped sample (most of a demo trainer's log)."""
    from accelerate.logging import get_logger
    from accelerate.state import PartialState

    from jobs.trainer.stale_drops import TRL_TRAINER_LOGGER, summarise_stale_drops

    PartialState()
    trl_logger = get_logger(TRL_TRAINER_LOGGER)  # as TRL's trainer makes its logger: "[RANK 0] " before each line
    summary = summarise_stale_drops()
    try:
        with caplog.at_level(logging.INFO):
            for burst in (5, 3):
                for _ in range(burst):
                    trl_logger.info("dropping stale sample (staleness=2, max=1)")
                trl_logger.info("Weight sync: done. Total 0.8s")
        lines = [record.getMessage() for record in caplog.records]
    finally:
        logging.getLogger(TRL_TRAINER_LOGGER).removeFilter(summary)
    assert lines == [
        "[RANK 0] dropping stale sample (staleness=2, max=1); further drops are counted in one line per burst",
        "4 more samples dropped as too stale (5 in all)",
        "[RANK 0] Weight sync: done. Total 0.8s",
        "3 more samples dropped as too stale (8 in all)",
        "[RANK 0] Weight sync: done. Total 0.8s",
    ]


def test_the_rollout_worker_holds_no_more_scored_groups_than_the_window_leaves_room_for(monkeypatch):
    """Issue 33, item 5: TRL's worker kept 16 scored groups beyond its queue (two demo steps' worth): a third of the
    samples went stale. The trainer builds its worker with the derived count, and it is still TRL's worker."""
    import importlib

    from jobs.trainer.rollout_worker import TRL_TRAINER_MODULE, use_job_rollout_worker

    cpu_compat.apply_cpu_patches(force=True)  # TRL's worker refuses to be built without vLLM unless patched
    trainer = importlib.import_module(TRL_TRAINER_MODULE)
    monkeypatch.setattr(trainer, "AsyncRolloutWorker", trainer.AsyncRolloutWorker)  # put back after the test
    original = trainer.AsyncRolloutWorker
    use_job_rollout_worker(2)
    use_job_rollout_worker(1)  # a second call replaces the first rather than stacking on it
    worker = trainer.AsyncRolloutWorker(queue_maxsize=24, num_generations=8)
    assert isinstance(worker, original) and trainer.AsyncRolloutWorker.__bases__[-1] is original
    assert worker._loop_kwargs["score_queue_maxsize"] == 1 and worker._loop_kwargs["queue_maxsize"] == 24
    spec = demo_spec("demo-groups", "file:///tmp/store")
    assert derived.rollout_limits(spec) == (32, 24, 1)  # in flight, queued, scored groups: 64, the window
