"""Chat templates TRL 1.16 can and cannot read replies in (issue 13), with the tokenizer configs of real models.

tests/fixtures/tokenizers/ holds the chat template and special tokens of three models: Qwen2.5-Math-1.5B (the
recipe's model: Qwen2.5's ChatML template with its own default system prompt), Llama-3.1-8B-Instruct and
gemma-2-2b-it (their templates as TRL ships them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jobs.chat_templates import CHATML_RESPONSE_TEMPLATE, ChatTemplateError, chat_template_in, response_template
from jobs.demo.tiny_model import ensure_tiny_model

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tokenizers"


def template(name: str) -> str:
    return json.loads((FIXTURES / f"{name}.json").read_text())["chat_template"]


def test_qwen_math_gets_the_recipes_response_template_and_it_parses_a_reply():
    """TRL does not recognise Qwen2.5-Math's template; the ChatML response template reads its replies, also one cut
    off at the length cap."""
    math = template("qwen2.5-math-1.5b")
    assert response_template(math, "Qwen/Qwen2.5-Math-1.5B") == CHATML_RESPONSE_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    tokenizer.chat_template = math
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert "Please reason step by step" in prompt and prompt.endswith(CHATML_RESPONSE_TEMPLATE["start_anchor"])
    tokenizer.response_template = CHATML_RESPONSE_TEMPLATE
    assert tokenizer.parse_response("\\boxed{4}<|im_end|>", prefix=prompt)["content"] == "\\boxed{4}"
    assert tokenizer.parse_response("so the answer is", prefix=prompt)["content"] == "so the answer is"


def test_templates_trl_recognises_need_nothing():
    assert response_template(template("llama-3.1-8b-instruct"), "meta-llama/Llama-3.1-8B-Instruct") is None
    demo = AutoTokenizer.from_pretrained(str(ensure_tiny_model())).chat_template
    assert response_template(demo, "builtin:tiny-qwen2") is None  # the demo runs as it always did


def test_a_template_trl_cannot_read_is_refused_with_the_model_named():
    with pytest.raises(ChatTemplateError, match=r"^model\.id: TRL 1\.16 cannot read replies in google/gemma-2-2b-it"):
        response_template(template("gemma-2-2b-it"), "google/gemma-2-2b-it")
    with pytest.raises(ChatTemplateError, match=r"^model\.id: acme/base has no chat template"):
        response_template(None, "acme/base")
    with pytest.raises(ChatTemplateError, match=r"several named chat templates \(default, tool_use\)"):
        response_template({"default": "x", "tool_use": "y"}, "acme/multi")


def test_the_template_is_read_from_a_saved_tokenizer_as_transformers_reads_it(tmp_path):
    shutil.copy(FIXTURES / "gemma-2-2b-it.json", tmp_path / "tokenizer_config.json")
    assert chat_template_in(tmp_path) == template("gemma-2-2b-it")
    (tmp_path / "chat_template.jinja").write_text(template("llama-3.1-8b-instruct"))
    assert chat_template_in(tmp_path) == template("llama-3.1-8b-instruct")  # the .jinja file wins
    variants = [{"name": "default", "template": "a"}, {"name": "rag", "template": "b"}]
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": variants}))
    assert chat_template_in(tmp_path) == {"default": "a", "rag": "b"}
    assert chat_template_in(tmp_path / "nothing-here") is None


@pytest.mark.parametrize(
    "files",
    [
        {"chat_template.jinja": "main"},
        {"chat_template.jinja": "main", "additional_chat_templates/tool_use.jinja": "tools"},
        {"additional_chat_templates/rag.jinja": "rag"},  # a config template is then not used at all
    ],
    ids=["one file", "a default and a named one", "a named one only"],
)
def test_template_files_are_read_as_transformers_loads_them(tmp_path, files):
    """Preflight must judge the template the trainer will load: compare with transformers loading the same folder."""
    shutil.copytree(ensure_tiny_model(), tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert chat_template_in(tmp_path) == AutoTokenizer.from_pretrained(str(tmp_path)).chat_template


def test_the_trainers_tokenizer_carries_the_response_template_into_trls_child():
    """TRL pickles the tokenizer into its spawned rollout worker, which skips its own lookup when one is set."""
    import pickle

    from jobs.chat_templates import fit_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    fit_tokenizer(tokenizer, "builtin:tiny-qwen2")
    assert getattr(tokenizer, "response_template", None) is None  # recognised by TRL: left to it
    tokenizer.chat_template = template("qwen2.5-math-1.5b")
    fit_tokenizer(tokenizer, "Qwen/Qwen2.5-Math-1.5B")
    assert pickle.loads(pickle.dumps(tokenizer)).response_template == CHATML_RESPONSE_TEMPLATE
    tokenizer.chat_template = template("gemma-2-2b-it")
    with pytest.raises(ChatTemplateError, match="google/gemma-2-2b-it"):
        fit_tokenizer(tokenizer, "google/gemma-2-2b-it")
