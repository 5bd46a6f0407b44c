"""Chat messages -> prompt text.

Three templates, the first that applies:
- the tokenizer config's `chat_template` (HuggingFace `tokenizer_config.json` beside
  the gateway's `--tokenizer tokenizer.json`), a Jinja template rendered in a sandbox
  with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token` and
  `raise_exception`, as `transformers`' `apply_chat_template` does;
- otherwise, for a tokenizer in a DeepSeek V4 checkpoint directory (`config.json` with
  `model_type: deepseek_v4`, whose checkpoints ship no template), DeepSeek V4's chat
  encoding (kvmesh/chat_deepseek_v4.py, non-thinking mode);
- otherwise, for the byte-level model, `PLAIN`: each message as `<|role|>\\n` + content
  + `\\n`, then `<|assistant|>\\n` for the reply. Plain bytes, no special tokens: the
  byte-level vocabulary has none for roles.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.chat_deepseek_v4 import encode_chat
from kvmesh.checkpoint_dir import model_type
from kvmesh.errors import InvalidArgument


def plain_template(messages: list[dict]) -> str:
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _token_text(value) -> str:
    """bos/eos in a tokenizer config: a string or an AddedToken dict {content: ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class JinjaTemplate:
    """A HuggingFace chat template, compiled once, rendered per request."""

    def __init__(self, source: str, bos: str = "", eos: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._error = TemplateError
        self.template = env.from_string(source)
        self.bos, self.eos = bos, eos

    def __call__(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=self.bos, eos_token=self.eos)
        except self._error as exc:  # the template refused these messages
            raise InvalidArgument(f"messages: the chat template refused them: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:  # the template's own bug
            raise InvalidArgument(f"messages: the chat template failed on them: "
                                  f"{type(exc).__name__}: {exc}") from None


def deepseek_v4_template(messages: list[dict]) -> str:
    try:
        return encode_chat(messages)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def load_template(tokenizer_path: str):
    """The chat template for a gateway's `tokenizer` setting: the Jinja one from
    `tokenizer_config.json` next to the tokenizer file when it has `chat_template`
    (a string, or a list of {name, template}: the one named "default"); else DeepSeek V4's
    encoding when the tokenizer is in a DeepSeek V4 or V4.1 checkpoint directory; else
    `plain`."""
    if not tokenizer_path:
        return plain_template
    cfg_path = Path(tokenizer_path).with_name("tokenizer_config.json")
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    source = cfg.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return JinjaTemplate(source, _token_text(cfg.get("bos_token")),
                             _token_text(cfg.get("eos_token")))
    # V4.1 keeps V4's encoding for system / user / assistant turns (its additions, a
    # mid-conversation <｜System｜> and DSML tool calls, are not rendered: tools are refused)
    if model_type(Path(tokenizer_path).with_name("config.json")) in ("deepseek_v4",
                                                                       "deepseek_v41"):
        return deepseek_v4_template
    return plain_template
