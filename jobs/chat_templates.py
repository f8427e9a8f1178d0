"""Whether TRL 1.16's rollout worker can read a model's replies, and the response template to give it when it cannot.

TRL's rollout worker turns each completion back into a chat message with a response template (transformers' chat
response parsing). It attaches one itself only when the tokenizer's chat template is, byte for byte, one of the
templates TRL ships (Qwen2.5, Qwen3, Llama 3.1/3.2, Gemma 4, ...); for any other template it raises "Unrecognized
chat template" in its spawned child, after the model has loaded and the first adapter version was synced, with the
replicas already billing. Qwen2.5-Math, the public recipe's model, is such a template: Qwen2.5's with another default
system prompt. So:

- a template TRL recognises needs nothing;
- a ChatML template (the Qwen family: `<|im_start|>assistant` ... `<|im_end|>`) gets the recipe's response template;
- anything else is refused before launch, naming the model and what to do.

The panel's preflight runs `response_template` on the model's tokenizer files; the trainer runs it again on the
tokenizer it loaded and sets the result on it (TRL's child receives the tokenizer pickled, attribute included).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# The recipe's: the assistant turn opens with this anchor; its content ends at <|im_end|> or, for a completion cut off
# at the length cap, at the end of the text.
CHATML_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*|$", "content": "text"}},
}


class ChatTemplateError(ValueError):
    """The model's chat template cannot be used for training; the message names the field and the fix."""


def response_template(
    chat_template: str | dict[str, str] | None, model_id: str, tools: bool = False
) -> dict[str, Any] | None:
    """None when TRL recognises `chat_template` itself, the ChatML response template for another ChatML template;
    ChatTemplateError for any other template (or none). With `tools` (an agent run), only a template TRL recognises
    will do: the ChatML response template reads a reply's text, never its tool calls."""
    if not chat_template:
        raise ChatTemplateError(
            f"model.id: {model_id} has no chat template, and the trainer sends prompts as chat messages; use an "
            "instruct or chat model, or one whose tokenizer_config.json has a chat_template"
        )
    if not isinstance(chat_template, str):
        raise ChatTemplateError(
            f"model.id: {model_id} has several named chat templates ({', '.join(chat_template)}), which TRL 1.16 "
            "cannot parse replies with; use a model with a single chat template"
        )
    if _recognised_by_trl(chat_template):
        return None
    if tools:
        raise ChatTemplateError(
            f"model.id: TRL 1.16 cannot read tool calls in {model_id}'s chat template (it reads them in the templates "
            "of Qwen2.5/Qwen3, Llama 3.1/3.2, Gemma 4 and a few others); use such a model, or set environment.kind "
            "to none"
        )
    if "<|im_start|>" in chat_template and "<|im_end|>" in chat_template:
        return CHATML_RESPONSE_TEMPLATE
    raise ChatTemplateError(
        f"model.id: TRL 1.16 cannot read replies in {model_id}'s chat template (it recognises the templates of "
        "Qwen2.5/Qwen3, Llama 3.1/3.2, Gemma 4 and a few others, and any ChatML template); use such a model"
    )


def _recognised_by_trl(chat_template: str) -> bool:
    """Whether TRL attaches a response template to this chat template by itself (it compares the whole text)."""
    from trl.chat_template_utils import add_response_schema

    try:
        add_response_schema(SimpleNamespace(chat_template=chat_template))
    except ValueError:
        return False
    return True


ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"  # transformers' folder of named `<name>.jinja` templates


def chat_template_in(folder: str | Path) -> str | dict[str, str] | None:
    """The chat template a tokenizer saved in `folder` loads with, read as transformers reads it: template files
    (`chat_template.jinja` as "default", `additional_chat_templates/<name>.jinja` by name) take priority over the
    `chat_template` of `tokenizer_config.json`; one default file is a plain template, several are named ones."""
    folder = Path(folder)
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text()
    for path in sorted((folder / ADDITIONAL_TEMPLATES_DIR).glob("*.jinja")):
        files[path.name.removesuffix(".jinja")] = path.read_text()
    if files:
        return files["default"] if list(files) == ["default"] else files
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template: str | list[dict[str, str]] | None = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # named variants, as transformers turns them into a dict
        return {item["name"]: item["template"] for item in template}
    return template


def fit_tokenizer(tokenizer: Any, model_id: str, tools: bool = False) -> None:
    """Give `tokenizer` the response template TRL's rollout worker needs for it, if TRL has none of its own; raise
    ChatTemplateError when its replies cannot be read at all (preflight refuses such a model before launch)."""
    template = response_template(tokenizer.chat_template, model_id, tools)
    if template is not None:
        tokenizer.response_template = template
