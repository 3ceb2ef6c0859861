"""Analyzers against HF transformers on the tiny models (no engine): attention from
captured-style q/k equals HF's eager attention, the logit lens at the last layer equals
HF's logits, focus scores and probe scores equal their formulas."""
import numpy as np
import pytest
import torch

from graphtap.analyzers import (LogitLens, attention_from_qk, focus_score, head_summary,
                                probe_scores, span_mass)
from graphtap.testing.engines import _hf_model, tokenize
from graphtap.testing.hf_reference import (hf_attention_pattern, hf_capture,
                                           hf_capture_attention)

PROMPT = "Prompt injection asks a model to ignore"


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_attention_from_qk_equals_hf_eager_attention(model, request):
    path = request.getfixturevalue(f"{model}_path")
    hf = _hf_model(str(path))
    ids = tokenize(path, [PROMPT])[0]
    got, positions = hf_capture_attention(hf, ids, 1, 1)  # one forward: the prompt
    pattern = attention_from_qk(got["q"], got["k"], positions, positions)
    want = hf_attention_pattern(hf, ids, 1)
    torch.testing.assert_close(pattern, want, atol=1e-5, rtol=1e-4)


def test_logit_lens_at_the_last_layer_is_the_models_logits(llama_path):
    hf = _hf_model(str(llama_path))
    ids = tokenize(llama_path, [PROMPT])[0]
    last = f"blocks.{hf.config.num_hidden_layers - 1}.hook_resid_post"
    rows, _, _ = hf_capture(hf, ids, 1, [last])
    lens = LogitLens.from_pretrained(llama_path)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(lens.logits(rows[last][:len(ids)]), want, atol=1e-4, rtol=1e-4)
    tokens, probs = lens.top(rows[last][:len(ids)], k=3)
    assert tokens[:, 0].tolist() == want.argmax(-1).tolist() and (probs[:, 0] >= probs[:, 1]).all()


def test_focus_and_span_mass():
    pattern = torch.zeros(2, 10)
    pattern[0, 1:4] = 0.2  # head 0: 0.6 on the instruction, 0.2 on the data
    pattern[0, 6:8] = 0.1
    pattern[1, 1:4] = 0.1  # head 1: 0.3 vs 0.6
    pattern[1, 6:8] = 0.3
    torch.testing.assert_close(span_mass(pattern, [(1, 4), (6, 8)]),
                               torch.tensor([[0.6, 0.2], [0.3, 0.6]]))
    assert focus_score(pattern, (1, 4), (6, 8)) == pytest.approx((0.75 + 1 / 3) / 2)
    assert focus_score(pattern[None], (1, 4), (6, 8), heads=[1]) == pytest.approx(1 / 3)


def test_head_summary_of_a_uniform_and_a_sink_head():
    tq, k = 3, 6
    pattern = torch.zeros(tq, 2, k)
    q_pos = torch.tensor([3, 4, 5])
    for i, p in enumerate(q_pos.tolist()):
        pattern[i, 0, :p + 1] = 1.0 / (p + 1)  # uniform over the causal window
        pattern[i, 1, 0] = 1.0  # everything on the first token
    uniform, sink = head_summary(pattern, q_pos)
    assert sink["first_token"] == 1.0 and sink["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert uniform["entropy"] == pytest.approx(float(np.mean([np.log(p + 1) for p in (3, 4, 5)])))
    assert sink["distance"] == pytest.approx(4.0) and uniform["distance"] == pytest.approx(2.0)


def test_probe_scores():
    rows = torch.randn(5, 8)
    w = torch.randn(2, 8)
    torch.testing.assert_close(probe_scores(rows, w, [1.0, -1.0], "sigmoid"),
                               torch.sigmoid(rows @ w.T + torch.tensor([1.0, -1.0])))
