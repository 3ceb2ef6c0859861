"""In-context re-ranking (Chen et al., ICLR 2025: attention in LLMs yields efficient
zero-shot re-rankers): the documents go into one prompt, the query after them, and a
document's score is the attention mass the query's tokens put on it, computed on the
device (`attention_mass`, one span per document), minus the mass a content-free query
puts on it (the calibration pass, batched beside the real one in the same generate call),
averaged over the chosen layers' heads and the query's tokens."""
from __future__ import annotations

import numpy as np

from graphtap.spans import text_with_spans

HEADER = "Here are some paragraphs:\n\n"
ASK = "Please find information that is relevant to the following query in the paragraphs above.\n\nQuery: "
CONTENT_FREE = "N/A"


def layout(tokenizer, documents: list[str], query: str):
    """(token ids, document spans, query span) of the prompt, each piece tokenised alone
    so the spans are exact."""
    pieces = [HEADER] + [f"[{i + 1}] {d}\n\n" for i, d in enumerate(documents)] + [ASK, query]
    ids, spans = text_with_spans(tokenizer, pieces, add_special_tokens=False)
    bounds = [(s["start"], s["end"]) for s in spans]
    return ids, bounds[1:-2], bounds[-1]


def _request(tokenizer, documents, query, layers, heads):
    ids, docs, (q0, q1) = layout(tokenizer, documents, query)
    spans = [{"start": s, "end": e} for s, e in docs]
    entries = [{"site": f"blocks.{layer}.attn.hook_pattern", "spans": spans,
                "positions": list(range(q0, q1)),
                **({"heads": heads[layer]} if heads and layer in heads else {})}
               for layer in layers]
    return {"prompt_token_ids": ids}, {"attention_mass": entries}


def scores_from(outputs, layers) -> np.ndarray:
    """Per document, the mass of the query's tokens, mean over layers, heads, tokens."""
    per_layer = [outputs.hooks[f"mass:blocks.{layer}.attn.hook_pattern"].float().mean((0, 1))
                 for layer in layers]
    return np.mean([m.numpy() for m in per_layer], axis=0)


def rerank(llm, query: str, documents: list[str], layers: list[int],
           heads: dict[int, list[int]] | None = None) -> list[tuple[int, float]]:
    """(document index, calibrated score), best first. The engine needs
    `blocks.{L}.attn.hook_pattern` configured for each layer; at most
    hook_config.max_spans documents."""
    from vllm import SamplingParams

    if not documents:
        raise ValueError("rerank: no documents")
    tok = llm.get_tokenizer()
    prompts, params = [], []
    for q in (query, CONTENT_FREE):
        prompt, hooks = _request(tok, documents, q, layers, heads)
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=1, temperature=0.0, hooks=hooks))
    real, calibration = llm.generate(prompts, params, use_tqdm=False)
    for out in (real, calibration):
        if out.hooks is None or out.hooks.error:
            raise RuntimeError(f"rerank: {out.hooks.error if out.hooks else 'no outputs'}")
    score = scores_from(real, layers) - scores_from(calibration, layers)
    order = np.argsort(-score, kind="stable")
    return [(int(i), float(score[i])) for i in order]
