"""Token spans of the parts of a chat prompt, for `attention_mass` (the Attention
Tracker's instruction and data, re-ranking's documents).

The chat template is rendered once with a marker string in place of each part; the
template's own text between markers and each part are tokenised separately and joined,
so every part's span is exact by construction and the ids are exactly what the model is
given (send them as `prompt_token_ids`, or as a completions `prompt` of ids over HTTP:
a server that tokenised the rendered text itself may merge tokens across a boundary).
"""
from __future__ import annotations

import re

_MARK = "\x00graphtap-part-{}\x00"
_SPLIT = re.compile("\x00graphtap-part-(\\d+)\x00")


def chat_with_spans(tokenizer, messages: list[dict], add_generation_prompt: bool = True
                    ) -> tuple[list[int], list[dict]]:
    """(token ids, spans) of a chat through the model's template. A message's content is
    a string or a list of strings (parts); one span {"start", "end"} per part, in order
    (a string content is one part). Empty parts are refused: they would span nothing."""
    parts: list[str] = []
    rendered = []
    for m in messages:
        content = m["content"]
        pieces = [content] if isinstance(content, str) else list(content)
        marks = []
        for piece in pieces:
            if not isinstance(piece, str) or not piece:
                raise ValueError(f"messages: part {len(parts)} is empty or not a string")
            marks.append(_MARK.format(len(parts)))
            parts.append(piece)
        rendered.append({**m, "content": "".join(marks)})
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    pieces = _SPLIT.split(text)  # template text, part index, template text, ...
    found = [int(i) for i in pieces[1::2]]
    if found != list(range(len(parts))):
        raise ValueError("the chat template changed or dropped a part's content; spans "
                         "cannot be found from markers")
    ids: list[int] = []
    spans: list[dict] = []

    def add(piece: str) -> tuple[int, int]:
        start = len(ids)
        if piece:
            ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        return start, len(ids)

    for k, template_text in enumerate(pieces[0::2]):
        add(template_text)
        if k < len(parts):
            start, end = add(parts[k])
            spans.append({"start": start, "end": end})
    return ids, spans


def text_with_spans(tokenizer, parts: list[str], add_special_tokens: bool = True
                    ) -> tuple[list[int], list[dict]]:
    """(token ids, spans) of plain text made of parts (no chat template): each part
    tokenised alone, the tokenizer's special tokens (BOS) before the first."""
    ids = list(tokenizer("", add_special_tokens=add_special_tokens)["input_ids"]) \
        if add_special_tokens else []
    spans = []
    for p in parts:
        part = tokenizer(p, add_special_tokens=False)["input_ids"]
        spans.append({"start": len(ids), "end": len(ids) + len(part)})
        ids += part
    return ids, spans
