"""DeepSeek V4's chat encoding (its checkpoints ship no Jinja template). Here in kvmesh/
because both the gateway (/v1/chat/completions) and the engine's tools need it.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>
        <｜User｜>{user}<｜Assistant｜></think>          <- the model continues from here

Earlier assistant turns keep only their answer (no reasoning), each opened by `</think>` and
closed by end-of-sentence. The prompt ends with `<｜Assistant｜></think>` (non-thinking mode)
or `<｜Assistant｜><think>` (thinking mode). The special tokens are single ids in the
checkpoint's tokenizer.json.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)


def encode_chat(messages: list[dict], thinking: bool = False) -> str:
    """OpenAI-style messages -> the prompt text. ValueError names the bad field."""
    if not messages:
        raise ValueError("messages: need at least one message")
    out = [BOS]
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string")
        if role == "system":
            if any(m.get("role") != "system" for m in messages[:i]):
                raise ValueError(f"messages[{i}].role: system messages must come first")
            out.append(content)
        elif role == "user":
            out += [USER, content]
        elif role == "assistant":
            if i == 0 or messages[i - 1].get("role") != "user":
                raise ValueError(f"messages[{i}].role: an assistant turn must follow a user turn")
            out += [ASSISTANT, END_THINK, content, EOS]
        else:
            raise ValueError(f"messages[{i}].role: {role!r} is not system, user or assistant")
    if messages[-1].get("role") != "user":
        raise ValueError("messages: the last message must be the user's")
    out += [ASSISTANT, THINK if thinking else END_THINK]
    return "".join(out)
