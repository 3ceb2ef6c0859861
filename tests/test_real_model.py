"""On a real model (SmolLM2-135M-Instruct, float32 on CPU), where random weights prove
nothing: a sentiment vector built by `contrast` from graphtap's own captures equals HF's
difference of means and steers answers the expected way; the same vector as a device
probe tells positive from negative prompts; head ablation equals HF's. One engine."""
import numpy as np
import pytest
import torch

from graphtap.demo import NEGATIVE, POSITIVE, QUESTIONS, SITE
from graphtap.testing.hf_reference import hf_capture, hf_generate

HEADS_AT = "blocks.3.attn.hook_z"
GOOD = ("thrilled", "fantastic", "love", "wonderful", "happy", "great", "delighted",
        "excited", "amazing", "beautiful", "favorite", "enjoy")
BAD = ("cruel", "chaos", "confusion", "not sure", "terrible", "sad", "awful", "hate",
       "bad", "horrible", "miserable", "procrastinat", "distracted", "worst")


def mood(text: str) -> int:
    text = text.lower()
    return sum(text.count(w) for w in GOOD) - sum(text.count(w) for w in BAD)


@pytest.fixture(scope="module")
def smol():
    from graphtap.testing.engines import _hf_model, make_llm, shutdown
    from graphtap.testing.real_model import smollm2

    path = smollm2()
    llm = make_llm(path, eager=True, hook_manager="graphtap",
                   hook_config={"sites": [SITE, HEADS_AT]})
    yield llm, path, _hf_model(str(path))
    shutdown(llm)


@pytest.fixture(scope="module")
def vector(smol):
    from graphtap.vectors import contrast

    llm, _, _ = smol
    return contrast(llm, POSITIVE, NEGATIVE, SITE)


def test_contrast_equals_hf_difference_of_means(smol, vector):
    llm, path, hf = smol
    tok = llm.get_tokenizer()

    def means(texts):
        rows = []
        for t in texts:
            ids = tok(t)["input_ids"]
            got, _, _ = hf_capture(hf, ids, 1, [SITE])
            rows.append(got[SITE][len(ids) - 1])
        return torch.stack(rows)
    pos, neg = means(POSITIVE), means(NEGATIVE)
    want = (pos.mean(0) - neg.mean(0)).numpy()
    assert np.abs(vector.values - want).max() <= 1e-4 * np.abs(want).max()
    unit = want / np.linalg.norm(want)
    assert vector.positive_projection == pytest.approx(float((pos.numpy() @ unit).mean()),
                                                       rel=1e-4)
    assert vector.positive_projection > vector.negative_projection


def test_the_vector_round_trips_through_a_vectors_dir_file(vector, tmp_path):
    from graphtap.spec import VectorRegistry
    from graphtap.vectors import ContrastVector

    vector.save(tmp_path / "joy.safetensors")
    back = ContrastVector.load(tmp_path / "joy.safetensors")
    assert np.array_equal(back.values, vector.values) and back.site == SITE
    assert back.metadata["n_positive"] == "4" and "prompts_sha256" in back.metadata
    registry = VectorRegistry(576, 4)
    assert registry.load_dir(str(tmp_path)) == 1 and registry.get("joy").dim == 576


def test_steering_with_the_built_vector_moves_the_answers(smol, vector):
    """+v makes the answers happier, -v gloomier (a fixed word list), and the steered
    tokens equal HF's with the same hook."""
    from vllm import SamplingParams

    from graphtap.vectors import chat_ids

    llm, _, hf = smol
    tok = llm.get_tokenizer()
    moods = {}
    for scale in (0.0, 1.0, -1.0):
        hooks = {"steer": [{"site": SITE, "op": "add", "vector": vector.values.tolist(),
                            "scale": scale}]} if scale else None
        prompts = [{"prompt_token_ids": chat_ids(tok, q)} for q in QUESTIONS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                    hooks=hooks), use_tqdm=False)
        moods[scale] = [mood(o.outputs[0].text) for o in outs]
        if scale == -1.0:  # parity with HF on one of them
            ids = prompts[1]["prompt_token_ids"]
            want, _ = hf_generate(hf, ids, 24, hooks)
            assert list(outs[1].outputs[0].token_ids) == want
    assert all(p > m for p, m in zip(moods[1.0], moods[-1.0])), moods
    assert sum(moods[1.0]) > sum(moods[0.0]) > sum(moods[-1.0]), moods


def test_the_vector_as_a_device_probe_separates_the_prompts(smol, vector):
    """The contrast direction as a probe (scored on the device at the last prompt token)
    ranks unseen positive sentences above negative ones, and equals HF's projection."""
    from vllm import SamplingParams

    llm, _, hf = smol
    tok = llm.get_tokenizer()
    unit = (vector.values / np.linalg.norm(vector.values)).tolist()
    hooks = {"probe": [{"site": SITE, "weights": [unit], "positions": "last_prompt"}]}
    happy = ["The party was a delight and we laughed all night.", "Thank you, this is lovely!"]
    sad = ["The funeral was grim and everyone cried.", "This is a disaster, I am miserable."]
    outs = llm.generate(happy + sad, SamplingParams(max_tokens=1, temperature=0.0, hooks=hooks),
                        use_tqdm=False)
    scores = [float(o.hooks[f"probe:{SITE}"][0, 0]) for o in outs]
    assert min(scores[:2]) > max(scores[2:]), scores
    ids = tok(sad[0])["input_ids"]
    got, _, _ = hf_capture(hf, ids, 1, [SITE])
    want = float(got[SITE][len(ids) - 1] @ torch.tensor(unit))
    assert scores[2] == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_head_ablation_equals_hf(smol):
    from graphtap.vectors import chat_ids
    from helpers import assert_parity, run

    llm, _, hf = smol
    ids = chat_ids(llm.get_tokenizer(), QUESTIONS[0])
    hooks = {"steer": [{"site": HEADS_AT, "op": "scale", "heads": [0, 4, 8], "scale": 0.0}]}
    got = run(llm, ids, hooks, max_tokens=16)
    assert_parity(got, hf_generate(hf, ids, 16, hooks))
    assert got[1] != run(llm, ids, max_tokens=16)[1]
