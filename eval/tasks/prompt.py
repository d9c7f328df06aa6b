"""The one prompt builder: a sample's text → token ids that know where the context ends (``cache.runner.Prompt``).

Used by the command line, the environments, the traces and the evaluation harness alike.

- Without the chat template (``chat=False``, a tokenizer without one, or natural-text samples of metric
  ``kl``): ``ids = tokens(input + answer_prefix)`` with the tokenizer's special tokens, tokenized as one text
  (so the ids are the same whether or not the sample is split).
- With the chat template: the input is the user turn, the generation prompt follows, then the answer prefix
  opens the assistant's reply: ``tokens(template(input) + answer_prefix)`` (the rendered template carries its
  special tokens as text).
- ``context_end`` is the first token that reaches past the end of the context in that text (from the
  tokenizer's offsets; a token straddling the boundary, like " What", belongs to the question), so the
  question, the template's closing text and the answer prefix come after it.
- Later turns (multi-turn samples): without the chat template, ``tokens(question + answer_prefix)`` of each
  turn; with it, what the template adds after an assistant answer for the next user question, without the
  end-of-turn marker the answer's own EOS token already closes.
"""

from __future__ import annotations

import re

from cache.runner import Prompt

ANSWER_PLACEHOLDER = "\x00kvgym-answer\x00"


def encode(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text``; ``special=False`` adds no BOS/EOS (for text appended to a prompt)."""
    ids = tokenizer(text).input_ids if special else tokenizer(text, add_special_tokens=False).input_ids
    return list(ids.tolist() if hasattr(ids, "tolist") else ids)


def uses_chat(tokenizer, sample, chat: bool) -> bool:
    """Whether the prompt is wrapped in the chat template (asked for, a template exists, not natural text)."""
    return bool(chat) and sample.metric != "kl" and bool(getattr(tokenizer, "chat_template", None))


def _encode_with_offsets(tokenizer, text: str, special: bool) -> tuple[list[int], list] | None:
    """Ids of ``text`` and each token's character span; None for a tokenizer that gives no offsets (a slow one)."""
    try:
        encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        if len(offsets) != len(encoded["input_ids"]):
            raise ValueError("no offsets")
    except (NotImplementedError, KeyError, TypeError, ValueError):
        return None
    return list(encoded["input_ids"]), offsets


def _split_ids(tokenizer, text: str, boundary: int, special: bool) -> tuple[list[int], int]:
    """Ids of ``text`` and the index of the first token that reaches past character ``boundary``."""
    encoded = _encode_with_offsets(tokenizer, text, special)
    if encoded is None:  # a slow tokenizer: no offsets
        ids = encode(tokenizer, text, special)
        head = encode(tokenizer, text[:boundary], special)
        return ids, len(head) if ids[: len(head)] == head else max(len(head) - 1, 1)
    ids, offsets = encoded
    # the first token holding any character past the boundary (a token straddling it belongs to the question)
    end = next((i for i, (start, stop) in enumerate(offsets) if stop > boundary and stop > start), len(ids))
    return ids, max(end, 1)


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _prompt_text(tokenizer, sample, chat: bool) -> tuple[str, int, bool]:
    """The text ``build_prompt`` tokenises (the answer prefix included), where the sample's input starts in it, and
    whether the tokenizer adds its special tokens (not to a rendered chat, which has them)."""
    if uses_chat(tokenizer, sample, chat):
        rendered = _render(tokenizer, [{"role": "user", "content": sample.input}])
        where = rendered.find(sample.input)
        if where < 0:
            raise ValueError(f"sample {sample.task}/{sample.index}: the chat template does not keep the input verbatim")
        return rendered + sample.answer_prefix, where, False
    return sample.input + sample.answer_prefix, 0, True


def build_prompt(tokenizer, sample, chat: bool = True) -> Prompt:
    """The sample's ``Prompt`` (see the module docstring)."""
    text, where, special = _prompt_text(tokenizer, sample, chat)
    ids, context_end = _split_ids(tokenizer, text, where + len(sample.context), special)
    return Prompt(ids, context_end=min(context_end, len(ids)), turns=turn_ids(tokenizer, sample, chat))


def answer_positions(tokenizer, sample, chat: bool = True) -> list[int]:
    """Positions, in ``build_prompt(tokenizer, sample, chat)``'s ids, of the context tokens that hold a gold
    answer's characters, at every place the context states it (the needle of a retrieval task); empty when no
    gold answer occurs in the context, or the tokenizer gives no character offsets."""
    text, where, special = _prompt_text(tokenizer, sample, chat)
    encoded = _encode_with_offsets(tokenizer, text, special)
    if encoded is None:
        return []
    spans = [(where + found.start(), where + found.end()) for answer in sample.outputs if answer
             for found in re.finditer(re.escape(answer), sample.context)]
    return [i for i, (start, stop) in enumerate(encoded[1]) if any(start < b and stop > a for a, b in spans)]


def turn_ids(tokenizer, sample, chat: bool = True) -> list[list[int]]:
    """The token ids of each later turn of a multi-turn sample (empty for a single-turn one)."""
    if not sample.turns:
        return []
    if not uses_chat(tokenizer, sample, chat):
        return [encode(tokenizer, turn.question + turn.answer_prefix, special=False) for turn in sample.turns]
    out, messages = [], [{"role": "user", "content": sample.input}]
    for turn in sample.turns:
        messages = messages + [{"role": "assistant", "content": ANSWER_PLACEHOLDER},
                               {"role": "user", "content": turn.question}]
        delta = _render(tokenizer, messages).split(ANSWER_PLACEHOLDER)[-1]
        eos = getattr(tokenizer, "eos_token", None)
        if eos and delta.startswith(eos):  # the answer's own EOS token closes the assistant turn
            delta = delta[len(eos):]
        out.append(encode(tokenizer, delta + turn.answer_prefix, special=False))
        messages[-2] = {"role": "assistant", "content": ""}
    return out


def text_prompt(tokenizer, text: str, chat: bool = True) -> Prompt:
    """A free text's ``Prompt`` (``kvgym generate``): all of it is context; in the chat template when ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = encode(tokenizer, _render(tokenizer, [{"role": "user", "content": text}]), special=False)
    else:
        ids = encode(tokenizer, text)
    return Prompt(ids)
